"""Starting, killing and reaping worker processes: the three start methods.

- ``forkserver`` (default on Linux): workers are forked from a private zygote process that
  has preloaded the compiler (see ``zygote``).
- ``spawn``: each worker is a fresh interpreter that preloads for itself. Slower to start,
  available everywhere ``fork`` is not wanted.
- ``fork``: workers are forked from this process. Only when asked: forking a process with
  threads (ours has at least the supervisor) or an initialised CUDA context is unsafe.

None of them imports the parent's ``__main__`` in the worker.

Every worker gets three descriptors: its job socket, the read end of an "alive" pipe whose
only writer is this process (the worker dies when it closes, see
``procs.die_with_parent``), and a capture file for its stdout and stderr. A launcher is
used by the pool's supervisor thread only.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Protocol

from aiocompile._pool.procs import (
    capture_file,
    child_env,
    file_tail,
    group_of_its_own,
    kill_group,
    kill_leftovers,
    lower_priority,
)
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

_OUTPUT_TAIL = 8192


@dataclass(eq=False)
class WorkerProcess:
    """The parent's handle on one worker process."""

    pid: int
    conn: Connection
    """Its socket: the worker's answers come on it, and its end shows as the socket's end."""
    alive_w: int
    output_fd: int
    jobs_w: int = -1
    """The write end of its job pipe: jobs go to the worker this way, on a pipe rather than
    the socket, because a worker asleep on a socket's read is woken each time the parent
    reads an answer from its end (room to write has grown), and a pipe's write is cheaper."""
    started_at: float = field(default_factory=time.monotonic)
    exitcode: int | None = None
    origin: int = 0
    """Which fork server started it (they are numbered), where one did."""

    def fileno(self) -> int:
        return self.conn.fileno()

    def output_tail(self, limit: int = _OUTPUT_TAIL) -> str:
        """The last ``limit`` bytes the worker printed during its current (or last) job."""
        return file_tail(self.output_fd, limit)

    def close(self) -> None:
        for close in (self.conn.close, lambda: os.close(self.jobs_w), lambda: os.close(self.alive_w),
                      lambda: os.close(self.output_fd)):
            try:
                close()
            except OSError:
                pass


class Launcher(Protocol):
    name: str

    def prepare(self) -> None:
        """Get ready to launch workers (start the fork server, say) without launching one."""

    def launch(self) -> WorkerProcess: ...

    def kill(self, worker: WorkerProcess) -> None: ...

    def wait_exit(self, worker: WorkerProcess, timeout: float) -> int | None: ...

    def fileno(self) -> int | None: ...

    def healthy(self, worker: WorkerProcess) -> bool:
        """False once the machinery behind ``worker`` (its fork server) has died: then it
        died through no fault of its job."""

    def on_readable(self) -> None: ...

    def interrupt(self) -> None:
        """From another thread, when the pool closes with nothing left to start: a start
        under way (a fork server's preload) gives up at once, and none begins."""

    def close(self) -> None: ...

    def forget(self) -> None:
        """In a forked child: drop this process's copies of descriptors, touching nothing."""


@dataclass
class _Descriptors:
    """A new worker's descriptors: the answer socket pair, the job pipe, the alive pipe and
    the capture file; the child's go to the worker, the parent keeps the others."""

    parent_sock: socket.socket
    child_sock: socket.socket
    jobs_r: int
    jobs_w: int
    alive_r: int
    alive_w: int
    output_fd: int

    @property
    def worker_fds(self) -> tuple[int, int, int, int]:
        """The worker's, in the order ``child.start`` takes them."""
        return self.child_sock.fileno(), self.jobs_r, self.alive_r, self.output_fd

    def close_worker_fds(self) -> None:
        """The parent's copies of the worker's descriptors, once it has them."""
        self.child_sock.close()
        _close_all(self.jobs_r, self.alive_r)

    def close_parent_fds(self) -> None:
        """The parent's own, when the worker did not start."""
        self.parent_sock.close()
        _close_all(self.jobs_w, self.alive_w, self.output_fd)

    def process(self, pid: int, origin: int = 0) -> WorkerProcess:
        return WorkerProcess(pid, Connection(self.parent_sock.detach()), self.alive_w, self.output_fd,
                             jobs_w=self.jobs_w, origin=origin)


# Room in a job pipe: a job is written whole by the thread that submits it (an event
# loop's, often), and a write larger than the room waits for the worker to read. A pipe
# has 64 KiB unless told otherwise (pipe(7)): widened, so that a caller's job is written
# at once.
_JOB_PIPE_SIZE = 1 << 20


def _worker_descriptors() -> _Descriptors:
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    jobs_r, jobs_w = os.pipe()
    try:
        fcntl.fcntl(jobs_w, getattr(fcntl, "F_SETPIPE_SZ", 1031), _JOB_PIPE_SIZE)
    except (OSError, AttributeError):
        pass  # not Linux, or over this system's limit: the default room, and a wait
    alive_r, alive_w = os.pipe()
    output_fd = capture_file()
    return _Descriptors(parent_sock, child_sock, jobs_r, jobs_w, alive_r, alive_w, output_fd)


def _close_all(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class LauncherError(RuntimeError):
    """The worker machinery itself failed to start (not a job's fault)."""


class ZygoteLauncher:
    """Workers forked from a private, preloaded zygote process."""

    name = "forkserver"

    def __init__(self, preload: tuple[str, ...], start_timeout: float = 120.0, nice: int = 0,
                 idle: bool = False) -> None:
        self._preload = list(preload)
        self._nice = nice
        self._idle = idle
        self._start_timeout = start_timeout
        self._ctrl: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._output_fd: int | None = None
        self._exits: dict[int, int] = {}
        self._forked: dict[int, int] = {}
        self._request_ids = 0
        self._generation = 0
        self.problems: list[str] = []
        # Set from another thread (``interrupt``): the fork server still starting, whose
        # ready message the launching thread waits for; and whether to start none.
        self._starting: subprocess.Popen[bytes] | None = None
        self._interrupted = False

    # -- the zygote itself ---------------------------------------------------------------

    def _ensure_zygote(self) -> socket.socket:
        if self._ctrl is not None and self._proc is not None and self._proc.poll() is None:
            return self._ctrl
        self._stop_zygote()
        if self._interrupted:
            raise LauncherError("the pool is closing: no worker fork server is started")
        self._generation += 1
        self._exits.clear()
        self._forked.clear()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._output_fd = capture_file()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "aiocompile._pool.zygote", str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=self._output_fd,
                stderr=self._output_fd,
                env=child_env(),
                # A process group of its own, in this session (see group_of_its_own).
                **group_of_its_own(),
            )
        finally:
            child.close()
        if self._nice or self._idle:
            # Its start-up (seconds of imports) and the workers it forks run at the
            # workers' priority, behind the program's own threads.
            lower_priority(self._proc.pid, self._nice, self._idle)
        self._ctrl = parent
        parent.send(encode_control(Init(list(sys.path), os.getcwd(), self._preload)))
        deadline = time.monotonic() + self._start_timeout
        self._starting = self._proc
        try:
            if self._interrupted:  # between the check above and now
                kill_group(self._proc.pid)
            while True:
                message = self._recv(deadline)
                if message is None:
                    tail = self._zygote_output()
                    self._stop_zygote()
                    if self._interrupted:
                        raise LauncherError("the pool closed while its worker fork server started")
                    raise LauncherError(f"the worker fork server did not start:\n{tail}")
                if isinstance(message, ZygoteReady):
                    self.problems = list(message.problems)
                    return parent
                self._note(message)
        finally:
            self._starting = None

    def _zygote_output(self) -> str:
        if self._output_fd is None:
            return ""
        try:
            size = os.fstat(self._output_fd).st_size
            return os.pread(self._output_fd, _OUTPUT_TAIL, max(0, size - _OUTPUT_TAIL)).decode("utf-8", "replace")
        except OSError:
            return ""

    def _recv(self, deadline: float | None) -> ZygoteMessage | None:
        """One control message; None when the deadline passed or the zygote is gone (then
        ``self._ctrl`` is None afterwards)."""
        if self._ctrl is None:
            return None
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._ctrl.settimeout(timeout)
        try:
            data = self._ctrl.recv(CONTROL_MAX)
        except (TimeoutError, BlockingIOError, InterruptedError):
            # Nothing there (a zero timeout makes the socket non-blocking): not an end.
            return None
        except OSError:
            data = b""
        finally:
            if self._ctrl is not None:
                self._ctrl.settimeout(None)
        if not data:
            # The zygote died; its workers die with it (PR_SET_PDEATHSIG) and the next
            # launch starts a new one.
            self._ctrl.close()
            self._ctrl = None
            return None
        return decode_control(data)

    def _note(self, message: ZygoteMessage) -> None:
        if isinstance(message, Exited):
            self._exits[message.pid] = message.exitcode
        elif isinstance(message, Forked):
            self._forked[message.request_id] = message.pid

    def _stop_zygote(self) -> None:
        if self._ctrl is not None:
            self._ctrl.close()
            self._ctrl = None
        if self._proc is not None:
            # Closing the control socket makes the zygote kill its workers and exit.
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._output_fd is not None:
            _close_all(self._output_fd)
            self._output_fd = None

    # -- the Launcher interface ----------------------------------------------------------

    def prepare(self) -> None:
        self._ensure_zygote()

    def launch(self) -> WorkerProcess:
        ctrl = self._ensure_zygote()
        fds = _worker_descriptors()
        self._request_ids += 1
        request_id = self._request_ids
        try:
            socket.send_fds(ctrl, [encode_control(Fork(request_id))], list(fds.worker_fds))
        except OSError as exc:
            fds.close_parent_fds()
            raise LauncherError(f"the worker fork server is gone: {exc}") from exc
        finally:
            fds.close_worker_fds()
        deadline = time.monotonic() + 30
        while request_id not in self._forked:
            message = self._recv(deadline)
            if message is None:
                fds.close_parent_fds()
                raise LauncherError(f"the worker fork server did not answer:\n{self._zygote_output()}")
            self._note(message)
        pid = self._forked.pop(request_id)
        return fds.process(pid, origin=self._generation)

    def kill(self, worker: WorkerProcess) -> None:
        # The zygote kills only children it has not reaped yet, so a recycled pid is safe.
        if self._ctrl is None:
            return
        try:
            self._ctrl.send(encode_control(Kill(worker.pid, signal.SIGKILL)))
        except OSError:
            pass

    def wait_exit(self, worker: WorkerProcess, timeout: float) -> int | None:
        if worker.origin != self._generation:
            return None  # its fork server is gone, and with it the exit status
        deadline = time.monotonic() + timeout
        while worker.pid not in self._exits:
            if self._ctrl is None:
                return None
            message = self._recv(deadline)
            if message is None:
                return None
            self._note(message)
        return self._exits.pop(worker.pid)

    def fileno(self) -> int | None:
        return None if self._ctrl is None else self._ctrl.fileno()

    def healthy(self, worker: WorkerProcess) -> bool:
        return self._ctrl is not None and worker.origin == self._generation

    def on_readable(self) -> None:
        # Exit reports arrive on their own; keep them until the worker's socket closes.
        message = self._recv(time.monotonic())
        if message is not None:
            self._note(message)

    def interrupt(self) -> None:
        self._interrupted = True
        starting = self._starting
        if starting is not None:
            # Its preload (seconds of imports, and for a model on the CPU a C++ build, all
            # in its group) ends here; the launching thread reads the end of its socket.
            kill_group(starting.pid)

    def close(self) -> None:
        self._stop_zygote()

    def forget(self) -> None:
        if self._ctrl is not None:
            self._ctrl.close()
            self._ctrl = None
        if self._output_fd is not None:
            _close_all(self._output_fd)
            self._output_fd = None
        self._proc = None


class _DirectChildren:
    """What launchers of direct children share: no fork server to watch or to lose."""

    def prepare(self) -> None:
        pass

    def fileno(self) -> int | None:
        return None

    def healthy(self, worker: WorkerProcess) -> bool:
        return True

    def on_readable(self) -> None:
        pass

    def interrupt(self) -> None:
        pass  # a launch starts a process and returns: there is nothing to wait for


class SpawnLauncher(_DirectChildren):
    """Each worker a fresh interpreter, a direct child of this process."""

    name = "spawn"

    def __init__(self, preload: tuple[str, ...]) -> None:
        self._preload = ",".join(preload)
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self.problems: list[str] = []

    def launch(self) -> WorkerProcess:
        fds = _worker_descriptors()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", "from aiocompile._pool.child import spawn_main; spawn_main()",
                 *(str(fd) for fd in fds.worker_fds), self._preload],
                pass_fds=fds.worker_fds,
                stdin=subprocess.DEVNULL,
                stdout=fds.output_fd,
                stderr=fds.output_fd,
                env=child_env(),
                cwd=os.getcwd(),
                **group_of_its_own(),
            )
        except OSError as exc:
            fds.close_parent_fds()
            raise LauncherError(f"could not start a worker: {exc}") from exc
        finally:
            fds.close_worker_fds()
        self._procs[proc.pid] = proc
        return fds.process(proc.pid)

    def kill(self, worker: WorkerProcess) -> None:
        proc = self._procs.get(worker.pid)
        if proc is not None and proc.returncode is None:
            kill_group(proc.pid)  # a group of its own: its compilers with it

    def wait_exit(self, worker: WorkerProcess, timeout: float) -> int | None:
        proc = self._procs.get(worker.pid)
        if proc is None:
            return None
        if proc.returncode is None:  # not reaped yet: its pid is still its own
            kill_leftovers(proc.pid)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        del self._procs[worker.pid]
        return code

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.returncode is None:
                kill_group(proc.pid)
        for proc in self._procs.values():
            proc.wait()
        self._procs.clear()

    def forget(self) -> None:
        self._procs.clear()


class ForkLauncher(_DirectChildren):
    """Workers forked straight from this process (only when asked for)."""

    name = "fork"

    def __init__(self, preload: tuple[str, ...]) -> None:
        from aiocompile._pool.preload import Preload

        # Imports only: the warm-up steps are for a process of our own (they set
        # environment variables for a moment), and this one is the application's.
        self.problems = Preload(list(preload)).problems
        self._pids: set[int] = set()

    def launch(self) -> WorkerProcess:
        fds = _worker_descriptors()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's side is exercised through the pool
            try:
                # Keep only our own descriptors: a copy of a sibling's alive pipe would
                # keep that sibling alive after the parent died.
                keep = sorted({0, 1, 2, *fds.worker_fds})
                for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
                    os.closerange(low + 1, high)
                from aiocompile._pool import child

                child.start(fds.child_sock.detach(), fds.jobs_r, fds.alive_r, fds.output_fd)
            finally:
                os._exit(72)
        try:
            os.setpgid(pid, pid)  # as the worker does itself (see zygote.fork)
        except OSError:
            pass
        fds.close_worker_fds()
        self._pids.add(pid)
        return fds.process(pid)

    def kill(self, worker: WorkerProcess) -> None:
        if worker.pid in self._pids:
            kill_group(worker.pid)

    def wait_exit(self, worker: WorkerProcess, timeout: float) -> int | None:
        if worker.pid not in self._pids:
            return None
        kill_leftovers(worker.pid)  # not reaped yet: its pid is still its own
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(worker.pid, os.WNOHANG)
            if pid:
                self._pids.discard(worker.pid)
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.001)

    def close(self) -> None:
        for pid in list(self._pids):
            kill_group(pid)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self._pids.clear()

    def forget(self) -> None:
        self._pids.clear()


def default_start_method() -> str:
    if sys.platform.startswith("linux") and hasattr(socket, "SOCK_SEQPACKET") and hasattr(socket, "send_fds"):
        return "forkserver"
    return "spawn"


def make_launcher(start_method: str | None, preload: tuple[str, ...], nice: int = 0,
                  idle: bool = False) -> Launcher:
    """The launcher of a start method; ``nice``: how much nicer than this process a fork
    server runs, ``idle``: whether under ``SCHED_IDLE`` (workers are lowered by the
    supervisor whatever launches them)."""
    method = start_method or default_start_method()
    if method == "forkserver":
        return ZygoteLauncher(preload, nice=nice, idle=idle)
    if method == "spawn":
        return SpawnLauncher(preload)
    if method == "fork":
        return ForkLauncher(preload)
    raise ValueError(f"unknown start method {start_method!r}; expected 'forkserver', 'spawn' or 'fork'")
