"""What runs inside a worker process: the job loop.

A worker holds one job at a time. It reads a job from its socket, runs it, and writes back
one ``done`` message; the parent therefore always knows which job each worker holds, and a
worker that dies takes exactly one job with it.

Protocol: jobs come on a pipe, answers go back on a socket (whose end the parent sees
when the worker dies), each message framed as ``multiprocessing.connection`` frames it (a
4-byte length, or -1 and an 8-byte length):

    worker -> parent   ("ready", pid)                                   pickled
    parent -> worker   job_id, len(extra) (``JOB_HEADER``), extra, payload
                         extra: pickled (env, sys_path), or nothing when both are the same
                                as this worker's last job's
                         payload: pickled (fn, args, kwargs)
    worker -> parent   "D", job_id, ok, run_time, output_size, rss, follows (``DONE``), data
                         read by the parent as the tuple
                         ("done", job_id, ok, data, run_time, output_size, rss, follows)
                         (``parse_message``)
                         ok=True:  data = pickled result
                         ok=False: data = pickled _Failure
                         follows:  0, or (for data of STREAM_MIN bytes or more) data is None
                                   and comes as the next message, of that many bytes, which
                                   the parent unpickles as it reads (see ``_answers``)

The worker's stdout and stderr (fds 1 and 2, so that LLVM and ptxas output is caught too)
go to a file the parent also holds. The worker empties it at the start of every job, so
after a crash the file holds what the dying job printed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import signal
import struct
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NoReturn

# Environment variables that belong to a job rather than to the worker: they are carried
# from the parent with every job, as they were when the job was submitted.
ENV_PREFIXES = ("TRITON_", "MLIR_", "LLVM_", "AMDGCN_", "NVPTX_")
ENV_NAMES = frozenset(
    {"DISABLE_LLVM_OPT", "DISABLE_PTXAS_OPT", "PTXAS_OPTIONS", "USE_IR_LOC", "ALLOW_LHS_TMEM_LAYOUT_CONVERSION",
     "DISABLE_MMA_V3", "DISABLE_MMA_V5", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"}
)


def job_env(environ: os._Environ[str] | dict[str, str] = os.environ) -> dict[str, str]:
    """The part of an environment that a job carries with it.

    For ``os.environ`` the same dict is returned for as long as the environment stays as
    it was, so that callers can tell "unchanged" by identity; it must not be modified."""
    global _env_seen
    if environ is os.environ and _RAW_ENV is not None:
        # Every job pays this, in the caller's thread. Comparing os.environ's raw mapping
        # with a copy of it is one C-level dict comparison (about 1 µs for 35 variables);
        # filtering and decoding it again only when it changed.
        data, prefixes, names = _RAW_ENV
        seen = _env_seen
        if seen is not None and seen[0] == data:
            return seen[1]
        snapshot = dict(data)
        decode_key, decode_value = os.environ.decodekey, os.environ.decodevalue
        env = {decode_key(k): decode_value(v) for k, v in snapshot.items() if k.startswith(prefixes) or k in names}
        _env_seen = (snapshot, env)
        return env
    return {k: v for k, v in environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


@contextlib.contextmanager
def environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """``values`` in this process's environment for the block (None: unset), and what
    was there before put back after it."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        _set_environment(values)
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: Mapping[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _raw_env() -> tuple[dict[Any, Any], tuple[Any, ...], frozenset[Any]] | None:
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return None
    return data, tuple(encode(p) for p in ENV_PREFIXES), frozenset(encode(n) for n in ENV_NAMES)


_RAW_ENV = _raw_env()
# os.environ's raw mapping as job_env() last read it, and what it made of it.
_env_seen: tuple[dict[Any, Any], dict[str, str]] | None = None


# Answers this large or larger follow their ``done`` message as a message of their own, so
# that the parent can rebuild them as it reads them instead of copying them whole.
STREAM_MIN = 1 << 20


@dataclass
class _Failure:
    """A job's exception, described in plain values that any process can unpickle, with
    the exception itself pickled apart (None when it won't pickle): the parent may lack
    what rebuilding it takes (its class's module, say), and must still learn what it was."""

    exc_data: bytes | None
    type_name: str
    message: str
    traceback: str


class _JobState:
    """The worker's memory between jobs: the environment and import path sent last."""

    def __init__(self) -> None:
        self.env: dict[str, str] | None = None
        self.sys_path: list[str] | None = None
        self.output_written = True  # unknown at first: empty the capture file
        # /proc/self/statm, opened at the first job and kept open: reading it is then one
        # pread per job rather than open/read/close. (Not at construction: a module-level
        # state in the parent, for foreign executors' workers, must not hold it open.)
        self._statm: int | None = None
        self._statm_tried = False
        self._rss = 0
        self._unmeasured = _RSS_EVERY  # seconds of jobs run since the last measure

    def rss_after(self, run_time: float) -> int:
        """The resident memory after a job that ran ``run_time`` seconds. Measured once
        at least ``_RSS_EVERY`` seconds of jobs have run since the last measure (the first
        job's included): reading it costs several microseconds, more than a trivial job
        itself, and a millisecond of work can grow a process by a few megabytes at most."""
        self._unmeasured += run_time
        if self._unmeasured >= _RSS_EVERY:
            self._unmeasured = 0.0
            self._rss = self.rss()
        return self._rss

    def rss(self) -> int:
        if not self._statm_tried:
            self._statm_tried = True
            try:
                self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._statm = None
        if self._statm is not None:
            try:
                return int(os.pread(self._statm, 128, 0).split()[1]) * _PAGE_SIZE
            except (OSError, ValueError, IndexError):
                pass
        return _rss()

    def apply(self, env: dict[str, str] | None, sys_path: list[str] | None) -> None:
        # None: the same as the last job's (the parent sends each only when it changed).
        # A variable the job does not carry was unset in the parent when it was submitted:
        # unset it here too, so that no job sees another's (or the worker's) settings.
        # Read afresh each time: the last job may have changed the environment itself.
        if env is None:
            env = self.env
        else:
            self.env = env
        current = job_env()
        if env is not None and current != env:
            for name in current:
                if name not in env:
                    del os.environ[name]
            os.environ.update(env)
        if sys_path is not None and sys_path != self.sys_path:
            sys.path[:] = sys_path
            self.sys_path = list(sys_path)


def redirect_output(output_fd: int) -> None:
    """Send fds 1 and 2 to the capture file, so C-level output is caught as well."""
    flags = fcntl.fcntl(output_fd, fcntl.F_GETFL)
    fcntl.fcntl(output_fd, fcntl.F_SETFL, flags | os.O_APPEND)
    for std in (sys.stdout, sys.stderr):
        try:
            if std is not None:
                std.flush()
        except (OSError, ValueError):
            pass
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    if output_fd > 2:
        os.close(output_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def die_with_parent(alive_fd: int) -> None:
    """Arrange for the kernel to end this process when the parent dies.

    The parent holds the only write end of the ``alive`` pipe. When it dies, the pipe's
    last writer closes and, with O_ASYNC set, the kernel sends SIGIO, whose default action
    ends the process. This needs no thread and no GIL, so it works while the worker is
    deep inside a compiler call that holds the GIL, or hangs there.
    """
    signal.signal(signal.SIGIO, signal.SIG_DFL)
    fcntl.fcntl(alive_fd, fcntl.F_SETOWN, os.getpid())
    flags = fcntl.fcntl(alive_fd, fcntl.F_GETFL)
    fcntl.fcntl(alive_fd, fcntl.F_SETFL, flags | os.O_ASYNC | os.O_NONBLOCK)
    # The parent may have died before O_ASYNC was set; then no signal will come.
    try:
        if os.read(alive_fd, 1) == b"":
            os._exit(70)
    except BlockingIOError:
        pass


def _output_size(fd: int = 2) -> int:
    try:
        # The end of the capture file is its size (it is opened for appending, so moving
        # the offset there changes nothing), without building a stat result per job.
        return os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        return 0


def _truncate_output() -> None:
    for std in (sys.stdout, sys.stderr):
        try:
            std.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        os.ftruncate(2, 0)
    except OSError:
        pass


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# How many seconds of jobs may run between two measures of the worker's resident memory.
_RSS_EVERY = 0.001


def _rss() -> int:
    """This process's resident memory now, in bytes (its peak where "now" is unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        # ru_maxrss is in KiB on Linux, in bytes on macOS.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):
        return 0


def _describe_failure(exc: BaseException) -> bytes:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    message = str(exc)
    exc_data: bytes | None
    try:
        # Tracebacks do not pickle; keep the cause chain's text in ``traceback`` instead.
        exc.__traceback__ = None
        exc_data = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(exc_data)  # an exception can pickle but fail to unpickle (bad __init__)
    except Exception:
        exc_data = None
    return pickle.dumps(_Failure(exc_data, name, message, tb), protocol=pickle.HIGHEST_PROTOCOL)


def describe_job_failure(exc: BaseException) -> bytes:
    """A job's exception as its caller is sent it (a pickled ``_Failure``), by whichever
    worker ran the job: aiocompile's own, or a foreign executor's."""
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        # A job that calls sys.exit() must not take the worker's loop with it.
        exc = RuntimeError(f"the job raised {type(exc).__name__}({exc})")
    return _describe_failure(exc)


def run_one(
    state: _JobState, env: dict[str, str] | None, sys_path: list[str] | None, payload: bytes | memoryview
) -> tuple[bool, bytes, float]:
    """Run one job; never raises (but may, of course, kill the process)."""
    started = time.perf_counter()
    try:
        state.apply(env, sys_path)
        fn, args, kwargs = pickle.loads(payload)
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - a job's failure, whatever it is, goes to its caller
        run_time = time.perf_counter() - started
        return False, describe_job_failure(exc), run_time
    run_time = time.perf_counter() - started
    try:
        return True, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL), run_time
    except BaseException as exc:  # noqa: BLE001
        error = TypeError(f"the job's result ({type(result).__name__}) could not be pickled: {exc}")
        return False, _describe_failure(error), run_time


_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")
_FIRST_READ = 4096
# A job's message starts with its id and the length of what follows before its payload:
# a header, not a pickled tuple, so that neither side pickles the payload a second time.
JOB_HEADER = struct.Struct("!QI")
# A job's answer starts with this header, and its data follows (nothing, for a streamed
# answer); the other messages are pickled, and no pickle starts with "D".
DONE = struct.Struct("!cQ?dQQQ")


def parse_message(data: bytes | memoryview) -> tuple[Any, ...]:
    """A worker's message as a tuple: ``("ready", pid)`` or ``("done", job_id, ok, data,
    run_time, output_size, rss, follows)``, where ``data`` is a view into ``data``."""
    if data[:1] == b"D":
        _, job_id, ok, run_time, output_size, rss, follows = DONE.unpack_from(data)
        body = None if follows else memoryview(data)[DONE.size:]
        return "done", job_id, ok, body, run_time, output_size, rss, follows
    message: tuple[Any, ...] = pickle.loads(data)
    return message


class _Inbox:
    """The parent's messages on the job pipe ``fd``, framed as
    ``multiprocessing.connection`` frames them (a 4-byte length, or -1 and an 8-byte
    length), read with as few system calls as a job allows: one blocking read for a whole
    small message. (On the pipe, unlike the answer socket, nothing wakes that read but a
    job: the parent reading an answer touches only the socket.)"""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._held = b""  # bytes read past the last message (the parent sends one at a time)

    def _more(self, size: int) -> bytes:
        data = os.read(self._fd, size)
        if not data:
            raise EOFError("the parent closed the job socket")
        return data

    def receive(self) -> bytes | bytearray | memoryview:
        data = self._held
        if not data:
            # A few kilobytes hold most jobs; a larger buffer costs its allocation each time.
            data = self._more(_FIRST_READ)
        while len(data) < 4:
            data += self._more(_FIRST_READ)
        size, start = _LENGTH.unpack_from(data)[0], 4
        if size == -1:
            while len(data) < 12:
                data += self._more(_FIRST_READ)
            size, start = _LONG_LENGTH.unpack_from(data, 4)[0], 12
        end = start + size
        if len(data) >= end:
            self._held = data[end:]
            return memoryview(data)[start:end]
        # A large message: the rest straight into its buffer.
        body = bytearray(size)
        have = len(data) - start
        body[:have] = data[start:]
        view = memoryview(body)
        while have < size:
            count = os.readv(self._fd, [view[have:have + min(size - have, 1 << 22)]])
            if not count:
                raise EOFError("the parent closed the job socket")
            have += count
        self._held = b""
        return body


def serve(conn: Connection, jobs_fd: int) -> NoReturn:
    """The job loop: one job at a time until the parent closes the job pipe."""
    state = _JobState()
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    inbox = _Inbox(jobs_fd)
    answers = conn.fileno()
    while True:
        try:
            message = memoryview(inbox.receive())
        except (EOFError, OSError):
            os._exit(0)
        job_id, extra = JOB_HEADER.unpack_from(message)
        start = JOB_HEADER.size + extra
        env, sys_path = pickle.loads(message[JOB_HEADER.size:start]) if extra else (None, None)
        payload = message[start:]
        if state.output_written:
            _truncate_output()
        ok, data, run_time = run_one(state, env, sys_path, payload)
        for std in (sys.stdout, sys.stderr):
            try:
                std.flush()
            except (OSError, ValueError, AttributeError):
                pass
        output_size = _output_size()
        state.output_written = output_size != 0
        follows = len(data) if len(data) >= STREAM_MIN else 0
        header = DONE.pack(b"D", job_id, ok, run_time, output_size, state.rss_after(run_time), follows)
        try:
            if follows:
                conn.send_bytes(header)
            elif len(data) < 1 << 16:
                # Framed as send_bytes frames it, in one write, without its checks.
                frame = memoryview(b"".join((_LENGTH.pack(DONE.size + len(data)), header, data)))
                while frame:
                    frame = frame[os.write(answers, frame):]
            else:
                conn.send_bytes(header + data)
            if follows:
                conn.send_bytes(data)
        except (BrokenPipeError, OSError):
            os._exit(0)
        del data, payload, message


def lead_own_group() -> None:
    """Make this process the leader of a process group of its own (a no-op where it is
    already, as a session leader is). What a job starts (a compiler driver and the
    compilers it runs: g++ -> cc1plus, as, ld; Triton -> ptxas) stays in the group, so that
    killing the group kills all of it; killing the worker alone would leave them running."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass


def kill_group(pid: int, signum: int = signal.SIGKILL) -> None:
    """Send ``signum`` to worker ``pid`` and everything in its process group; to the worker
    alone where it does not lead one (yet)."""
    try:
        os.killpg(pid, signum)
        return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def kill_leftovers(pid: int) -> None:
    """Kill what is left of dead worker ``pid``'s process group: the compilers it was
    running when it died (an OOM kill, a segfault, a SIGKILL from outside), which would
    otherwise run on and write the very files the job's retry is writing. Only for a
    worker whose pid cannot have been reused: not yet reaped, or reaped just now by the
    caller (a group that still has members keeps its id from being handed out)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # no one left in the group
        pass


def start(job_fd: int, jobs_fd: int, alive_fd: int, output_fd: int) -> NoReturn:
    """Become a worker on the given descriptors (after fork, or in a fresh interpreter):
    its answer socket, job pipe, alive pipe and capture file."""
    lead_own_group()
    for fd in (job_fd, jobs_fd, alive_fd, output_fd):
        # Keep our descriptors out of the compilers' own subprocesses.
        os.set_inheritable(fd, False)
    redirect_output(output_fd)
    die_with_parent(alive_fd)
    # Ctrl-C in a terminal goes to the whole foreground process group; the parent decides
    # what happens to running jobs, not the signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve(Connection(job_fd), jobs_fd)
    except BaseException:
        traceback.print_exc()
        os._exit(71)


def spawn_main() -> NoReturn:  # pragma: no cover - runs in a fresh interpreter
    """Entry point of a worker started in a fresh interpreter (the "spawn" start method)."""
    job_fd, jobs_fd, alive_fd, output_fd = (int(a) for a in sys.argv[1:5])
    preload = [m for m in sys.argv[5].split(",") if m] if len(sys.argv) > 5 else []
    from aiocompile._pool.zygote import Preload

    # Only the first step (the imports): the warm-up steps pay off in a fork server that
    # forks many workers, not in one worker about to compile anyway.
    Preload(preload)
    start(job_fd, jobs_fd, alive_fd, output_fd)
