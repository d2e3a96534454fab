"""What runs inside a worker process: the job loop, one job at a time.

A worker reads a job from its pipe, runs it, and writes back one answer on its socket
(the frames are in ``protocol``); the parent therefore always knows which job each worker
holds, and a worker that dies takes exactly one job with it.

The worker's stdout and stderr go to a capture file the parent also holds
(``procs.redirect_output``). The worker empties it at the start of a job that follows one
that printed, so after a crash the file holds what the dying job printed.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import NoReturn

from aiocompile._pool.procs import die_with_parent, job_env, lead_own_group, redirect_output
from aiocompile._pool.protocol import (
    LENGTH,
    STREAM_MIN,
    Inbox,
    decode_job,
    describe_failure,
    encode_done,
    encode_ready,
)
from aiocompile._pool.serialize import define


class JobState:
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


def run_one(
    state: JobState, env: dict[str, str] | None, sys_path: list[str] | None, payload: bytes | memoryview,
    buffers: tuple[memoryview, ...] = (),
) -> tuple[bool, bytes, float]:
    """Run one job; never raises (but may, of course, kill the process)."""
    started = time.perf_counter()
    try:
        state.apply(env, sys_path)
        fn, args, kwargs = pickle.loads(payload, buffers=buffers)
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - a job's failure, whatever it is, goes to its caller
        run_time = time.perf_counter() - started
        return False, describe_failure(exc), run_time
    run_time = time.perf_counter() - started
    try:
        return True, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL), run_time
    except BaseException as exc:  # noqa: BLE001
        error = TypeError(f"the job's result ({type(result).__name__}) could not be pickled: {exc}")
        return False, describe_failure(error), run_time


def serve(conn: Connection, jobs_fd: int) -> NoReturn:
    """The job loop: one job at a time until the parent closes the job pipe."""
    state = JobState()
    conn.send_bytes(encode_ready(os.getpid()))
    inbox = Inbox(jobs_fd)
    answers = conn.fileno()
    while True:
        try:
            message = memoryview(inbox.receive())
        except (EOFError, OSError):
            os._exit(0)
        job = decode_job(message)
        if state.output_written:
            _truncate_output()
        if job.definition is not None:
            define(*job.definition)
        ok, data, run_time = run_one(state, job.env, job.sys_path, job.payload, job.buffers)
        for std in (sys.stdout, sys.stderr):
            try:
                std.flush()
            except (OSError, ValueError, AttributeError):
                pass
        output_size = _output_size()
        state.output_written = output_size != 0
        follows = len(data) if len(data) >= STREAM_MIN else 0
        header = encode_done(job.job_id, ok, run_time, output_size, state.rss_after(run_time), follows)
        try:
            if follows:
                conn.send_bytes(header)
            elif len(data) < 1 << 16:
                # Framed as send_bytes frames it, in one write, without its checks.
                frame = memoryview(b"".join((LENGTH.pack(len(header) + len(data)), header, data)))
                while frame:
                    frame = frame[os.write(answers, frame):]
            else:
                conn.send_bytes(header + data)
            if follows:
                conn.send_bytes(data)
        except (BrokenPipeError, OSError):
            os._exit(0)
        del data, job, message


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
    from aiocompile._base import bytecode
    from aiocompile._pool.preload import Preload

    bytecode.install_for_process()
    # Only the first step (the imports): the warm-up steps pay off in a fork server that
    # forks many workers, not in one worker about to compile anyway.
    Preload(preload)
    start(job_fd, jobs_fd, alive_fd, output_fd)
