"""A request's life, from its admission to its record.

A request is admitted (counted, then answered from the memory cache, joined to the job
already under way for its key, or started), its work runs (a read of the disk cache, then
of the shared cache, then a job in the pool if both missed), and it ends in exactly one
outcome, recorded once: ``compiled``, ``cache_hit``, ``disk_hit``, ``shared_hit``,
``joined``, ``error_hit``, ``error``, ``timeout``, ``crashed``, ``cancelled`` or
``closed``. A compiled result is written to both caches afterwards, and one found in the
shared cache to the disk cache.

Everything here is thread-safe and tied to no event loop: requests arrive from any loop in
any thread (or from none, for Inductor's synchronous compiles), jobs finish in the pool's
supervisor thread (or a foreign executor's callback thread), cache reads in the caches'
threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import time
from typing import Any, Callable, NamedTuple

import anyio

from aiocompile._base import bridge
from aiocompile._base.config import SchedulerConfig
from aiocompile._cache.disk import DiskCache
from aiocompile._cache.memory import Entry, Found, KernelCache
from aiocompile._cache.shared import SharedCache
from aiocompile._core.admission import Gates
from aiocompile._core.costs import CostHistory
from aiocompile._foreign.pool import ForeignPool
from aiocompile._observe.events import EventHub
from aiocompile._observe.metrics import Metrics
from aiocompile._pool.job import Job
from aiocompile._pool.pool import WorkerPool, check_timeout
from aiocompile.backends import Request
from aiocompile.errors import CompileError, JobError, JobTimeout, SchedulerClosed, WorkerCrashed
from aiocompile.records import JobRecord, Outcome

_make = tuple.__new__


class Admitted(NamedTuple):
    """What ``Requests.admit`` made of a request, for ``Requests.result`` (a typed named
    tuple: one is made for every request)."""

    how: Found
    value: Any
    """The result (``HIT``), the remembered exception (``ERROR``), or the :class:`Entry`
    the request waits on (``JOINED``, ``STARTED``)."""
    wall: float
    """When it arrived, by the wall clock (its record's ``queued_at``)."""
    arrived: float
    """When it arrived, by the monotonic clock."""

    @property
    def waits(self) -> bool:
        """It waits for a job (its own or another's), rather than being answered at once."""
        return self.how is Found.STARTED or self.how is Found.JOINED


class Requests:
    """The request path of one scheduler: its cache, pool, disk cache and metrics."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        pool: WorkerPool | ForeignPool,
        cache: KernelCache,
        disk: DiskCache | None,
        shared: SharedCache | None = None,
        metrics: Metrics,
        events: EventHub,
        costs: CostHistory,
        check_open: Callable[[], None],
    ) -> None:
        self.config = config
        self._pool = pool
        self._cache = cache
        self._disk = disk
        self._shared = shared
        self._metrics = metrics
        self._events = events
        self._costs = costs
        self._check_open = check_open
        self._gates = Gates()
        self._turns = bridge.Turns()

    async def execute(self, request: Request, timeout: float | None) -> Any:
        """A request's result: admitted in its turn (``admission``), answered by a cache, a
        job under way or a new job, and recorded."""
        # A burst of requests is admitted a loop iteration's slice at a time; one waiting
        # its turn has not been counted or started yet.
        await self._gates.enter()
        admitted = self.admit(request, timeout)
        result = await self.result(request, admitted)
        if admitted.waits:
            self._gates.waited()  # it waited for its job: the loop has gone round (see admission)
        return result

    async def execute_now(self, request: Request, timeout: float | None) -> Any:
        """``execute`` for a request built in no time (``run()``): in the usual case
        (asyncio, the gate open) admitted without an await; its turn first otherwise (in a
        burst most requests wait there, and what they have not built yet costs the loop
        nothing now)."""
        if not self._gates.enter_now():
            await self._gates.enter()
        admitted = self.admit(request, timeout)
        result = await self.result(request, admitted)
        if admitted.waits:
            self._gates.waited()
        return result

    def admit(self, request: Request, timeout: float | None) -> Admitted:
        """Count a request, then answer it from the cache, join it to the job under way, or
        start one, as ``KernelCache.join_or_start`` says. A hit, a remembered error and a
        failure to start are recorded here; the other requests are recorded when their job
        ends."""
        self._check_open()
        check_timeout(timeout)
        arrived, wall = time.monotonic(), time.time()
        self._metrics.submit()
        if timeout is None:
            timeout = self.config.timeout
        try:
            if request.key is None and request.finish is None:
                # Nothing to share, to remember or to make of the answer: the caller waits
                # on the job's own future (a second future, and the callback that passes
                # the result from one to the other, were a tenth of a trivial job's round
                # trip).
                job = self._submit_job(request, timeout)
                # Made straight from its values (no Python-level __new__): on every run().
                return _make(Admitted, (Found.STARTED, Entry(None, future=job.future, job=job), wall, arrived))
            how, found = self._cache.join_or_start(request.key, lambda entry: self._start(entry, request, timeout))
        except BaseException as exc:
            self._record(request, _failure_outcome(exc), wall, arrived, None, error=exc)
            raise
        if how is Found.HIT:
            self._record(request, Outcome.CACHE_HIT, wall, arrived, None, result=found)
        elif how is Found.ERROR:
            self._record(request, Outcome.ERROR_HIT, wall, arrived, None, error=found)
        return _make(Admitted, (how, found, wall, arrived))

    async def result(self, request: Request, admitted: Admitted) -> Any:
        """The result of a request ``admit`` let in. Its first await is inside the
        bookkeeping below, so a caller that admits and then starts a task for this (under
        anyio, whose tasks always run to their first checkpoint) loses no request."""
        how, found, wall, arrived = admitted
        if how is Found.HIT:
            return found
        if how is Found.ERROR:
            raise found.with_traceback(None)
        entry: Entry = found
        job = entry.job
        # Started by this request, in this thread, and its answer read by this loop: the
        # records left for later are made while its worker runs, then the answer is
        # looked for here, before this task sleeps (a trivial job's answer is back by
        # then, and waking the task again cost a turn of the loop). The loop is still let
        # go now and then.
        looked = how is Found.STARTED and job is not None and job.look is not None
        if looked:
            self._metrics.drain()
            job.look_for_answer()  # type: ignore[union-attr]
        try:
            if not looked:
                result = await bridge.wait(entry.future)
            elif entry.future.done():
                await self._turns.now_and_then()
                result = bridge.settled(entry.future)
            else:
                result = await bridge.wait(entry.future)
                self._turns.let_go()
        except BaseException as exc:
            if isinstance(exc, JobError) and exc.kernel_name == request.name:
                # Made where only the job's name is known (its worker's death, its timeout).
                exc.subject = request.subject
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                self._cache.leave(entry, self._stop_abandoned)
                self._record(request, Outcome.CANCELLED, wall, arrived, entry)
            else:
                self._cache.leave(entry)
                outcome = _failure_outcome(exc) if how is Found.STARTED else Outcome.JOINED
                self._record(request, outcome, wall, arrived, entry, error=exc)
            raise
        self._cache.leave(entry)
        outcome = _success_outcome(how, entry)
        if not self._record_later(request, outcome, wall, arrived, entry, result):
            self._record(request, outcome, wall, arrived, entry, result=result)
        return result

    def _record_later(self, request: Request, outcome: Outcome, wall: float, arrived: float, entry: Entry,
                      result: Any) -> bool:
        """Leave a request's record to the event loop's next turn, if nobody would see it
        before then: no listener, no event file, no logger at DEBUG (``statistics()`` and
        every other read of the metrics makes the records still waiting first). Returns
        False where it must be made now: a listener is told as it happens, and trio (or no
        asyncio loop here) has no turn to leave it to.

        The caller has its result at once, and the record is made while its next job is
        already on its way to a worker: a trivial job's round trip is that much shorter.
        Its times are read now."""
        if not self.config.metrics or self._events.job_events_wanted():
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        metrics = self._metrics
        clock = (time.monotonic(), time.time())
        size = getattr(result, "size", None)
        if metrics.later(functools.partial(self._record, request, outcome, wall, arrived, entry, size=size,
                                           clock=clock)):
            loop.call_soon(metrics.scheduled_drain)
        return True

    def _stop_abandoned(self, entry: Entry) -> bool:
        """Nobody waits for this job any more: drop it if it has not started. A started
        one runs on, its result kept for the next caller, unless the configuration says
        to kill it. Returns whether the job was stopped."""
        job = entry.job
        if job is None or job.future.done():
            return False
        if self._pool.cancel(job):
            return True
        if self.config.cancel_running == "kill":
            self._pool.kill(job)
            return True
        return False

    def _start(self, entry: Entry, request: Request, timeout: float | None) -> None:
        """Start the work for a new entry: a read of the disk cache if there is one for this
        kind of result, then of the shared cache, then a job (each after a miss)."""
        disk = self._disk
        if disk is not None and disk.access != "refused" and request.key is not None and request.decode is not None:
            lookup = disk.submit(disk.load, request.key, request.decode)
            lookup.add_done_callback(lambda done: self._after_read("disk", entry, request, timeout, done))
            return
        self._read_shared(entry, request, timeout)

    def _read_shared(self, entry: Entry, request: Request, timeout: float | None) -> None:
        shared = self._shared
        lookup = None
        if shared is not None and request.key is not None and request.decode is not None:
            lookup = shared.lookup(request.key, request.decode)  # None: left alone for now
        if lookup is None:
            self._submit(entry, request, timeout)
            return
        lookup.add_done_callback(lambda done: self._after_read("shared", entry, request, timeout, done))

    def _after_read(self, tier: str, entry: Entry, request: Request, timeout: float | None,
                    done: cf.Future[Any]) -> None:
        # In a cache's thread, as a done-callback: an exception escaping it would only be
        # logged, and every request waiting on the entry would wait forever. So whatever
        # goes wrong here fails those requests instead. (An entry that cannot be used is
        # not such a thing: the read answers a miss for it.)
        try:
            found = done.result()
            if found is not None:
                result, entry.load_time = found
                entry.source = Outcome.DISK_HIT if tier == "disk" else Outcome.SHARED_HIT
                self._complete(entry, request, result)
                if tier == "shared":
                    self._keep_on_disk(request, result)
                return
            if self._cache.abandoned(entry):
                # Everyone stopped waiting while the cache was read: no compile for nobody.
                entry.future.cancel()
                return
            if tier == "disk":
                self._read_shared(entry, request, timeout)
            else:
                self._submit(entry, request, timeout)
        except BaseException as exc:
            self._fail(entry, exc)

    def _keep_on_disk(self, request: Request, result: Any) -> None:
        disk = self._disk
        if disk is not None and request.key is not None and request.encode is not None:
            encode = request.encode
            disk.store(request.key, lambda: encode(result))

    def _submit_job(self, request: Request, timeout: float | None) -> Job:
        return self._pool.submit_job(
            request.fn, request.args, timeout=timeout, name=request.name, key=request.key, direct=request.direct
        )

    def _submit(self, entry: Entry, request: Request, timeout: float | None) -> None:
        job = self._submit_job(request, timeout)
        entry.job = job

        job.future.add_done_callback(bridge.Once(self._job_finished, entry, request, job))

    def _job_finished(self, entry: Entry, request: Request, job: Job, done: cf.Future[Any]) -> None:
        # Runs in the supervisor thread as soon as the worker has answered (or, for a
        # ``direct`` request, maybe in the event loop's thread that read the answer).
        try:
            raw = done.result()
            if request.details is not None and self.config.metrics:
                entry.details = request.details(raw)
                if not entry.details.get("compiler_cache_hit") and job.run_time is not None:
                    self._costs.note(request.key, request.name, request.backend, request.target, job.run_time,
                                     request.features)
            if request.finish is None:
                result = raw  # nothing to load: no load time
            else:
                started = time.perf_counter()
                result = request.finish(raw)
                entry.load_time = time.perf_counter() - started
        except BaseException as exc:
            # Only a deterministic compile error is worth remembering: a crash or a
            # timeout (neither is a CompileError) may well not happen again.
            remember = isinstance(exc, CompileError)
            self._cache.fail(entry, exc, remember)
            entry.future.set_exception(exc)
            return
        try:
            self._complete(entry, request, result)
        except BaseException as exc:  # a done-callback must not leave its waiters waiting
            self._fail(entry, exc)
            return
        if request.key is None or request.encode is None:
            return
        # Both tiers keep the same bytes: encoded once, by whichever writes first.
        encode = functools.lru_cache(maxsize=1)(functools.partial(request.encode, result))
        if self._disk is not None:
            self._disk.store(request.key, encode)
        if self._shared is not None:
            self._shared.store(request.key, encode)

    def _fail(self, entry: Entry, exc: BaseException) -> None:
        """Fail an entry whose work went wrong outside the job itself (not remembered)."""
        self._cache.discard(entry)
        if not entry.future.done():
            entry.future.set_exception(exc)

    def _complete(self, entry: Entry, request: Request, result: Any) -> None:
        self._cache.complete(entry, result, request.size(result) if request.size is not None else 0)
        entry.future.set_result(result)

    def _record(
        self,
        request: Request,
        outcome: Outcome,
        wall: float,
        arrived: float,
        entry: Entry | None,
        *,
        result: Any = None,
        error: BaseException | None = None,
        size: Any = None,
        clock: tuple[float, float] | None = None,
    ) -> None:
        if not self.config.metrics:
            self._metrics.count(outcome)
            return
        now, finished = (time.monotonic(), time.time()) if clock is None else clock
        job = entry.job if entry is not None else None
        # Only a request whose own job ran owns its timings; one that joined shares them.
        own = job if job is not None and outcome is not Outcome.JOINED else None
        details = entry.details if entry is not None and entry.details is not None and own is not None else {}
        if result is not None:
            size = getattr(result, "size", None)
        record = JobRecord.make(
            key=request.key,
            name=request.name,
            backend=request.backend,
            target=request.target,
            outcome=outcome,
            error=None if error is None else f"{type(error).__name__}: {error}",
            queued_at=wall,
            started_at=None if own is None or own.started_at is None else finished - (now - own.started_at),
            finished_at=finished,
            queue_wait=own.queue_wait if own is not None else None,
            run_time=own.run_time if own is not None else None,
            load_time=entry.load_time if entry is not None and outcome is not Outcome.JOINED else None,
            total_time=now - arrived,
            stages=details.get("stages", ()),
            compiler_cache_hit=details.get("compiler_cache_hit"),
            attempts=own.attempts if own is not None else 0,
            worker_pid=job.worker_pid if job is not None else None,
            worker_rss=(own.worker_rss or None) if own is not None else None,
            artifact_size=size if isinstance(size, int) else None,
        )
        self._metrics.finish(record)
        self._events.emit(record)

    def execute_sync(self, request: Request, timeout: float | None) -> cf.Future[Any]:
        """``admit`` and ``result`` for a caller outside any event loop (Inductor's synchronous
        compile path): the same cache, single flight, retries and timeouts, answered
        through a ``concurrent.futures.Future``.

        Each request is recorded exactly once: when it is answered, in the thread that
        answers it (at once for a cache hit; the pool's supervisor thread for a job), or
        when the caller cancels the future, which counts as a cancelled await: a queued
        job nobody else waits for is dropped, a started one runs on (or is killed, with
        ``cancel_running="kill"``). Raises ``SchedulerClosed`` at once when closed.
        """
        admitted = self.admit(request, timeout)
        how, found, wall, arrived = admitted
        answer: cf.Future[Any] = cf.Future()
        if how is Found.HIT:
            answer.set_result(found)
            return answer
        if how is Found.ERROR:
            answer.set_exception(found)
            return answer
        entry: Entry = found

        def on_cancelled(done: cf.Future[Any]) -> None:
            if done.cancelled():
                self._cache.leave(entry, self._stop_abandoned)
                self._record(request, Outcome.CANCELLED, wall, arrived, entry)

        def on_finished(job_done: cf.Future[Any]) -> None:
            # Either this or on_cancelled records the request: once ``answer`` is running
            # it can no longer be cancelled, and once cancelled it cannot run.
            if not answer.set_running_or_notify_cancel():
                return
            self._cache.leave(entry)
            if job_done.cancelled():  # withdrawn with nobody waiting: not expected here
                self._record(request, Outcome.CANCELLED, wall, arrived, entry)
                answer.set_exception(cf.CancelledError())
                return
            exc = job_done.exception()
            if exc is not None:
                outcome = _failure_outcome(exc) if how is Found.STARTED else Outcome.JOINED
                self._record(request, outcome, wall, arrived, entry, error=exc)
                answer.set_exception(exc)
                return
            result = job_done.result()
            self._record(request, _success_outcome(how, entry), wall, arrived, entry, result=result)
            answer.set_result(result)

        # Once: each closure holds what holds the future it is a callback of.
        answer.add_done_callback(bridge.Once(on_cancelled))
        entry.future.add_done_callback(bridge.Once(on_finished))
        return answer


def _failure_outcome(exc: BaseException) -> Outcome:
    """The outcome of a request whose own job raised ``exc``. (A cancelled await is told
    apart where it is caught, by its event loop's own cancellation class.)"""
    if isinstance(exc, JobTimeout):
        return Outcome.TIMEOUT
    if isinstance(exc, WorkerCrashed):
        return Outcome.CRASHED
    if isinstance(exc, SchedulerClosed):
        return Outcome.CLOSED
    if isinstance(exc, cf.CancelledError):
        return Outcome.CANCELLED
    return Outcome.ERROR


def _success_outcome(how: Found, entry: Entry) -> Outcome:
    """The outcome of a request whose job (or cache read) succeeded."""
    return Outcome.JOINED if how is Found.JOINED else entry.source
