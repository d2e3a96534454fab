"""The fork server ("zygote"): a small process that preloads the compiler once and forks
workers from that warm state.

Why our own and not ``multiprocessing``'s forkserver: the stdlib one is shared by the whole
program (its preload list is global, and whoever starts it first decides), and every
process it starts re-imports the parent's ``__main__``, which in a serving application may
load a model or start a server. Ours is private to one pool, never imports ``__main__``,
reports each worker's exit status, and ends its workers when the parent goes away.

The zygote stays single-threaded, so forking it is safe. It imports the compiler and is
ready; then, whenever no fork is asked of it, it takes the next step of its warm-up:
computing the compiler's expensive one-time state (Triton hashes its whole shared library
for every cache key) and a throw-away compile. Workers forked during that time do the
work themselves, in parallel, as a fresh interpreter would; workers forked after it start
with all of it done, in a few milliseconds.

It talks to the parent over a ``SOCK_SEQPACKET`` socket; the messages are in
``protocol``. The parent's side is ``launch.ZygoteLauncher``.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import traceback
from typing import NoReturn

from aiocompile._base import bytecode, generated
from aiocompile._pool.preload import Preload
from aiocompile._pool.procs import kill_group, kill_leftovers, set_parent_death_signal
from aiocompile._pool.protocol import (
    CONTROL_MAX,
    Exited,
    Fork,
    Forked,
    Init,
    Kill,
    ZygoteMessage,
    ZygoteReady,
    decode_control,
    encode_control,
)

# Warm-up steps run only after this long without a fork asked for.
_QUIET = 0.05


class _Zygote:
    def __init__(self, ctrl: socket.socket, preload: Preload) -> None:
        self.ctrl = ctrl
        self.preload = preload
        self.children: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)

    def send(self, message: ZygoteMessage) -> None:
        self.ctrl.send(encode_control(message))

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # SIGCHLD wakes the select loop through the wakeup fd; the handler itself does
        # nothing, the loop reaps.
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        try:
            while True:
                # Warm up only while nobody asks for a fork: requests come in bursts (a pool
                # starting its workers), so a short quiet spell means the burst is over.
                timeout = _QUIET if self.preload.pending else None
                try:
                    readable, _, _ = select.select([self.ctrl.fileno(), self.wake_r], [], [], timeout)
                except InterruptedError:
                    continue
                if not readable:
                    self.preload.step()
                    continue
                if self.wake_r in readable:
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        pass
                    self.reap()
                if self.ctrl.fileno() in readable and not self.handle_request():
                    break
        finally:
            self.shutdown()

    def handle_request(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.ctrl, CONTROL_MAX, 4)
        except (ConnectionResetError, OSError):
            return False
        if not data:
            return False  # the parent is gone
        message = decode_control(data)
        if isinstance(message, Fork):
            self.fork(message.request_id, fds)
            return True
        if isinstance(message, Kill) and message.pid in self.children:
            kill_group(message.pid, message.signum)  # the worker and whatever compilers it runs
        for fd in fds:
            os.close(fd)
        return True

    def fork(self, request_id: int, fds: list[int]) -> None:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's side is measured through the pool's tests
            self.become_worker(*fds)
        # Its own process group, set from both sides of the fork (the worker does it too):
        # a kill sent right after the fork then reaches the group whichever ran first.
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        for fd in fds:
            os.close(fd)
        self.children.add(pid)
        self.send(Forked(request_id, pid))

    def become_worker(self, job_fd: int, jobs_fd: int, alive_fd: int, output_fd: int) -> NoReturn:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(self.wake_r)
            os.close(self.wake_w)
            self.ctrl.close()
            set_parent_death_signal()
            from aiocompile._pool import child

            child.start(job_fd, jobs_fd, alive_fd, output_fd)
        except BaseException:
            traceback.print_exc()
        os._exit(72)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            # Before the parent hears of the exit, and so before the job can run again.
            kill_leftovers(pid)
            try:
                self.send(Exited(pid, os.waitstatus_to_exitcode(status)))
            except OSError:
                pass

    def shutdown(self) -> None:
        for pid in list(self.children):
            kill_group(pid)
        for pid in list(self.children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def main(ctrl_fd: int) -> None:
    ctrl = socket.socket(fileno=ctrl_fd)
    os.set_inheritable(ctrl_fd, False)
    init = decode_control(ctrl.recv(CONTROL_MAX))
    if not isinstance(init, Init):
        raise SystemExit(f"the fork server expected its Init, got {init!r}")
    sys_path, cwd, preload = init.sys_path, init.cwd, init.preload
    sys.path[:] = sys_path
    try:
        os.chdir(cwd)
    except OSError:
        pass
    # Its imports (and its workers', forked from it) read and write aiocompile's bytecode
    # where the installation has none.
    bytecode.install_for_process()
    # Every worker runs the job loop: import it once, here, rather than in each of them.
    from aiocompile._pool import child  # noqa: F401

    loaded = Preload(preload)
    # The code its preload's imports generated and compiled, kept for the processes after.
    generated.flush()
    ctrl.send(encode_control(ZygoteReady(os.getpid(), loaded.problems)))
    _Zygote(ctrl, loaded).run()


if __name__ == "__main__":  # pragma: no cover
    main(int(sys.argv[1]))
