"""A job's record, why a job is stopped, the pool's counters, and the events a pool
reports.

Shared by aiocompile's own pool and the pool over a foreign executor (``_foreign``): a job
is the same thing in both, whoever runs it.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import logging
import pickle
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from aiocompile._pool import serialize
from aiocompile._pool.procs import job_env
from aiocompile.errors import JobTimeout, SchedulerClosed, WorkerCrashed
from aiocompile.records import WorkerEvent

logger = logging.getLogger("aiocompile")


class Stop(enum.Enum):
    """Why a job is stopped on purpose, and the worker holding it killed."""

    TIMEOUT = "timeout"
    """It ran past its timeout: ``JobTimeout``."""
    CANCELLED = "cancelled"
    """Nobody waits for it any more (``cancel_running="kill"``): ``CancelledError``."""
    CLOSED = "closed"
    """The scheduler closed while it ran, and the grace period is over: ``SchedulerClosed``."""
    UNDELIVERED = "undelivered"
    """It could not be sent: its worker had died. It never ran there, and runs again."""


@dataclass(eq=False, slots=True)
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
    definition: serialize.Definition | None = None
    """The definition of a __main__ function the payload names by digest (sent to a worker
    only once; see ``serialize``)."""
    buffers: tuple[pickle.PickleBuffer, ...] = ()
    """Large values the payload's pickle carries out of band (``serialize.out_of_band``),
    sent beside it."""
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
    look: Callable[[], None] | None = None
    """A look for the answer, left by a job sent from an event loop that reads the answer
    itself (``loop_reads.LoopReads.linger``): taken once, by :meth:`look_for_answer`."""
    # Whether ``future`` was moved out of PENDING by ``mark_running`` (see there).
    _marked: bool = field(default=False, init=False, repr=False)
    _mark_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def queue_wait(self) -> float | None:
        if self.started_at is None:
            return None
        return self.started_at - self.submitted_at

    # -- its outcome (in whichever thread decides it) -------------------------------------

    def succeed(self, result: Any) -> None:
        """Its result; a future already done (cancelled, failed at shutdown) keeps its own.
        Two threads may settle one job at once (its answer, and its timeout or the pool
        closing): the first one wins, and the other is no error."""
        if self._may_finish():
            try:
                self.future.set_result(result)
            except cf.InvalidStateError:
                pass

    def fail(self, exc: BaseException) -> None:
        if self._may_finish():
            try:
                self.future.set_exception(exc)
            except cf.InvalidStateError:
                pass

    def _may_finish(self) -> bool:
        if self.finished_at is None:
            self.finished_at = time.monotonic()
        # A queued job never started is RUNNING once it has an outcome.
        return self.mark_running()

    def look_for_answer(self) -> None:
        """In the event loop that sent the job: look for its answer now, for a few tens of
        microseconds at most, and settle the job if it came (once; later calls do nothing)."""
        look, self.look = self.look, None
        if look is not None:
            look()

    def mark_running(self) -> bool:
        """Move the future from PENDING to RUNNING, once in the job's life: whether the job
        may run (or take its outcome) now. False once it is cancelled or has its outcome.

        ``Future.set_running_or_notify_cancel()`` logs at CRITICAL (before raising) when
        the future is RUNNING or FINISHED already, as a retried job's, or one that timed out
        before its worker's answer came, is. So it is called exactly once, by whichever
        thread gets here first; the future is then PENDING or CANCELLED, since everything
        that finishes it comes through here, and cancelling is all that others do to it."""
        with self._mark_lock:
            if not self._marked:
                self._marked = True
                return self.future.set_running_or_notify_cancel()
        return self.future.running()

    def stopped_error(self, stop: Stop) -> BaseException:
        """What it fails with when stopped on purpose, other than by its timeout."""
        if stop is Stop.CANCELLED:
            return cf.CancelledError()
        if stop is Stop.CLOSED and self.started_at is not None:
            return SchedulerClosed("the scheduler was closed while the job ran")
        return SchedulerClosed("the scheduler was closed before the job started")

    def after_death(self, stop: Stop | None, exitcode: int | None, tail: str, machinery_failed: bool,
                    counters: PoolCounters) -> bool:
        """Its worker died holding it: ``stop`` says why it was killed, None if it was not
        (a crash). Fails it, or returns True: it is to run again."""
        self.last_exitcode = exitcode
        self.last_output = tail
        self.finished_at = time.monotonic()
        if stop is Stop.UNDELIVERED:
            self.attempts -= 1  # it never reached the worker
            return True
        if stop is Stop.TIMEOUT:
            counters.timeouts += 1
            self.fail(JobTimeout(f"did not finish within {self.timeout:g} s; its worker was killed",
                                     timeout=self.timeout, kernel_name=self.name, key=self.key, output=tail))
            return False
        if stop is not None:
            counters.killed += 1
            self.fail(self.stopped_error(stop))
            return False
        counters.worker_crashes += 1
        if machinery_failed:
            # The fork server died and took its workers with it: not this job's doing, so
            # it runs again without counting against it.
            counters.retries += 1
            return True
        self.crashes += 1
        if self.crashes >= self.max_crashes:
            self.fail(WorkerCrashed(
                f"killed its worker with {signal_name(exitcode)}" if self.crashes == 1 else
                f"killed its worker {times(self.crashes)}, last with {signal_name(exitcode)}",
                exitcode=exitcode, attempts=self.attempts, kernel_name=self.name, key=self.key, output=tail))
            return False
        counters.retries += 1
        return True

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
        apart: bool = False,
    ) -> Job:
        """A job for ``fn(*args, **kwargs)``, pickled now (``TypeError`` if it cannot be),
        carrying this process's job environment and import path as they are now.
        ``apart``: a function from __main__ goes as a definition beside the payload (for
        the pool's own workers, which are sent each definition once)."""
        buffers: list[pickle.PickleBuffer] = []
        if apart:
            payload, definition = serialize.dumps_apart((fn, args, kwargs or {}), buffers)
        else:
            payload, definition = serialize.dumps((fn, args, kwargs or {})), None
        return cls(
            id=job_id,
            payload=payload,
            definition=definition,
            buffers=tuple(buffers),
            future=cf.Future(),
            timeout=timeout,
            max_crashes=max_crashes,
            name=name,
            key=key,
            env=job_env(),
            sys_path=_import_path(),
            warm_only=warm_only,
        )


class _ImportPath:
    """``sys.path`` as the last job carried it: jobs share one copy while it stays the
    same, so that "unchanged" is told by identity (and the worker is sent it only then)."""

    def __init__(self) -> None:
        self._seen: list[str] = []

    def now(self) -> list[str]:
        """A copy of ``sys.path``; it must not be modified."""
        if self._seen != sys.path:
            self._seen = list(sys.path)
        return self._seen


_IMPORT_PATH = _ImportPath()


def _import_path() -> list[str]:
    return _IMPORT_PATH.now()


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


def death_statuses(stop: Stop | None, machinery_failed: bool) -> tuple[str, str]:
    """(worker_exited status, job_ended status) for a worker that died holding a job."""
    if stop is Stop.UNDELIVERED:
        return "crashed", "lost"
    if stop is Stop.TIMEOUT:
        return "timeout", "timeout"
    if stop is not None:
        return "killed", "cancelled" if stop is Stop.CANCELLED else "closed"
    return "crashed", "lost" if machinery_failed else "crashed"


def times(count: int) -> str:
    return "once" if count == 1 else f"{count} times"


def signal_name(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


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
