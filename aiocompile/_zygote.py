"""The fork server ("zygote"): a small process that preloads the compiler once and forks
workers from that warm state.

Why our own and not ``multiprocessing``'s forkserver: the stdlib one is shared by the whole
program (its preload list is global, and whoever starts it first decides), and every
process it starts re-imports the parent's ``__main__``, which in a serving application may
load a model or start a server. Ours is private to one pool, never imports ``__main__``,
reports each worker's exit status, and ends its workers when the parent goes away.

The zygote stays single-threaded, so forking it is safe: it imports the compiler, computes
the compiler's expensive one-time state (Triton hashes its whole shared library for every
cache key) and runs a warm-up compile, all before the first fork. A forked worker starts
in a few milliseconds with all of that done.

Control protocol (pickled tuples over a SOCK_SEQPACKET socket, file descriptors attached
with SCM_RIGHTS):

    parent -> zygote   ("init", sys_path, cwd, preload)
    zygote -> parent   ("ready", pid, problems)
    parent -> zygote   ("fork", request_id)  + [job_fd, alive_fd, output_fd]
    zygote -> parent   ("forked", request_id, pid)
    parent -> zygote   ("kill", pid, signum)
    zygote -> parent   ("exit", pid, exitcode)          exitcode < 0: killed by a signal
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import socket
import sys
import traceback
from typing import NoReturn

_MAX_MESSAGE = 1 << 20


def preload_modules(entries: list[str], *, warm: bool) -> list[str]:
    """Import each entry; an entry ``module:function`` also calls ``function(warm=...)``.

    Returns a description of each entry that failed: a broken preload makes workers
    slower, not wrong, so it is reported rather than fatal.
    """
    problems = []
    for entry in entries:
        module_name, _, func_name = entry.partition(":")
        try:
            module = importlib.import_module(module_name)
            if func_name:
                getattr(module, func_name)(warm=warm)
        except Exception:
            problems.append(f"preloading {entry!r} failed:\n{traceback.format_exc()}")
    return problems


def _set_parent_death_signal() -> None:
    # Linux only: if the zygote itself is killed, its workers go with it.
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass


class _Zygote:
    def __init__(self, ctrl: socket.socket) -> None:
        self.ctrl = ctrl
        self.children: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)

    def send(self, message: tuple[object, ...]) -> None:
        self.ctrl.send(pickle.dumps(message))

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # SIGCHLD wakes the select loop through the wakeup fd; the handler itself does
        # nothing, the loop reaps.
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        try:
            while True:
                try:
                    readable, _, _ = select.select([self.ctrl.fileno(), self.wake_r], [], [])
                except InterruptedError:
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
            data, fds, _, _ = socket.recv_fds(self.ctrl, _MAX_MESSAGE, 3)
        except (ConnectionResetError, OSError):
            return False
        if not data:
            return False  # the parent is gone
        message = pickle.loads(data)
        if message[0] == "fork":
            self.fork(message[1], fds)
        elif message[0] == "kill":
            _, pid, signum = message
            if pid in self.children:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        for fd in fds if message[0] != "fork" else ():
            os.close(fd)
        return True

    def fork(self, request_id: int, fds: list[int]) -> None:
        job_fd, alive_fd, output_fd = fds
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's side is measured through the pool's tests
            self.become_worker(job_fd, alive_fd, output_fd)
        for fd in fds:
            os.close(fd)
        self.children.add(pid)
        self.send(("forked", request_id, pid))

    def become_worker(self, job_fd: int, alive_fd: int, output_fd: int) -> NoReturn:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(self.wake_r)
            os.close(self.wake_w)
            self.ctrl.close()
            _set_parent_death_signal()
            from aiocompile import _worker

            _worker.start(job_fd, alive_fd, output_fd)
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
            try:
                self.send(("exit", pid, os.waitstatus_to_exitcode(status)))
            except OSError:
                pass

    def shutdown(self) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(self.children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def main(ctrl_fd: int) -> None:
    ctrl = socket.socket(fileno=ctrl_fd)
    os.set_inheritable(ctrl_fd, False)
    message = pickle.loads(ctrl.recv(_MAX_MESSAGE))
    _, sys_path, cwd, preload = message
    sys.path[:] = sys_path
    try:
        os.chdir(cwd)
    except OSError:
        pass
    problems = preload_modules(preload, warm=True)
    ctrl.send(pickle.dumps(("ready", os.getpid(), problems)))
    _Zygote(ctrl).run()


if __name__ == "__main__":  # pragma: no cover
    main(int(sys.argv[1]))
