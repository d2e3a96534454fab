"""WorkerPool: a ``concurrent.futures.Executor`` that supervises one job per worker process.

Each worker holds at most one job, sent over its own socket, so the parent always knows
which job a worker holds. That is what makes the rest exact:

- a worker that dies (segfault, OOM kill, ``os._exit``) takes exactly one job with it; that
  job is retried on another worker, and fails with ``WorkerCrashedError`` once it has killed
  ``max_crashes`` workers. Jobs in other workers never notice.
- a job past its timeout is stopped by killing its worker only (``CompileTimeout``).
- a queued job can be cancelled; a running one can be killed without touching the others.

One supervisor thread owns all the processes. It waits on every worker socket, the
launcher's control socket and a wake-up pipe at once (``multiprocessing.connection.wait``),
so a death is noticed the moment the socket closes, not by polling. Other threads talk to
it only through ``_commands`` and the wake-up pipe.

A job sent from an asyncio event loop's thread to an idle worker, when its caller asks for
it (``direct=True``: small answers, as ``Scheduler.run`` gets), has its answer read by that
event loop itself (``add_reader`` on a duplicate of the worker's socket), which spares the
answer a hop through the supervisor thread. The supervisor still owns the worker: it
watches the deadline, kills on timeout, and takes back the socket the moment the loop
sees anything but one whole, small answer (the worker's end, a partial or large message),
or when the loop does not read a waiting answer within ``_LOOP_GRACE`` seconds (a loop
that is blocked, stopped or closed).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import itertools
import logging
import os
import pickle
import select
import socket
import struct
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Callable

from aiocompile import _checks, _serialize
from aiocompile._errors import (
    CompileTimeout,
    RemoteTraceback,
    SchedulerClosed,
    WorkerCrashedError,
)
from aiocompile._launch import Launcher, LauncherError, WorkerProcess, make_launcher
from aiocompile._metrics import WorkerEvent
from aiocompile._worker import _Failure, job_env

logger = logging.getLogger("aiocompile")

# How long a worker that closed its socket may take to be reaped before we stop waiting.
_REAP_TIMEOUT = 5.0
# Consecutive worker start failures after which queued jobs fail instead of waiting for a
# worker that will never come.
_MAX_START_FAILURES = 3
# An answer an event loop was to read, still unread after this long (the loop is blocked,
# stopped or closed), is read by the supervisor instead; it looks this often.
_LOOP_GRACE = 1.0
_AUDIT_PERIOD = 0.25
# Larger answers are never read in an event loop: unpickling them is the supervisor's work.
_LOOP_READ_MAX = 64 * 1024


@dataclass(eq=False)
class Job:
    """One unit of work and everything measured about it. Fields are written by the
    supervisor thread and are final once ``future`` is done."""

    id: int
    payload: bytes
    future: cf.Future[Any]
    timeout: float | None
    max_crashes: int
    name: str | None
    key: str | None
    env: dict[str, str]
    sys_path: list[str]
    warm_only: bool = False
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    attempt_started_at: float | None = None
    finished_at: float | None = None
    run_time: float | None = None
    attempts: int = 0
    crashes: int = 0
    worker_pid: int | None = None
    worker_rss: int = 0
    output_size: int = 0
    last_exitcode: int | None = None
    last_output: str = ""
    kill_reason: str | None = None

    @property
    def queue_wait(self) -> float | None:
        if self.started_at is None:
            return None
        return self.started_at - self.submitted_at

    @classmethod
    def create(
        cls,
        job_id: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        *,
        timeout: float | None,
        max_crashes: int,
        name: str | None,
        key: str | None,
        warm_only: bool = False,
    ) -> Job:
        """A job for ``fn(*args, **kwargs)``, pickled now (``TypeError`` if it cannot be),
        carrying this process's job environment and import path as they are now."""
        return cls(
            id=job_id,
            payload=_serialize.dumps((fn, args, kwargs or {})),
            future=cf.Future(),
            timeout=timeout,
            max_crashes=max_crashes,
            name=name,
            key=key,
            env=job_env(),
            sys_path=_import_path(),
            warm_only=warm_only,
        )


# sys.path as the last job carried it: jobs share one copy while it stays the same.
_path_seen: list[str] = []


def _import_path() -> list[str]:
    """A copy of ``sys.path``, the same list for as long as ``sys.path`` does not change
    (so "unchanged" is told by identity); it must not be modified."""
    global _path_seen
    seen = _path_seen
    if seen != sys.path:
        seen = _path_seen = list(sys.path)
    return seen


@dataclass(eq=False)
class _Worker:
    proc: WorkerProcess
    state: str = "starting"  # starting -> idle <-> busy; dying, retiring -> (gone)
    job: Job | None = None
    # The environment and import path this worker was last sent: a job that carries the
    # same objects sends None instead (see the protocol in _worker).
    sent_env: dict[str, str] | None = None
    sent_path: list[str] | None = None
    deadline: float | None = None
    warmed: bool = False
    jobs_run: int = 0
    rss: int = 0
    last_used: float = field(default_factory=time.monotonic)
    # The event loop reading this worker's answer (set only while busy), or None: the
    # supervisor reads it. Changed only under the pool's lock.
    reader: _LoopReader | None = None
    retire_reason: str | None = None  # set (with state "retiring") for the supervisor to act on
    # A duplicate of the socket, kept for peeking at an answer's length (recv MSG_PEEK):
    # made the first time a loop reads for this worker, used and closed under the lock.
    peek: socket.socket | None = None
    # The duplicate registered with the loop that last read for this worker (kept while
    # that loop keeps using it; see _loop_reader). Changed under the lock.
    registration: _LoopReader | None = None
    watched: bool = False  # in the supervisor's current wait (written under the lock)

    def drop_peek(self) -> None:
        """Close this process's own duplicates of the socket (under the lock): the peek,
        and a registration whose loop is closed. One in a live loop is that loop's to drop:
        the socket reads as ended once the worker is gone, and the loop drops it then."""
        if self.peek is not None:
            self.peek.close()
            self.peek = None
        if self.registration is not None and self.registration.loop.is_closed():
            self.registration.close()
            self.registration = None


class _LoopReader:
    """One job's answer, to be read by an event loop: the loop, and the duplicate of the
    worker's socket (a descriptor) registered with it, which only the loop's thread
    unregisters and closes (or the supervisor, once the loop is closed). Closing the
    worker's own socket thus never leaves a stale registration in a loop's selector."""

    __slots__ = ("loop", "fd", "waiting_since")

    def __init__(self, loop: Any, fd: int) -> None:
        self.loop = loop
        self.fd = fd
        self.waiting_since: float | None = None  # the supervisor's: when it saw an answer unread

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:  # pragma: no cover
            pass


@dataclass
class PoolCounters:
    """What the pool has done; written by the supervisor thread only."""

    workers_started: int = 0
    worker_crashes: int = 0
    retries: int = 0
    timeouts: int = 0
    killed: int = 0
    recycled: int = 0
    idle_stopped: int = 0
    queue_depth_max: int = 0


def _lower_priority(pid: int, nice: int) -> None:
    """Make a worker ``nice`` steps nicer than this process.

    Compiles use every core they get; the event loop of the process that asked for them
    must still wake up on time. Done while the worker is single-threaded (it has just said
    it is ready, and compilers start their threads in the first compile), so its later
    threads inherit it. A worker that cannot be reniced runs as it is.
    """
    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, pid, min(19, mine + nice))
    except (OSError, AttributeError):
        pass


def _death_statuses(kill_reason: str | None, machinery_failed: bool) -> tuple[str, str]:
    """(worker_exited status, job_ended status) for a worker that died holding a job."""
    if kill_reason == "undelivered":
        return "crashed", "lost"
    if kill_reason == "timeout":
        return "timeout", "timeout"
    if kill_reason is not None:
        return "killed", "cancelled" if kill_reason == "cancelled" else "closed"
    return "crashed", "lost" if machinery_failed else "crashed"


def _signal_name(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def check_timeout(timeout: Any) -> None:
    """A job's timeout must be None or a positive, finite number of seconds (see
    ``_checks.JOB_TIMEOUT``). Checked in the submitting thread: found later, in the
    supervisor, a bad value would stop it and fail every other job too."""
    _checks.JOB_TIMEOUT.check("timeout", timeout)


def emit_event(listener: Callable[[WorkerEvent], None] | None, event: str, pid: int | None,
               job: Job | None = None, **fields: Any) -> None:
    """Report a ``WorkerEvent`` to ``listener``, with monotonic times made wall-clock."""
    if listener is None:
        return
    now = time.time()
    if job is not None:
        started = job.attempt_started_at
        fields.update(
            job_id=job.id, name=job.name, key=job.key, attempt=job.attempts, warm_up=job.warm_only,
            started_at=None if started is None else now - (time.monotonic() - started),
        )
    try:
        listener(WorkerEvent(event, now, pid, **fields))
    except Exception:  # pragma: no cover - the listener guards its own callbacks
        logger.exception("aiocompile: reporting a worker event failed")


class WorkerPool(cf.Executor):
    """A supervised pool of worker processes, one job per worker at a time.

    ``submit()`` follows the ``Executor`` contract; ``submit_job()`` also takes a timeout,
    a crash budget and a name for error messages, and returns the :class:`Job` with its
    timings. ``on_event``, if set, is called with a :class:`~aiocompile.WorkerEvent` for
    each worker start and exit and each attempt at a job, in the supervisor thread (or,
    for a job sent at once to an idle worker, in the submitting thread); it must be quick.
    """

    def __init__(
        self,
        max_workers: int,
        *,
        start_method: str | None = None,
        preload: tuple[str, ...] = (),
        max_crashes: int = 2,
        max_worker_rss: int | None = None,
        idle_timeout: float | None = None,
        worker_nice: int = 0,
    ) -> None:
        # Checked here, in the caller: the supervisor thread trusts them.
        self.max_workers = _checks.WORKERS.check("max_workers", max_workers)
        self.max_crashes = _checks.CRASHES.check("max_crashes", max_crashes)
        self.max_worker_rss = _checks.RSS.check("max_worker_rss", max_worker_rss)
        self.idle_timeout = _checks.IDLE_TIMEOUT.check("idle_timeout", idle_timeout)
        self.worker_nice = _checks.NICE.check("worker_nice", worker_nice)
        self.start_method = _checks.START_METHOD.check("start_method", start_method)
        self._preload = _checks.PRELOAD.check("preload", preload)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._commands: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._ids = itertools.count(1)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.counters = PoolCounters()
        self.on_event: Callable[[WorkerEvent], None] | None = None
        # Whether anyone takes job_started/job_ended events now: they are two per job, and
        # building them for nobody was a tenth of a trivial job's round trip.
        self.job_events_wanted: Callable[[], bool] = _always
        # Owned by the supervisor thread:
        self._launcher: Launcher | None = None
        self._workers: list[_Worker] = []
        self._pending: collections.deque[Job] = collections.deque()
        self._warm_pending: collections.deque[Job] = collections.deque()
        self._start_failures = 0
        self._retry_start_at: float | None = None
        self._reported_problems: set[str] = set()
        self._shutdown_deadline: float | None = None
        self._stopping = False
        _live_pools.add(self)

    # -- submission (any thread) -------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        return self.submit_job(fn, args, kwargs).future

    def submit_job(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        max_crashes: int | None = None,
        name: str | None = None,
        key: str | None = None,
        warm_only: bool = False,
        direct: bool = False,
    ) -> Job:
        """Queue ``fn(*args, **kwargs)``; raises ``TypeError`` at once if it cannot be sent.

        With a worker idle and nothing queued, the job is sent to it from this thread at
        once: the round trip through the supervisor thread (a wake-up, and the GIL passed
        from thread to thread) was a fifth of a trivial job's whole round trip.

        ``direct=True`` says that the caller will await the job in the asyncio event loop
        running in this thread, and that its answer is small: then, when the job goes at
        once to an idle worker, that loop reads the answer itself (see the module's
        docstring). The job's future is then resolved in the loop's thread. Otherwise, and
        for everything but the answer, the supervisor reads and watches the worker."""
        self._check_usable()
        check_timeout(timeout)
        if max_crashes is not None:
            _checks.CRASHES.check("max_crashes", max_crashes)
        job = Job.create(next(self._ids), fn, args, kwargs, timeout=timeout,
                         max_crashes=max_crashes or self.max_crashes, name=name, key=key, warm_only=warm_only)
        loop = _running_loop() if direct and not warm_only else None
        worker = None if warm_only else self._claim_for_new(job, loop)
        if worker is None:
            self._command("submit", job)
            return job
        # The supervisor's wait must end at this job's deadline, and must stop watching a
        # socket that a loop now reads.
        wake = job.timeout is not None or (worker.reader is not None and worker.watched)
        if self._start_job(worker, job) and wake:
            self._wake()
        return job

    def _claim_for_new(self, job: Job, loop: Any = None) -> _Worker | None:
        """An idle worker for a new job, taken now, if no job is waiting ahead of it; with
        ``loop``, that loop is to read the answer, if it can."""
        with self._lock:
            if self._closed or self._thread is None or self._commands or self._pending or self._warm_pending:
                return None
            worker = self._claim_locked(lambda w: True, job)
            if worker is not None and loop is not None:
                worker.reader = self._loop_reader(worker, loop)
            return worker

    # -- answers read by an event loop (the loop's thread) -----------------------------------

    def _loop_reader(self, worker: _Worker, loop: Any) -> _LoopReader | None:
        """The registration through which ``loop`` reads ``worker``'s answer (under the
        lock): the one it already has, or a new duplicate of the socket registered with it;
        None if that cannot be. A registration stays while the same loop keeps using the
        worker: adding and removing a reader cost as much as the rest of reading."""
        registered = worker.registration
        if registered is not None:
            if registered.loop is loop:
                registered.waiting_since = None
                return registered
            if registered.loop.is_closed():
                # A closed loop's selector is closed: nothing refers to the descriptor.
                registered.close()
            # Otherwise it stays registered in that loop, which drops it the next time the
            # socket is readable (see _answer_in_loop).
            worker.registration = None
        try:
            fd = worker.proc.conn.fileno()
            if worker.peek is None:
                worker.peek = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, os.dup(fd))
            reader = _LoopReader(loop, os.dup(fd))
        except (OSError, ValueError):
            return None
        try:
            loop.add_reader(reader.fd, self._answer_in_loop, worker, reader)
        except (NotImplementedError, RuntimeError, OSError, ValueError):
            reader.close()
            return None
        worker.registration = reader
        return reader

    def _answer_in_loop(self, worker: _Worker, reader: _LoopReader) -> None:
        """The loop's callback: the worker's socket is readable. Reads one whole, small
        answer to a job this loop holds. Anything else unregisters: the worker's end, a
        partial or large message (the supervisor is woken to read those), or an answer to
        a job someone else reads (the supervisor, another loop)."""
        data: bytes | memoryview | None = None
        with self._lock:
            mine = worker.reader is reader
            if mine:
                data = None if worker.peek is None else _whole_message(worker.peek)
                if data is _NOTHING_YET:
                    return  # readiness seen for an earlier answer, already read
                if data is None:
                    worker.reader = None
            if data is None and worker.registration is reader:
                worker.registration = None
        if data is None:
            try:
                reader.loop.remove_reader(reader.fd)
            except (RuntimeError, OSError, ValueError):  # pragma: no cover - a closing loop
                pass
            reader.close()
            if mine:
                self._wake()
            return
        message = pickle.loads(data)
        job = worker.job
        recycle = self._job_done(worker, message[6])  # replacing it blocks: the supervisor's
        self._deliver(worker, job, message)
        if recycle or self._pending or self._warm_pending:
            self._wake()

    def kill(self, job: Job, reason: str = "cancelled") -> None:
        """Stop a job: cancel it if queued, kill its worker if running."""
        if not self.cancel(job):
            self._command("kill", (job, reason))

    def cancel(self, job: Job) -> bool:
        """Drop a job that has not started; returns False (and does nothing) if it has."""
        if job.future.cancel():
            self._wake()
            return True
        return False

    def start(self) -> None:
        """Get the pool ready to start workers (the fork server loads in the background);
        returns at once. Workers themselves still start on demand."""
        self._check_usable()
        self._command("prepare", None)

    def warm(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[Job]:
        """Start every worker and run ``fn(*args)`` once in each worker not yet warmed."""
        return [self.submit_job(fn, args, warm_only=True, name="warm-up") for _ in range(self.max_workers)]

    def _command(self, kind: str, value: Any) -> None:
        with self._lock:
            if self._closed and kind == "submit":
                raise SchedulerClosed("the worker pool is shut down")
            self._commands.append((kind, value))
            if self._thread is None:
                self._thread = threading.Thread(target=self._supervise, name="aiocompile-supervisor", daemon=True)
                self._thread.start()
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a full pipe already means "wake up"

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise SchedulerClosed("this worker pool belongs to the parent of a forked process; create a new one here")
        if self._closed:
            raise SchedulerClosed("the worker pool is shut down")

    # -- introspection (any thread) -------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def snapshot(self) -> dict[str, int]:
        """Workers by state and queue depth now (a racy read, good for metrics)."""
        workers = list(self._workers)
        return {
            "workers": len(workers),
            "busy_workers": sum(1 for w in workers if w.state == "busy"),
            "idle_workers": sum(1 for w in workers if w.state == "idle"),
            "queue_depth": len(self._pending),
        }

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in list(self._workers)]

    # -- shutdown ---------------------------------------------------------------------------

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, grace: float | None = None) -> None:
        """Stop accepting work. Queued jobs run unless ``cancel_futures``; running jobs get
        ``grace`` seconds (None: as long as they need) before their workers are killed.
        Every job still unfinished then fails with ``SchedulerClosed``."""
        _checks.POOL_GRACE.check("grace", grace)
        if os.getpid() != self._pid:
            self._forget_after_fork()
            return
        with self._lock:
            first = not self._closed
            self._closed = True
            thread = self._thread
            if first:
                self._commands.append(("shutdown", (cancel_futures, grace)))
        if thread is None:
            self._close_fds()
            return
        self._wake()
        if wait:
            thread.join()

    def _forget_after_fork(self) -> None:
        # In a forked child: the processes belong to the parent. Drop our copies of the
        # descriptors without telling anyone anything.
        self._closed = True
        for worker in self._workers:
            worker.drop_peek()
            if worker.registration is not None:
                worker.registration.close()  # this process's copy; the parent's stays
                worker.registration = None
            worker.proc.close()
        self._workers = []
        if self._launcher is not None:
            self._launcher.forget()
            self._launcher = None
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    # -- the supervisor thread ----------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # pragma: no cover - a bug here must not hang callers
            self._fail_everything(RuntimeError(f"the aiocompile supervisor failed: {exc!r}"))
            raise
        finally:
            self._teardown()

    def _loop(self) -> None:
        while True:
            self._run_commands()
            if self._stopping and self._finished_stopping():
                return
            self._retire_marked()
            self._dispatch()
            waitables: list[Any] = [self._wake_r]
            with self._lock:
                # Not the sockets event loops read: those are watched by their loops, and
                # looked at here only by the audit below. Under the lock, so that a loop
                # taking a worker knows whether the supervisor watches its socket.
                for w in self._workers:
                    w.watched = w.reader is None
                    if w.watched:
                        waitables.append(w.proc.conn)
            if self._launcher is not None and (fd := self._launcher.fileno()) is not None:
                waitables.append(fd)
            ready = wait_for_any(waitables, self._next_timeout())
            for index, obj in enumerate(ready):
                if index:
                    # Answers handled one after another run Python back to back (a
                    # kernel's result is unpickled and made ready here): let a waiting
                    # event loop have the interpreter lock between them.
                    time.sleep(0)
                if isinstance(obj, int):
                    if obj == self._wake_r:
                        self._drain_wake()
                    elif self._launcher is not None:
                        self._launcher.on_readable()
                else:
                    worker = next((w for w in self._workers if w.proc.conn is obj), None)
                    if worker is not None:
                        self._on_readable(worker)
            self._check_deadlines()
            self._audit_readers()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                kind, value = self._commands.popleft()
                if kind == "submit":
                    # Queued under the lock: a submitter that finds neither a command nor a
                    # queued job may send its own job at once, and must not overtake this.
                    (self._warm_pending if value.warm_only else self._pending).append(value)
            if kind == "submit":
                depth = len(self._pending)
                if depth > self.counters.queue_depth_max:
                    self.counters.queue_depth_max = depth
            elif kind == "kill":
                job, reason = value
                self._kill_job(job, reason)
            elif kind == "prepare":
                self._prepare_launcher()
            elif kind == "shutdown":
                cancel_futures, grace = value
                self._begin_shutdown(cancel_futures, grace)

    def _next_timeout(self) -> float | None:
        deadlines = [w.deadline for w in self._workers if w.deadline is not None]
        if any(w.reader is not None for w in self._workers):
            deadlines.append(time.monotonic() + _AUDIT_PERIOD)
        if self.idle_timeout is not None:
            deadlines.extend(w.last_used + self.idle_timeout for w in self._workers if w.state == "idle")
        if self._shutdown_deadline is not None:
            deadlines.append(self._shutdown_deadline)
        if self._retry_start_at is not None and (self._pending or self._warm_pending):
            deadlines.append(self._retry_start_at)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    # -- starting work ----------------------------------------------------------------------

    def _dispatch(self) -> None:
        self._drop_cancelled()
        # Warm-up jobs go only to workers that have not been warmed, one each; once every
        # slot holds a warmed worker, the ones left have nothing to do.
        while self._warm_pending:
            job = self._warm_pending[0]
            worker = self._claim(lambda w: not w.warmed, job)
            if worker is None:
                if len(self._workers) >= self.max_workers and all(w.warmed for w in self._workers):
                    self._finish_noop(self._warm_pending.popleft())
                    continue
                break
            self._warm_pending.popleft()
            self._start_job(worker, job)
        while self._pending:
            job = self._pending[0]
            worker = self._claim(lambda w: True, job)
            if worker is None:
                break
            self._pending.popleft()
            self._start_job(worker, job)
        wanted = len(self._pending) + len(self._warm_pending)
        starting = sum(1 for w in self._workers if w.state == "starting")
        if self._retry_start_at is not None and time.monotonic() < self._retry_start_at:
            return
        while wanted > starting and len(self._workers) < self.max_workers:
            if not self._launch_worker():
                break
            starting += 1

    def _drop_cancelled(self) -> None:
        for queue in (self._pending, self._warm_pending):
            if any(job.future.cancelled() for job in queue):
                kept = [job for job in queue if not job.future.cancelled()]
                queue.clear()
                queue.extend(kept)

    # Idle workers may be taken by the supervisor or, for a new job, by the thread that
    # submits it; so a worker becomes idle, and is taken (made busy, given its job), only
    # under the pool's lock. Everything else about workers is the supervisor's alone.

    def _claim(self, eligible: Callable[[_Worker], bool], job: Job) -> _Worker | None:
        with self._lock:
            return self._claim_locked(eligible, job)

    def _claim_locked(self, eligible: Callable[[_Worker], bool], job: Job) -> _Worker | None:
        # Most recently used first: its caches (Triton's in-process ones, the page cache)
        # are the warmest, and the others can then be left idle long enough to be stopped.
        best = None
        for worker in self._workers:
            if worker.state == "idle" and eligible(worker) and (best is None or worker.last_used > best.last_used):
                best = worker
        if best is not None:
            best.state = "busy"
            best.job = job
        return best

    def _make_idle(self, worker: _Worker) -> None:
        with self._lock:
            worker.state = "idle"
            worker.job = None
            worker.deadline = None

    def _start_failed(self, error: str) -> None:
        # Try again after a pause that grows with each failure in a row; after a few, fail
        # what is queued rather than let it wait for a worker that will never come.
        self._start_failures += 1
        self._retry_start_at = time.monotonic() + min(2.0, 0.1 * 2 ** self._start_failures)
        if self._start_failures >= _MAX_START_FAILURES:
            self._fail_queued(RuntimeError(f"aiocompile could not start worker processes: {error}"))

    def _prepare_launcher(self) -> None:
        try:
            if self._launcher is None:
                self._launcher = make_launcher(self.start_method, self._preload)
            self._launcher.prepare()
        except (LauncherError, OSError) as exc:
            # Not fatal here: the first launch tries again and reports.
            logger.warning("aiocompile could not prepare its workers: %s", exc)

    def _launch_worker(self) -> bool:
        try:
            if self._launcher is None:
                self._launcher = make_launcher(self.start_method, self._preload)
            proc = self._launcher.launch()
            for problem in getattr(self._launcher, "problems", ()):
                if problem not in self._reported_problems:
                    self._reported_problems.add(problem)
                    logger.warning("aiocompile workers start without a preload: %s", problem)
        except (LauncherError, OSError) as exc:
            self._start_failed(str(exc))
            return False
        self._workers.append(_Worker(proc))
        self.counters.workers_started += 1
        return True

    def _start_job(self, worker: _Worker, job: Job) -> bool:
        """Send ``job`` to ``worker``, which was claimed for it. False if the job was
        cancelled meanwhile (the worker is idle again)."""
        # A retried job's future is RUNNING already; a queued one may have been cancelled,
        # or (sent from a submitting thread as the pool shuts down) failed meanwhile.
        try:
            startable = job.future.running() or job.future.set_running_or_notify_cancel()
        except RuntimeError:  # FINISHED: it has its outcome already
            startable = False
        if not startable:
            self._make_idle(worker)
            return False
        now = time.monotonic()
        if job.started_at is None:
            job.started_at = now
        job.attempt_started_at = now
        job.attempts += 1
        job.worker_pid = worker.proc.pid
        worker.deadline = None if job.timeout is None else now + job.timeout
        env = None if job.env is worker.sent_env else job.env
        path = None if job.sys_path is worker.sent_path else job.sys_path
        worker.sent_env, worker.sent_path = job.env, job.sys_path
        message = pickle.dumps(("run", job.id, env, path, job.payload), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            worker.proc.conn.send_bytes(message)
        except OSError:
            # The worker died before it could take the job: the job never ran, so this
            # is no crash of its. The socket's end is seen by the wait loop.
            job.kill_reason = "undelivered"
        if self.on_event is not None and self.job_events_wanted():
            emit_event(self.on_event, "job_started", worker.proc.pid, job)
        return True

    # -- results and deaths -----------------------------------------------------------------

    def _on_readable(self, worker: _Worker) -> None:
        with self._lock:
            # An event loop reads this worker's answer; or one has just read it, and the
            # readiness seen was its answer's, so there is nothing to read now.
            if worker.reader is not None or not _readable_now(worker.proc.conn):
                return
            if worker.state == "idle":
                worker.state = "dying"  # an idle worker's socket is readable at its end only
        try:
            data = worker.proc.conn.recv_bytes()
        except (EOFError, OSError):
            self._on_death(worker)
            return
        message = pickle.loads(data)
        if message[0] == "ready":
            if self.worker_nice:
                _lower_priority(worker.proc.pid, self.worker_nice)
            self._make_idle(worker)
            self._start_failures = 0
            self._retry_start_at = None
            emit_event(self.on_event, "worker_started", worker.proc.pid)
        elif message[0] == "done":
            self._on_done(worker, message)

    def _on_done(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        job = worker.job
        if self._job_done(worker, message[6]):
            self._retire_marked()  # before the answer goes out, as the supervisor is here
        self._deliver(worker, job, message)

    def _job_done(self, worker: _Worker, rss: int) -> bool:
        """A worker has answered its job (in whichever thread read the answer): it is idle
        again, before the answer goes out, so that the caller's next job may take it at
        once; or, grown past ``max_worker_rss`` (compilers leak), marked for the
        supervisor to replace (``_retire_marked``). Returns whether it was marked."""
        recycle = self.max_worker_rss is not None and rss > self.max_worker_rss
        with self._lock:
            worker.reader = None
            worker.jobs_run += 1
            worker.rss = rss
            worker.last_used = time.monotonic()
            worker.job = None
            worker.deadline = None
            if recycle:
                worker.state = "retiring"
                worker.retire_reason = "recycled"
            else:
                worker.state = "idle"
        return recycle

    def _deliver(self, worker: _Worker, job: Job | None, message: tuple[Any, ...]) -> None:
        """The job's outcome from its ``done`` message, in the thread that read it."""
        _, job_id, ok, data, run_time, output_size, rss = message
        if job is None or job.id != job_id:  # pragma: no cover - protocol invariant
            return
        if job.warm_only:
            worker.warmed = True
        job.finished_at = worker.last_used
        job.run_time = run_time
        job.output_size = output_size
        job.worker_rss = rss
        if job.kill_reason is not None and job.kill_reason != "undelivered":
            # It finished just as we decided to kill it; the result stands.
            job.kill_reason = None
        if ok:
            try:
                result = pickle.loads(data)
            except Exception as exc:
                self._set_exception(job, TypeError(f"the job's result could not be unpickled here: {exc!r}"))
            else:
                self._set_result(job, result)
        else:
            if output_size:
                job.last_output = worker.proc.output_tail()
            self._set_exception(job, self._rebuild_failure(job, pickle.loads(data)))
        # After the answer: the caller need not wait for the report.
        if self.on_event is not None and self.job_events_wanted():
            emit_event(self.on_event, "job_ended", worker.proc.pid, job, status="ok" if ok else "error")

    def _rebuild_failure(self, job: Job, failure: _Failure) -> BaseException:
        exc = failure.exc
        if exc is None:
            exc = RuntimeError(f"{failure.type_name}: {failure.message} (the exception itself could not be pickled)")
        if not getattr(exc, "output", None) and job.last_output and hasattr(exc, "output"):
            exc.output = job.last_output
        exc.__cause__ = RemoteTraceback(failure.traceback)
        return exc

    def _retire(self, worker: _Worker, why: str) -> None:
        """Stop a worker on purpose (idle, too big). It holds no job and nothing worth
        saving, so it is simply killed, and reaped here."""
        assert self._launcher is not None and worker.job is None
        with self._lock:
            self._workers.remove(worker)
            worker.drop_peek()
        worker.proc.conn.close()
        self._launcher.kill(worker.proc)
        exitcode = self._launcher.wait_exit(worker.proc, _REAP_TIMEOUT)
        worker.proc.close()
        emit_event(self.on_event, "worker_exited", worker.proc.pid, status=why, exitcode=exitcode)

    def _on_death(self, worker: _Worker) -> None:
        assert self._launcher is not None
        exitcode = self._launcher.wait_exit(worker.proc, _REAP_TIMEOUT)
        # Judge the fork server now: the replacement below would start a new one.
        machinery_failed = not self._launcher.healthy(worker.proc)
        worker.proc.exitcode = exitcode
        tail = worker.proc.output_tail()
        worker.proc.close()
        with self._lock:
            # From here no submitter can take it; one that took it just before has left
            # its job in ``worker.job``, and that job is dealt with below.
            state = worker.state
            worker.state = "gone"
            self._workers.remove(worker)
            job = worker.job
            worker.drop_peek()
        pid = worker.proc.pid
        if state == "starting":
            emit_event(self.on_event, "worker_exited", pid, status="start_failed", exitcode=exitcode)
            self._start_failed(f"a worker exited with {_signal_name(exitcode)} while starting:\n{tail}")
            return
        if job is None:
            emit_event(self.on_event, "worker_exited", pid,
                       status="shutdown" if self._stopping else "crashed", exitcode=exitcode)
        else:
            worker_status, job_status = _death_statuses(job.kill_reason, machinery_failed)
            emit_event(self.on_event, "job_ended", pid, job, status=job_status, exitcode=exitcode)
            emit_event(self.on_event, "worker_exited", pid, status=worker_status, exitcode=exitcode)
        if not self._stopping:
            # Whatever the cause, the pool goes back to the size it had.
            self._launch_worker()
        if job is None:
            if not self._stopping:
                self.counters.worker_crashes += 1
            return
        reason = job.kill_reason
        job.kill_reason = None
        job.last_exitcode = exitcode
        job.last_output = tail
        job.finished_at = time.monotonic()
        if reason == "undelivered":
            job.attempts -= 1
            self._pending.appendleft(job)
            self._requeue(job)
            return
        if reason == "timeout":
            self.counters.timeouts += 1
            self._set_exception(job, CompileTimeout(
                f"did not finish within {job.timeout:g} s; its worker was killed",
                timeout=job.timeout, kernel_name=job.name, key=job.key, output=tail))
            return
        if reason is not None:
            self.counters.killed += 1
            self._set_exception(job, cf.CancelledError() if reason == "cancelled" else SchedulerClosed(reason))
            return
        self.counters.worker_crashes += 1
        if machinery_failed:
            # The fork server died and took its workers with it: not this job's doing, so
            # it is retried without counting against it.
            self.counters.retries += 1
            self._pending.appendleft(job)
            self._requeue(job)
            return
        job.crashes += 1
        if job.crashes >= job.max_crashes:
            self._set_exception(job, WorkerCrashedError(
                f"killed its worker {job.crashes} time(s), last with {_signal_name(exitcode)}",
                exitcode=exitcode, attempts=job.attempts, kernel_name=job.name, key=job.key, output=tail))
            return
        self.counters.retries += 1
        self._pending.appendleft(job)
        self._requeue(job)

    def _requeue(self, job: Job) -> None:
        # The future is already RUNNING; it stays so while the job waits for a retry.
        job.worker_pid = None

    def _audit_readers(self) -> None:
        """Take back the sockets of answers an event loop has left unread for
        ``_LOOP_GRACE`` seconds, and at once those of a closed loop."""
        now = time.monotonic()
        for worker in self._workers:
            reader = worker.reader
            if reader is None:
                continue
            closed = reader.loop.is_closed()
            if not closed:
                if not _readable_now(worker.proc.conn):
                    reader.waiting_since = None
                    continue
                if reader.waiting_since is None:
                    reader.waiting_since = now
                if now - reader.waiting_since < _LOOP_GRACE:
                    continue
            with self._lock:
                if worker.reader is not reader:
                    continue  # the loop has just read it
                worker.reader = None
                if closed and worker.registration is reader:
                    worker.registration = None
                    reader.close()  # a closed loop's selector is closed: nothing refers to it
            if not closed:
                logger.debug("aiocompile: an event loop left an answer unread for %.1f s; the supervisor reads it",
                             now - (reader.waiting_since or now))

    def _retire_marked(self) -> None:
        """Replace the workers an event loop found too big after their job."""
        for worker in [w for w in self._workers if w.state == "retiring" and w.retire_reason]:
            reason, worker.retire_reason = worker.retire_reason, None
            assert reason is not None
            self.counters.recycled += 1
            self._retire(worker, reason)
            if not self._stopping:
                self._launch_worker()

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        # Not while jobs wait: a worker that has just started is idle until the next
        # dispatch, and may have taken longer than idle_timeout to start; stopping it
        # then starts another for the same job, and so on for ever.
        if self.idle_timeout is not None and not self._stopping and not self._pending:
            with self._lock:
                expired = [w for w in self._workers if w.state == "idle" and now - w.last_used >= self.idle_timeout]
                for worker in expired:
                    worker.state = "retiring"
            for worker in expired:
                self.counters.idle_stopped += 1
                self._retire(worker, "idle")
        for worker in self._workers:
            if worker.deadline is not None and worker.deadline <= now and worker.job is not None:
                worker.deadline = None
                worker.job.kill_reason = "timeout"
                assert self._launcher is not None
                self._launcher.kill(worker.proc)
        if self._shutdown_deadline is not None and self._shutdown_deadline <= now:
            self._shutdown_deadline = None
            self._fail_queued(SchedulerClosed("the scheduler was closed before the job started"))
            for worker in self._workers:
                if worker.job is not None:
                    worker.job.kill_reason = "the scheduler was closed while the job ran"
                    assert self._launcher is not None
                    self._launcher.kill(worker.proc)

    def _kill_job(self, job: Job, reason: str) -> None:
        if job.future.done():
            return
        for worker in self._workers:
            if worker.job is job:
                job.kill_reason = reason
                assert self._launcher is not None
                self._launcher.kill(worker.proc)
                return
        # Waiting for a retry: it is in the queue with a RUNNING future.
        for queue in (self._pending, self._warm_pending):
            if job in queue:
                queue.remove(job)
                self._set_exception(job, cf.CancelledError() if reason == "cancelled" else SchedulerClosed(reason))

    def _set_result(self, job: Job, result: Any) -> None:
        if not job.future.done():
            job.future.set_result(result)

    def _set_exception(self, job: Job, exc: BaseException) -> None:
        if job.finished_at is None:
            job.finished_at = time.monotonic()
        if job.future.done():
            return
        if job.future.running() or job.future.set_running_or_notify_cancel():
            job.future.set_exception(exc)

    def _finish_noop(self, job: Job) -> None:
        if job.future.set_running_or_notify_cancel():
            job.finished_at = time.monotonic()
            job.future.set_result(None)

    def _fail_queued(self, exc: BaseException) -> None:
        for queue in (self._pending, self._warm_pending):
            while queue:
                self._set_exception(queue.popleft(), exc)

    def _fail_everything(self, exc: BaseException) -> None:
        self._fail_queued(exc)
        for worker in self._workers:
            if worker.job is not None:
                self._set_exception(worker.job, exc)
        with self._lock:
            self._closed = True
            commands = list(self._commands)
            self._commands.clear()
        for kind, value in commands:
            if kind == "submit":
                self._set_exception(value, exc)

    # -- shutdown (supervisor side) -------------------------------------------------------------

    def _begin_shutdown(self, cancel_futures: bool, grace: float | None) -> None:
        self._stopping = True
        if cancel_futures:
            self._fail_queued(SchedulerClosed("the scheduler was closed before the job started"))
        if grace is not None:
            self._shutdown_deadline = time.monotonic() + grace
            self._check_deadlines()

    def _finished_stopping(self) -> bool:
        # Queued jobs (kept when not cancelled) still run before the pool stops.
        if self._pending or self._warm_pending:
            return False
        return not any(w.state == "busy" for w in self._workers)

    def _teardown(self) -> None:
        closing = SchedulerClosed("the worker pool is shut down")
        self._fail_everything(closing)
        # Idle workers exit when their socket closes; the launcher kills any left.
        for worker in self._workers:
            with self._lock:
                worker.drop_peek()
            worker.proc.close()
        if self._launcher is not None:
            for worker in self._workers:
                self._launcher.kill(worker.proc)
            for worker in self._workers:
                exitcode = self._launcher.wait_exit(worker.proc, _REAP_TIMEOUT)
                emit_event(self.on_event, "worker_exited", worker.proc.pid, status="shutdown", exitcode=exitcode)
            self._launcher.close()
        self._workers = []
        self._close_fds()


def _always() -> bool:
    return True


def _running_loop() -> Any:
    """The asyncio event loop running in this thread, or None."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return None
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _readable_now(conn: Any) -> bool:
    """Whether reading ``conn`` would return at once (data, or its end)."""
    try:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True  # closed: reading it fails at once


_HEADER = struct.Struct("!i")
_NOTHING_YET = b""


def _whole_message(peek: socket.socket) -> bytes | memoryview | None:
    """One message from a worker's socket, through its duplicate ``peek``, if all of it
    has arrived and it is at most ``_LOOP_READ_MAX`` bytes long, read without blocking;
    else None, and nothing is read; ``_NOTHING_YET`` if nothing at all is there.
    (``multiprocessing.connection`` frames a message with
    its length: 4 bytes, or -1 and 8 more.) Two system calls: a peek, then the read."""
    try:
        head = peek.recv(4 + _LOOP_READ_MAX, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return _NOTHING_YET
    except OSError:
        return None  # a broken socket
    if len(head) < 4:
        return None  # the worker's end, or not yet a whole header
    size = _HEADER.unpack_from(head)[0]
    if size < 0 or 4 + size > len(head):
        return None  # large, or not all there yet
    try:
        data = peek.recv(4 + size, socket.MSG_WAITALL)
    except OSError:  # pragma: no cover - all of it was there
        return None
    return memoryview(data)[4:]


_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _shutdown_all_at_exit() -> None:
    for pool in list(_live_pools):
        pool.shutdown(wait=True, cancel_futures=True, grace=0)


def _after_fork_in_child() -> None:
    for pool in list(_live_pools):
        pool._forget_after_fork()


atexit.register(_shutdown_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
