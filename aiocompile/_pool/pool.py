"""WorkerPool: a ``concurrent.futures.Executor`` that supervises one job per worker process.

Each worker holds at most one job, sent over its own socket, so the parent always knows
which job a worker holds. That is what makes the rest exact:

- a worker that dies (segfault, OOM kill, ``os._exit``) takes exactly one job with it; that
  job is retried on another worker, and fails with ``WorkerCrashedError`` once it has killed
  ``max_crashes`` workers. Jobs in other workers never notice.
- a job past its timeout is stopped by killing its worker only (``CompileTimeout``).
- a queued job can be cancelled; a running one can be killed without touching the others.

The pool is in four parts: this module, what any thread may do (submit, cancel, kill, shut
down); ``_supervisor``, what its supervisor thread does; ``_workers``, a worker's life as a
state machine that both drive; and the readers of answers other than the supervisor
(``_loop_reads``: an asyncio loop reading small answers itself; ``_answers``: large answers
streamed by a thread, and how any answer becomes its job's outcome).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import itertools
import logging
import os
import threading
import weakref
from typing import Any, Callable

from aiocompile._base import checks
from aiocompile._pool.handle import State, Worker
from aiocompile._pool.job import Job, PoolCounters
from aiocompile._pool.launch import Launcher
from aiocompile._pool.loop_reads import LoopReads, running_loop
from aiocompile._pool.supervisor import Supervisor
from aiocompile.errors import SchedulerClosed
from aiocompile.records import WorkerEvent

logger = logging.getLogger("aiocompile")

def check_timeout(timeout: Any) -> None:
    """A job's timeout must be None or a positive, finite number of seconds (see
    ``checks.JOB_TIMEOUT``). Checked in the submitting thread: found later, in the
    supervisor, a bad value would stop it and fail every other job too."""
    checks.JOB_TIMEOUT.check("timeout", timeout)


class WorkerPool(Supervisor, cf.Executor):
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
        self.max_workers = checks.WORKERS.check("max_workers", max_workers)
        self.max_crashes = checks.CRASHES.check("max_crashes", max_crashes)
        self.max_worker_rss = checks.RSS.check("max_worker_rss", max_worker_rss)
        self.idle_timeout = checks.IDLE_TIMEOUT.check("idle_timeout", idle_timeout)
        self.worker_nice = checks.NICE.check("worker_nice", worker_nice)
        self.start_method = checks.START_METHOD.check("start_method", start_method)
        self._preload = checks.PRELOAD.check("preload", preload)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._commands: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        self._woken = False  # a wake-up is written and not yet drained
        self._cancelled = 0  # queued jobs cancelled since the supervisor last looked
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
        self._loop_reads = LoopReads(self)
        # Owned by the supervisor thread:
        self._launcher: Launcher | None = None
        self._workers: list[Worker] = []
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
        once to an idle worker, that loop reads the answer itself (see ``_loop_reads``).
        The job's future is then resolved in the loop's thread. Otherwise, and for
        everything but the answer, the supervisor reads and watches the worker."""
        self._check_usable()
        check_timeout(timeout)
        if max_crashes is not None:
            checks.CRASHES.check("max_crashes", max_crashes)
        job = Job.create(next(self._ids), fn, args, kwargs, timeout=timeout,
                         max_crashes=max_crashes or self.max_crashes, name=name, key=key, warm_only=warm_only)
        loop = running_loop() if direct and not warm_only else None
        worker = None if warm_only else self._claim_for_new(job, loop)
        if worker is None:
            self._command("submit", job)
            return job
        # The supervisor's wait must end at this job's deadline, and must watch the socket
        # exactly when no loop reads it: it stops for a loop that reads now, and starts
        # again for a worker that a loop or an answers thread read for last.
        wake = job.timeout is not None or worker.watched != (worker.reader is None)
        if self._start_job(worker, job) and wake:
            self._wake()
        return job

    def _claim_for_new(self, job: Job, loop: Any = None) -> Worker | None:
        """An idle worker for a new job, taken now, if no job is waiting ahead of it; with
        ``loop``, that loop is to read the answer, if it can."""
        with self._lock:
            if self._closed or self._thread is None or self._commands or self._pending or self._warm_pending:
                return None
            worker = self._claim_locked(lambda w: True, job)
            if worker is not None and loop is not None:
                worker.reader = self._loop_reads.reader_for(worker, loop)
            return worker

    def kill(self, job: Job, reason: str = "cancelled") -> None:
        """Stop a job: cancel it if queued, kill its worker if running."""
        if not self.cancel(job):
            self._command("kill", (job, reason))

    def cancel(self, job: Job) -> bool:
        """Drop a job that has not started; returns False (and does nothing) if it has."""
        if job.future.cancel():
            self._cancelled += 1
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

    def _check_usable(self) -> None:
        # A fork closes the child's copy of every pool (see _after_fork_in_child): whether
        # this is such a copy is asked only of a closed pool, sparing every job a getpid.
        if self._closed:
            if os.getpid() != self._pid:
                raise SchedulerClosed(
                    "this worker pool belongs to the parent of a forked process; create a new one here")
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
            "busy_workers": sum(1 for w in workers if w.state in (State.BUSY, State.KILLING)),
            "idle_workers": sum(1 for w in workers if w.state is State.IDLE),
            "queue_depth": len(self._pending),
        }

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in list(self._workers)]

    # -- shutdown ---------------------------------------------------------------------------

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, grace: float | None = None) -> None:
        """Stop accepting work. Queued jobs run unless ``cancel_futures``; running jobs get
        ``grace`` seconds (None: as long as they need) before their workers are killed.
        Every job still unfinished then fails with ``SchedulerClosed``."""
        checks.POOL_GRACE.check("grace", grace)
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

def _always() -> bool:
    return True


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
