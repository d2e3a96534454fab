"""Processes as the pool handles them: who a job's compilers belong to, how a worker dies
with its parent, where its output goes, and what environment a job carries.

- **Process groups.** A worker leads a group of its own, and what its job starts (a
  compiler driver and the compilers it runs: g++ -> cc1plus, as, ld; Triton -> ptxas)
  stays in it, so that killing the group kills all of it (``kill_group``), and what a dead
  worker left running is killed before its job runs again (``kill_leftovers``).
- **Dying with the parent.** The parent holds the only write end of a worker's "alive"
  pipe; when it dies, the kernel signals the worker's whole group (``die_with_parent``),
  with no thread and no interpreter lock needed, so it works while the worker is deep in
  a compiler, and the compiler goes too.
- **Output.** A worker's fds 1 and 2 go to a capture file the parent also holds
  (``redirect_output``), so what LLVM or ptxas print is caught too.
- **The job's environment.** Some variables belong to a job rather than to the worker
  (Triton's settings, the visible devices): they travel with every job as they were when
  it was submitted (``job_env``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sys
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any, Callable

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
    if environ is os.environ and _CARRIED is not None:
        return _CARRIED.now()
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


class _Carried:
    """What ``job_env()`` makes of ``os.environ``, remade only when it changed. Every job
    pays the look, in the submitting thread: one C-level comparison of the environment's
    raw mapping with a copy of it, where filtering and decoding it each time would cost
    more than a trivial job's dispatch."""

    def __init__(self, data: dict[Any, Any], encode: Callable[[str], Any]) -> None:
        self._data = data
        self._prefixes = tuple(encode(p) for p in ENV_PREFIXES)
        self._names = frozenset(encode(n) for n in ENV_NAMES)
        self._seen: dict[Any, Any] | None = None
        self._env: dict[str, str] = {}

    def now(self) -> dict[str, str]:
        data = self._data
        if self._seen is not None and self._seen == data:
            return self._env
        snapshot = dict(data)
        decode_key, decode_value = os.environ.decodekey, os.environ.decodevalue
        prefixes, names = self._prefixes, self._names
        self._env = {decode_key(k): decode_value(v) for k, v in snapshot.items()
                     if k.startswith(prefixes) or k in names}
        self._seen = snapshot
        return self._env


def _carried() -> _Carried | None:
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return None
    return _Carried(data, encode)


_CARRIED = _carried()


def group_of_its_own() -> dict[str, Any]:
    """``subprocess.Popen``'s arguments that start a pool's process (a fork server, a
    spawned worker) as the leader of a process group of its own, in this process's session.

    A group of its own: a Ctrl-C meant for the application (the terminal signals its
    foreground group) does not reach it, and killing the group kills what it starts. This
    session rather than a new one: where Linux groups each session's processes for the
    scheduler (``kernel.sched_autogroup_enabled``, on by default in most distributions),
    a pool in a session of its own gets the CPU as a group equal to the serving process,
    whatever its niceness or ``SCHED_IDLE``: on 2 CPUs, two ``SCHED_IDLE`` busy loops in a
    new session made an event loop's 5 ms sleeps end 3.66 ms late at the p99, against
    0.08 ms in its own session. Python 3.10's ``Popen`` makes no group without a session:
    there it is a session of its own, as before."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"start_new_session": True}


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


def die_with_parent(alive_fd: int) -> None:
    """Arrange for the kernel to end this process, and the compilers it runs, when the
    parent dies.

    The parent holds the only write end of the ``alive`` pipe. When it dies, the pipe's
    last writer closes and, with O_ASYNC set, the kernel sends SIGIO, whose default action
    ends the process. This needs no thread and no GIL, so it works while the worker is
    deep inside a compiler call that holds the GIL, or hangs there.

    The signal goes to this process's whole group where it leads one (``lead_own_group``):
    a compiler driver and the compilers it runs (cc1plus, as; cicc, ptxas) are in it and
    end with it. Nobody else would kill them: a worker of the fork server has its group
    killed by the server, but a direct child of the parent (spawn, fork) has no one left.
    Never to a group it does not lead: that one is its parent's, with the parent's own
    neighbours in it.
    """
    signal.signal(signal.SIGIO, signal.SIG_DFL)
    # A negative owner is a process group (fcntl(2), F_SETOWN).
    owner = -os.getpid() if os.getpgrp() == os.getpid() else os.getpid()
    fcntl.fcntl(alive_fd, fcntl.F_SETOWN, owner)
    flags = fcntl.fcntl(alive_fd, fcntl.F_GETFL)
    fcntl.fcntl(alive_fd, fcntl.F_SETFL, flags | os.O_ASYNC | os.O_NONBLOCK)
    # The parent may have died before O_ASYNC was set; then no signal will come.
    try:
        if os.read(alive_fd, 1) == b"":
            os._exit(70)
    except BlockingIOError:
        pass


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


def set_parent_death_signal() -> None:
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


def file_tail(fd: int, limit: int) -> str:
    """The last ``limit`` bytes of the file ``fd`` (a process's captured output), decoded;
    "" if it cannot be read."""
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, limit, max(0, size - limit))
    except OSError:
        return ""
    return data.decode("utf-8", "replace")


def capture_file() -> int:
    # Unlinked at once: nothing is left on disk whatever happens to either process.
    with tempfile.TemporaryFile(prefix="aiocompile-worker-") as f:
        return os.dup(f.fileno())


def package_root() -> str:
    """The directory that holds the ``aiocompile`` package (imported already, as this
    module's parent)."""
    package = sys.modules["aiocompile"].__file__
    assert package is not None
    return os.path.dirname(os.path.dirname(os.path.abspath(package)))


def child_env() -> dict[str, str]:
    # The child must find this package even when it was put on sys.path by hand.
    env = dict(os.environ)
    root = package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def lower_priority(pid: int, nice: int, idle: bool = False) -> None:
    """Make a process of the pool (a worker, a fork server) ``nice`` steps nicer than this
    process, and with ``idle`` put it under ``SCHED_IDLE``: it runs only on CPU time that
    no other thread wants (a serving process's eager calls never wait for it).

    Compiles use every core they get; the event loop of the process that asked for them
    must still wake up on time. Done while the process is single-threaded (a worker that
    has just said it is ready: compilers start their threads in the first compile; a fork
    server just started, which stays so), so its later threads and children inherit it.
    One that cannot be reniced runs as it is.
    """
    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, pid, min(19, mine + nice))
    except (OSError, AttributeError):
        pass
    if idle:
        try:
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass
