"""ForeignPool: any ``concurrent.futures.Executor`` behind the scheduler, made crash-safe.

A stdlib ``ProcessPoolExecutor`` turns one worker's death into ``BrokenProcessPool`` for
every job it holds, and stays broken. Here, a break

1. rebuilds the executor through the factory;
2. sorts the lost jobs: a job whose future was still PENDING never reached a worker and is
   simply sent again; a job that may have been running is a *suspect*;
3. runs the suspects one at a time, alone in the executor, holding every other job back,
   so that a suspect that breaks the executor again is the culprit for certain. The
   culprit is retried (alone) until it has broken the executor ``max_crashes`` times, then
   fails with ``WorkerCrashed``; every other suspect simply completes;
4. releases the held jobs once no suspect is left.

So no innocent job fails. What a foreign executor cannot do is stop a running job: a job
past its timeout fails with ``JobTimeout`` at once but occupies its worker until it
ends, and cancelling a running job only stops waiting for it. At shutdown, the processes
of a stdlib ``ProcessPoolExecutor`` still busy after the grace period are killed.

Timeouts count from when a worker is free for the job, as in aiocompile's own pool; but a
foreign executor does not say when that is (a stdlib pool's future turns RUNNING when the
job enters its call queue, where ``max_workers`` + 1 may wait). So the clock is started by
count. Jobs go to the executor in order; a stdlib ``ProcessPoolExecutor`` or
``ThreadPoolExecutor`` runs them in that order on ``max_workers`` workers, and a job keeps
its worker until it ends, past its timeout too. A job therefore has a worker once fewer
than ``max_workers`` of the jobs sent before it are unfinished, and its clock starts then,
as the job before it is seen to end. That is a moment after the worker really takes it
(the previous answer's way back to this process), so a job may run that much past its
timeout; or, where the executor starts a worker process for the job, a moment before (the
process's start-up counts). Jobs past their timeouts may never end: a job waiting for
workers that they hold, all of them, has its clock started at once rather than wait
forever. With any other executor (its order or its number of workers unknown) the clock
starts when the job is handed over, and its wait in the executor counts. Records take the
start time the worker reports with its answer.

A job's exception comes back described in plain values (as aiocompile's own workers send
it) and is rebuilt here (``_pool.protocol``): an executor would unpickle the exception itself in
its own thread, and a stdlib pool that cannot (its class lives in a module only the worker
imports) breaks, failing or re-running every job it holds.

An executor of a cluster (``aiocompile.dask``) loses jobs one worker at a time rather than
all at once, and can do what a stdlib pool cannot: it says so with a few optional members
(a job's future failing with ``WorkerLost``, ``capacity()``, ``kill(future)``,
``job_runner``; see ``executors``), which this pool uses where they exist.

The PENDING/RUNNING sort relies on the executor's bookkeeping: when the first future of a
broken stdlib executor is failed, ours is the first callback to run, and the other futures
still show the state they had at the break (the stdlib fails them one after another, in one
thread). Where that does not hold, more jobs are suspects: slower, never wrong.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import os
import sys
import threading
import time
from typing import Any, Callable

from aiocompile._base import checks
from aiocompile._foreign.executors import (
    ExecutorSpec,
    WorkerLost,
    factory_for,
    join_processes,
    kill_processes,
    workers_in_order,
)
from aiocompile._foreign.remote import run_in_foreign_worker
from aiocompile._foreign.sent import Sent
from aiocompile._pool.job import Job, PoolCounters, Stop, emit_event, logger, times
from aiocompile._pool.protocol import outcome
from aiocompile.errors import JobTimeout, SchedulerClosed, WorkerCrashed
from aiocompile.records import WorkerEvent

# How long a closed stdlib pool's idle processes may take to exit before they are killed.
_JOIN_TIMEOUT = 10.0


class ForeignPool:
    """The scheduler's pool interface over a foreign executor (see the module docstring)."""

    def __init__(self, executor: ExecutorSpec, *, max_crashes: int = 2) -> None:
        executor = adapt(executor)
        if isinstance(executor, cf.Executor):
            self._executor: cf.Executor | None = executor
            self._factory = factory_for(executor)
        elif callable(executor):
            self._executor = None
            self._factory = executor
        else:
            raise TypeError(f"executor must be a concurrent.futures.Executor or a factory of one, got {executor!r}")
        self.max_crashes = checks.CRASHES.check("max_crashes", max_crashes)
        self.max_workers = int(getattr(self._executor, "_max_workers", 0) or 0)
        self._slots = workers_in_order(self._executor)
        self.counters = PoolCounters()
        self.on_event: Callable[[WorkerEvent], None] | None = None
        self.job_events_wanted: Callable[[], bool] = lambda: True  # as WorkerPool's; every event is sent here
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._closed = False
        self._generation = 0
        # Jobs whose executor future has not finished, timed-out ones included, in the
        # order sent; each leaves as it moves to GONE (``sent``).
        self._sent: dict[int, Sent] = {}
        # The job cancel() is taking back from the executor right now (see ``sent``).
        self._withdrawing: Sent | None = None
        self._suspects: collections.deque[Job] = collections.deque()
        self._held: collections.deque[Job] = collections.deque()
        self._alone: Job | None = None
        # Recently dead workers of a cluster's executor, so that one death taking several
        # jobs counts once.
        self._dead: collections.deque[Any] = collections.deque(maxlen=256)
        self._adopt(self._executor)

    def _adopt(self, executor: cf.Executor | None) -> None:
        """Note what ``executor`` offers beyond ``concurrent.futures`` (module docstring)."""
        self._runner: Callable[..., Any] = getattr(executor, "job_runner", None) or run_in_foreign_worker
        self._capacity: Callable[[], int] | None = getattr(executor, "capacity", None)
        self._killer: Callable[[cf.Future[Any]], None] | None = getattr(executor, "kill", None)

    # -- the pool interface -----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        # Also in a forked child, where this pool's executor belongs to the parent.
        return self._closed or os.getpid() != self._pid

    def start(self) -> None:
        with self._lock:
            self._current()

    def warm(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[Job]:
        # A foreign executor offers no way to reach each of its workers.
        return []

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
        direct: bool = False,  # answers always come through the executor's own future
    ) -> Job:
        if self._closed or os.getpid() != self._pid:
            raise SchedulerClosed("the executor is shut down")
        checks.JOB_TIMEOUT.check("timeout", timeout)
        if max_crashes is not None:
            checks.CRASHES.check("max_crashes", max_crashes)
        job = Job.create(next(self._ids), fn, args, kwargs, timeout=timeout,
                         max_crashes=max_crashes or self.max_crashes, name=name, key=key)
        with self._lock:
            if self._quarantine() or self._full():
                self._held.append(job)
                self.counters.queue_depth_max = max(self.counters.queue_depth_max, len(self._held))
            else:
                self._send(job)
        return job

    def cancel(self, job: Job) -> bool:
        with self._lock:
            for queue in (self._held, self._suspects):
                if job in queue:
                    queue.remove(job)
                    job.future.cancel()
                    return True
            sent = self._sent.get(job.id)
            if sent is not None:
                self._withdrawing = sent
                try:
                    withdrawn = sent.future.cancel()
                finally:
                    self._withdrawing = None
                if withdrawn:
                    self._forget(sent, withdrawn=True)
                    self._start_clocks()
                    job.future.cancel()
                    return True
                # Running already: it stays, and ends as it will.
        return False

    def kill(self, job: Job, stop: Stop = Stop.CANCELLED) -> None:
        """Drop a queued job; stop a running one where the executor can (``kill``), and
        otherwise let it run on."""
        if self.cancel(job):
            return
        with self._lock:
            sent = self._sent.get(job.id)
            if sent is None or self._killer is None or not sent.killable or job.future.done():
                return
            sent.kill()
            self.counters.killed += 1
        job.fail(job.stopped_error(stop))
        self._stop_running(sent)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            running = sum(1 for s in self._sent.values() if s.future.running())
            waiting = len(self._sent) - running + len(self._held) + len(self._suspects)
            workers = self._capacity() if self._capacity is not None else self.max_workers
        return {"workers": workers, "busy_workers": running,
                "idle_workers": max(0, workers - running), "queue_depth": waiting}

    def worker_pids(self) -> list[int]:
        processes = getattr(self._executor, "_processes", None) or {}
        return list(processes)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, grace: float | None = None) -> None:
        checks.POOL_GRACE.check("grace", grace)
        closed = SchedulerClosed("the scheduler was closed before the job finished")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            executor = self._executor
            waiting = list(self._held) + list(self._suspects)
            self._held.clear()
            self._suspects.clear()
            for sent in self._sent.values():
                sent.stop_clock()
        for job in waiting:
            job.fail(closed)
        if executor is not None:
            # The stdlib forgets its processes in shutdown(): note them first.
            processes = list((getattr(executor, "_processes", None) or {}).values())
            executor.shutdown(wait=False, cancel_futures=cancel_futures)
            if wait:
                running = [s.future for s in list(self._sent.values())]
                _, not_done = cf.wait(running, timeout=grace)
                if self._killer is not None:
                    # A cluster's executor stops its own jobs, and its shutdown waits for
                    # those stops: no compile of ours goes on holding the cluster. Their
                    # callers learn why first: the close, not the stop.
                    with self._lock:
                        stopped = [sent for sent in self._sent.values() if sent.future in not_done]
                    for sent in stopped:
                        sent.job.fail(closed)
                        self._kill_quietly(sent.future)
                    executor.shutdown(wait=True)
                else:
                    if not_done:
                        kill_processes(processes)
                    # shutdown(wait=False) only asked them to go: make sure they are gone
                    # before returning, as a closed scheduler leaves no process behind.
                    join_processes(processes, _JOIN_TIMEOUT)
        with self._lock:
            # Killing the busy processes above breaks the executor, and its callbacks
            # may have sorted the lost jobs into suspects and held jobs meanwhile.
            left = [sent.job for sent in self._sent.values()] + list(self._suspects) + list(self._held)
            if self._alone is not None:
                left.append(self._alone)
            for sent in list(self._sent.values()):
                self._forget(sent)
            self._suspects.clear()
            self._held.clear()
            self._alone = None
        for job in left:
            job.fail(closed)

    # -- sending and receiving (the lock is held in every method below) ---------------------

    def _quarantine(self) -> bool:
        return bool(self._suspects) or self._alone is not None

    def _full(self) -> bool:
        """The executor runs as many jobs as it can at once (where it says how many)."""
        if self._capacity is None or self._executor is None:
            return False
        return len(self._sent) >= max(1, self._capacity())

    def _forget(self, sent: Sent, withdrawn: bool = False) -> None:
        del self._sent[sent.job.id]
        sent.ended(withdrawn)

    def _stop_running(self, sent: Sent) -> None:
        """Have the executor stop a job that failed already (past its timeout, or killed),
        so that it does not go on holding a worker. Not under the lock: the executor may
        take its time, in a thread of its own."""
        self._kill_quietly(sent.future)

    def _kill_quietly(self, future: cf.Future[Any]) -> None:
        if self._killer is None:
            return
        try:
            self._killer(future)
        except Exception:  # noqa: BLE001 - the job has its outcome; a worker left running is logged
            logger.warning("aiocompile: the executor could not stop a job", exc_info=True)

    def _current(self) -> cf.Executor:
        if self._executor is None:
            if self._factory is None:
                raise SchedulerClosed("the executor broke and cannot be rebuilt: pass a factory as executor=")
            self._executor = self._factory()
            self.max_workers = int(getattr(self._executor, "_max_workers", self.max_workers) or self.max_workers)
            self._slots = workers_in_order(self._executor)
            self._adopt(self._executor)
        return self._executor

    def _send(self, job: Job) -> None:
        if job.future.cancelled():
            return
        generation = self._generation
        try:
            executor = self._current()
            future = executor.submit(self._runner, job.payload, job.env, job.sys_path)
        except cf.BrokenExecutor:
            # Broken before its futures told us: sort that out, and this job never ran.
            self._break(generation, None)
            self._held.appendleft(job)
            self._pump()
            return
        except SchedulerClosed as exc:
            job.fail(exc)
            return
        job.mark_running()  # a re-run's is RUNNING already; cancelling is under the lock we hold
        job.attempts += 1
        sent = self._sent[job.id] = Sent(job, future, generation)
        if self._slots:
            self._start_clocks()
        else:
            self._start_clock(sent)
        future.add_done_callback(lambda _: self._on_done(sent))

    def _start_clocks(self) -> None:
        """Start the clock of each job that a worker is free for, by count: fewer than
        ``_slots`` unfinished jobs were sent before it. Or that waits for workers all held
        by jobs past their timeouts: those may never end, and it must not wait forever."""
        if not self._slots:
            return  # each clock started as its job was handed over
        ahead = stuck = 0
        for sent in self._sent.values():
            if sent.waiting:
                if ahead >= self._slots > stuck:
                    break  # so does every job after it: the jobs with a clock are a prefix
                self._start_clock(sent)
            ahead += 1
            stuck += sent.overdue

    def _start_clock(self, sent: Sent) -> None:
        if self._closed:
            return  # every job still held fails at the end of shutdown(): no timer may outlive it
        job = sent.job
        sent.clock()
        now = time.monotonic()
        if job.started_at is None:
            job.started_at = now
        job.attempt_started_at = now
        if job.timeout is not None and not job.future.done():
            sent.timer = threading.Timer(job.timeout, self._on_timeout, (sent,))
            sent.timer.daemon = True
            sent.timer.start()

    def _on_done(self, sent: Sent) -> None:
        job, future = sent.job, sent.future
        with self._lock:
            if sent.gone or sent is self._withdrawing:
                return  # dealt with by a break, or being cancelled
            exc = None if future.cancelled() else future.exception()
            if isinstance(exc, cf.BrokenExecutor):
                self._break(sent.generation, job)
                self._pump()
                return
            if isinstance(exc, WorkerLost):
                self._lost(sent, exc)
                self._pump()
                self._start_clocks()
                return
            self._forget(sent)
            if job is self._alone:
                self._alone = None
            self._pump()
            self._start_clocks()
        job.finished_at = now = time.monotonic()
        if exc is not None:
            emit_event(self.on_event, "job_ended", None, job, status="error")
            job.fail(exc)
        elif future.cancelled():
            # Only the executor's own shutdown cancels a future we still track (those that
            # cancel() withdraws never get here): the job never ran.
            job.fail(SchedulerClosed("the scheduler was closed before the job started"))
        else:
            ok, value, run_time, pid, started_wall = future.result()
            job.run_time, job.worker_pid = run_time, pid
            # The worker knows when it really started: that replaces the count's estimate,
            # kept between the job's submission and now (another machine's clock may differ).
            job.attempt_started_at = min(max(now - (time.time() - started_wall), job.submitted_at), now)
            if job.attempts == 1:
                job.started_at = job.attempt_started_at
            emit_event(self.on_event, "job_ended", pid, job, status="ok" if ok else "error")
            if not ok:
                job.fail(outcome(False, value, "", job.name, job.key).value)
            else:
                job.succeed(value)

    def _on_timeout(self, sent: Sent) -> None:
        job = sent.job
        with self._lock:
            if sent.gone or job.future.done():
                return
            self.counters.timeouts += 1
            # Killed already (its failure on its way): stopped once, by kill().
            stop = self._killer is not None and sent.killable
            sent.time_out()
            self._start_clocks()
        # The job's own future fails now; its executor future stays tracked until the
        # worker is free again, so that a later break is still blamed correctly.
        then = "it was stopped and its worker restarted" if stop else "the executor cannot stop it: it runs on"
        job.fail(JobTimeout(f"did not finish within {job.timeout:g} s ({then})",
                                timeout=job.timeout, kernel_name=job.name, key=job.key))
        if stop:
            emit_event(self.on_event, "worker_exited", None, job, status="timeout")
            self._stop_running(sent)

    def _lost(self, sent: Sent, exc: WorkerLost) -> None:
        """The worker holding ``sent``'s job died; the executor carries on (a cluster).
        The job runs again: at once if the executor killed that worker on purpose, and
        otherwise as a suspect (alone, so that a death then is its own doing)."""
        job = sent.job
        self._forget(sent)
        if not exc.deliberate and (exc.worker is None or exc.worker not in self._dead):
            self._dead.append(exc.worker)
            self.counters.worker_crashes += 1
            emit_event(self.on_event, "worker_exited", None, status="crashed")
        alone = job is self._alone
        if alone:
            self._alone = None
        if job.future.done():
            return  # timed out or cancelled already: nobody waits for a re-run
        if self._closed:
            job.fail(SchedulerClosed("the scheduler was closed while the job ran"))
        elif exc.deliberate:
            self.counters.retries += 1
            self._held.appendleft(job)
        elif alone:
            self._crashed(job)  # it ran alone: the culprit, for certain
        else:
            self.counters.retries += 1
            self._suspects.append(job)

    def _break(self, generation: int, first: Job | None) -> None:
        """The executor of ``generation`` broke. Sort the jobs it lost."""
        if generation != self._generation:
            return  # handled already: this is one more of its futures
        self._generation += 1
        self.counters.worker_crashes += 1
        emit_event(self.on_event, "worker_exited", None, status="crashed")
        broken, self._executor = self._executor, None
        lost = [s for s in self._sent.values() if s.generation == generation]
        for sent in lost:
            self._forget(sent)  # a re-run's clock starts afresh, once a worker is free for it
        alone, self._alone = self._alone, None
        for sent in lost:
            job = sent.job
            if job.future.done():
                continue  # timed out or cancelled already: nobody waits for a re-run
            if self._closed:
                job.fail(SchedulerClosed("the scheduler was closed while the job ran"))
                continue
            if job is alone:
                self._crashed(job)  # it ran alone: the culprit, for certain
                continue
            self.counters.retries += 1
            if job is first or sent.future.running() or sent.future.done():
                self._suspects.append(job)
            else:
                self._held.appendleft(job)
        if broken is not None:
            threading.Thread(target=broken.shutdown, kwargs={"cancel_futures": True}, daemon=True).start()
        if self._factory is None:
            error = SchedulerClosed("the executor broke and cannot be rebuilt: pass a factory as executor=")
            for job in list(self._suspects) + list(self._held):
                job.fail(error)
            self._suspects.clear()
            self._held.clear()

    def _crashed(self, job: Job) -> None:
        job.crashes += 1
        if job.crashes >= job.max_crashes:
            job.fail(WorkerCrashed(
                f"killed its worker (or broke the executor) {times(job.crashes)}, running alone each time",
                exitcode=None, attempts=job.attempts, kernel_name=job.name, key=job.key))
        else:
            self.counters.retries += 1
            self._suspects.appendleft(job)

    def _pump(self) -> None:
        """After a job ended: the next suspect, alone, or, once none is left, everything
        held back."""
        if self._closed or self._alone is not None:
            return
        if self._suspects:
            # Alone means alone: wait for jobs still running (timed-out ones) to end.
            if self._sent:
                return
            job = self._suspects.popleft()
            self._alone = job
            self._send(job)
            return
        while self._held and not self._quarantine() and not self._full():
            self._send(self._held.popleft())



def adapt(executor: Any) -> Any:
    """A Dask client (or its ``get_executor()``) as ``aiocompile.dask``'s executor over it,
    which keeps the scheduler's crash and timeout semantics; anything else as it is."""
    distributed = sys.modules.get("distributed")  # a client in hand means it is imported
    if distributed is None:
        return executor
    client_executor = getattr(sys.modules.get("distributed.cfexecutor"), "ClientExecutor", None)
    if isinstance(client_executor, type) and isinstance(executor, client_executor):
        executor = getattr(executor, "_client", executor)
    if isinstance(executor, distributed.Client):
        from aiocompile._foreign.dask import executor as dask_executor

        return dask_executor(executor)
    return executor
