"""WorkerPool: a ``concurrent.futures.Executor`` that supervises one job per worker process.

Each worker holds at most one job, sent over its own pipe, so the parent always knows
which job a worker holds. That is what makes the rest exact:

- a worker that dies (segfault, OOM kill, ``os._exit``) takes exactly one job with it; that
  job is retried on another worker, and fails with ``WorkerCrashed`` once it has killed
  ``max_crashes`` workers. Jobs in other workers never notice.
- a job past its timeout is stopped by killing its worker only (``JobTimeout``).
- a queued job can be cancelled; a running one can be killed without touching the others.

This is the face any thread calls. The pool owns its :class:`~aiocompile._pool.supervisor.Supervisor`
(the thread that drives the workers) and, through it, the ``Roster`` of workers and
queues they share.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import functools
import itertools
import os
import weakref
from typing import Any, Callable

from aiocompile._base import checks
from aiocompile._base.bridge import running_loop
from aiocompile._pool.job import Job, PoolCounters, Stop
from aiocompile._pool.roster import KillJob, Prepare, Shutdown, Submit
from aiocompile._pool.supervisor import Supervisor
from aiocompile.errors import SchedulerClosed
from aiocompile.records import WorkerEvent


def check_timeout(timeout: Any) -> None:
    """A job's timeout must be None or a positive, finite number of seconds (see
    ``checks.JOB_TIMEOUT``). Checked in the submitting thread: found later, in the
    supervisor, a bad value would stop it and fail every other job too."""
    checks.JOB_TIMEOUT.check("timeout", timeout)


class WorkerPool(cf.Executor):
    """A supervised pool of worker processes, one job per worker at a time.

    ``submit()`` follows the ``Executor`` contract; ``submit_job()`` also takes a timeout,
    a crash budget and a name for error messages, and returns the :class:`Job` with its
    timings. ``on_event``, if set, is called with a :class:`~aiocompile.records.WorkerEvent`
    for each worker start and exit and each attempt at a job, in the supervisor thread (or,
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
        worker_idle: bool = False,
    ) -> None:
        # Checked here, in the caller: the supervisor thread trusts them.
        self.max_workers = checks.WORKERS.check("max_workers", max_workers)
        self.max_crashes = checks.CRASHES.check("max_crashes", max_crashes)
        self.start_method = checks.START_METHOD.check("start_method", start_method)
        self._supervisor = Supervisor(
            max_workers=self.max_workers,
            start_method=self.start_method,
            preload=checks.PRELOAD.check("preload", preload),
            idle_timeout=checks.IDLE_TIMEOUT.check("idle_timeout", idle_timeout),
            worker_nice=checks.NICE.check("worker_nice", worker_nice),
            worker_idle=checks.FLAG.check("worker_idle", worker_idle),
            max_worker_rss=checks.RSS.check("max_worker_rss", max_worker_rss),
        )
        self._roster = self._supervisor.roster
        self._pid = os.getpid()
        self._ids = itertools.count(1)
        _live_pools.add(self)

    # -- what it reports ------------------------------------------------------------------------

    @property
    def counters(self) -> PoolCounters:
        """What the pool has done (written by its supervisor thread)."""
        return self._roster.counters

    @property
    def on_event(self) -> Callable[[WorkerEvent], None] | None:
        return self._roster.on_event

    @on_event.setter
    def on_event(self, listener: Callable[[WorkerEvent], None] | None) -> None:
        self._roster.on_event = listener

    @property
    def job_events_wanted(self) -> Callable[[], bool]:
        """Whether anyone takes ``job_started``/``job_ended`` events now (asked per job)."""
        return self._roster.job_events_wanted

    @job_events_wanted.setter
    def job_events_wanted(self, wanted: Callable[[], bool]) -> None:
        self._roster.job_events_wanted = wanted

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
        once (see ``roster``).

        ``direct=True`` says that the caller will await the job in the asyncio event loop
        running in this thread, and that its answer is small: then, when the job goes at
        once to an idle worker, that loop reads the answer itself (see ``loop_reads``).
        The job's future is then resolved in the loop's thread. Otherwise, and for
        everything but the answer, the supervisor reads and watches the worker."""
        self._check_usable()
        check_timeout(timeout)
        if max_crashes is not None:
            checks.CRASHES.check("max_crashes", max_crashes)
        job = Job.create(next(self._ids), fn, args, kwargs, timeout=timeout,
                         max_crashes=max_crashes or self.max_crashes, name=name, key=key, warm_only=warm_only,
                         apart=True)
        loop = running_loop() if direct and not warm_only else None
        worker = None
        reads = self._supervisor.loop_reads
        if not warm_only:
            reader = None if loop is None else (lambda w: reads.reader_for(w, loop))
            worker = self._roster.claim_for_new(job, reader)
        if worker is None:
            self._supervisor.command(Submit(job))
            return job
        # The supervisor's wait must end at this job's deadline, and must watch the socket
        # exactly when no loop reads it: it stops for a loop that reads now, and starts
        # again for a worker that a loop or an answers thread read for last.
        wake = job.timeout is not None or worker.watched != (worker.reader is None)
        reader = worker.reader
        if self._roster.start_job(worker, job):
            if wake:
                self._supervisor.wake()
            if loop is not None and reader is not None:
                job.look = functools.partial(reads.linger, worker, reader)
        return job

    def kill(self, job: Job, stop: Stop = Stop.CANCELLED) -> None:
        """Stop a job: cancel it if queued, kill its worker if running."""
        if not self.cancel(job):
            self._supervisor.command(KillJob(job, stop))

    def cancel(self, job: Job) -> bool:
        """Drop a job that has not started; returns False (and does nothing) if it has."""
        if job.future.cancel():
            self._roster.cancelled += 1
            self._supervisor.wake()
            return True
        return False

    def start(self) -> None:
        """Get the pool ready to start workers (the fork server loads in the background);
        returns at once. Workers themselves still start on demand."""
        self._check_usable()
        self._supervisor.command(Prepare())

    def warm(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[Job]:
        """Start every worker and run ``fn(*args)`` once in each worker not yet warmed."""
        return [self.submit_job(fn, args, warm_only=True, name="warm-up") for _ in range(self.max_workers)]

    def _check_usable(self) -> None:
        # A fork closes the child's copy of every pool (see _after_fork_in_child): whether
        # this is such a copy is asked only of a closed pool, sparing every job a getpid.
        if self._roster.closed:
            if os.getpid() != self._pid:
                raise SchedulerClosed(
                    "this worker pool belongs to the parent of a forked process; create a new one here")
            raise SchedulerClosed("the worker pool is shut down")

    # -- introspection (any thread) -------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._roster.closed

    def snapshot(self) -> dict[str, int]:
        """Workers by state and queue depth now (a racy read, good for metrics)."""
        return self._roster.snapshot()

    def worker_pids(self) -> list[int]:
        return self._roster.worker_pids()

    # -- shutdown ---------------------------------------------------------------------------

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, grace: float | None = None) -> None:
        """Stop accepting work. Queued jobs run unless ``cancel_futures``; running jobs get
        ``grace`` seconds (None: as long as they need) before their workers are killed.
        Every job still unfinished then fails with ``SchedulerClosed``."""
        checks.POOL_GRACE.check("grace", grace)
        if os.getpid() != self._pid:
            self.forget_after_fork()
            return
        roster = self._roster
        with roster.lock:
            first = not roster.closed
            roster.closed = True
            if first:
                roster.commands.append(Shutdown(cancel_futures, grace))
        if first and cancel_futures:
            # Nothing queued will run: a fork server still starting (seconds of imports) is
            # not waited for, and a program that ends meanwhile exits at once.
            self._supervisor.interrupt_start()
        self._supervisor.close(wait)

    def forget_after_fork(self) -> None:
        """In a forked child: the processes belong to the parent. Drop this process's
        copies of the descriptors without telling anyone anything."""
        self._supervisor.forget()


_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _shutdown_all_at_exit() -> None:
    for pool in list(_live_pools):
        pool.shutdown(wait=True, cancel_futures=True, grace=0)


def _after_fork_in_child() -> None:
    for pool in list(_live_pools):
        pool.forget_after_fork()


atexit.register(_shutdown_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
