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
from collections.abc import Iterator
from typing import Any, NoReturn

_MAX_MESSAGE = 1 << 20
_QUIET = 0.05


class Preload:
    """The preload entries: ``module`` is imported; ``module:function`` is imported and
    ``function()`` called. A function may be a generator: what it does before its first
    ``yield`` happens at once, each later step by ``step()``, one at a time.

    A broken entry makes workers slower, not wrong, so it is reported in ``problems``
    rather than raised.
    """

    def __init__(self, entries: list[str]) -> None:
        self.problems: list[str] = []
        self._steps: list[tuple[str, Iterator[Any]]] = []
        for entry in entries:
            module_name, _, func_name = entry.partition(":")
            try:
                module = importlib.import_module(module_name)
                result = getattr(module, func_name)() if func_name else None
                if isinstance(result, Iterator):
                    self._steps.append((entry, result))
                    self.step()
            except Exception:
                self.problems.append(f"preloading {entry!r} failed:\n{traceback.format_exc()}")

    @property
    def pending(self) -> bool:
        return bool(self._steps)

    def step(self) -> None:
        """Run the next step of the first unfinished entry."""
        if not self._steps:
            return
        entry, steps = self._steps[0]
        try:
            next(steps)
        except StopIteration:
            self._steps.pop(0)
        except Exception:
            self._steps.pop(0)
            self.problems.append(f"preloading {entry!r} failed:\n{traceback.format_exc()}")

    def finish(self) -> list[str]:
        while self._steps:
            self.step()
        return self.problems


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
    def __init__(self, ctrl: socket.socket, preload: Preload) -> None:
        self.ctrl = ctrl
        self.preload = preload
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
            data, fds, _, _ = socket.recv_fds(self.ctrl, _MAX_MESSAGE, 4)
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
                from aiocompile._pool.child import kill_group

                kill_group(pid, signum)  # the worker and whatever compilers it runs
        for fd in fds if message[0] != "fork" else ():
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
        self.send(("forked", request_id, pid))

    def become_worker(self, job_fd: int, jobs_fd: int, alive_fd: int, output_fd: int) -> NoReturn:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(self.wake_r)
            os.close(self.wake_w)
            self.ctrl.close()
            _set_parent_death_signal()
            from aiocompile._pool import child

            child.start(job_fd, jobs_fd, alive_fd, output_fd)
        except BaseException:
            traceback.print_exc()
        os._exit(72)

    def reap(self) -> None:
        from aiocompile._pool.child import kill_leftovers

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
                self.send(("exit", pid, os.waitstatus_to_exitcode(status)))
            except OSError:
                pass

    def shutdown(self) -> None:
        from aiocompile._pool.child import kill_group

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
    message = pickle.loads(ctrl.recv(_MAX_MESSAGE))
    _, sys_path, cwd, preload = message
    sys.path[:] = sys_path
    try:
        os.chdir(cwd)
    except OSError:
        pass
    # Every worker runs the job loop: import it once, here, rather than in each of them.
    from aiocompile._pool import child  # noqa: F401

    loaded = Preload(preload)
    ctrl.send(pickle.dumps(("ready", os.getpid(), loaded.problems)))
    _Zygote(ctrl, loaded).run()


if __name__ == "__main__":  # pragma: no cover
    main(int(sys.argv[1]))
