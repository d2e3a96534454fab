"""The values aiocompile gives to read about what it did: plain, frozen, comparable, and
``to_dict()``-able to JSON.

- :class:`JobRecord`: what one request cost and how it ended (its :class:`Outcome`);
- :class:`WorkerEvent`: what a worker did, as the pool saw it;
- :class:`BenchmarkRecord`: one configuration of an ``autotune()`` call, timed or not;
- :class:`Statistics` (with :class:`Summary` values): ``Scheduler.statistics()``, a
  snapshot of the counters at that moment.

The event log, the ``aiocompile`` logger, listeners and the Prometheus collector all read
these same values.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

__all__ = [
    "BENCHMARK_OUTCOMES",
    "BUCKETS",
    "BenchmarkOutcome",
    "BenchmarkRecord",
    "FAILED",
    "FAILURES",
    "JobRecord",
    "OUTCOMES",
    "Outcome",
    "Statistics",
    "Summary",
    "WorkerEvent",
]


class _Named(str, enum.Enum):
    """An enum whose members are their strings: equal to them, hashed as them, printed
    and written to JSON as them, so that records, log lines and Prometheus labels say
    ``compiled``, not ``Outcome.COMPILED``."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return str.__format__(str(self.value), spec)

    __hash__ = str.__hash__


class Outcome(_Named):
    """What a request ended as: exactly one of these each."""

    COMPILED = "compiled"
    """Its own job ran in a worker and succeeded."""
    CACHE_HIT = "cache_hit"
    """Answered from the memory cache."""
    DISK_HIT = "disk_hit"
    """Answered from the disk cache (``cache_dir``)."""
    SHARED_HIT = "shared_hit"
    """Answered from the shared cache (``cache_url``)."""
    JOINED = "joined"
    """Shared a job, or a cache read, that another request started (whatever that job's
    fate: the record's ``error`` says if it failed)."""
    ERROR_HIT = "error_hit"
    """Answered with a compile error remembered from a moment ago."""
    ERROR = "error"
    """Its own job raised: the kernel did not compile, a ``run()`` function raised, or
    its result could not be read back."""
    CRASHED = "crashed"
    """Its own job killed ``max_crashes`` workers (``WorkerCrashed``)."""
    TIMEOUT = "timeout"
    """Its own job ran past its timeout (``JobTimeout``)."""
    CLOSED = "closed"
    """The scheduler was closed before its job finished (``SchedulerClosed``)."""
    CANCELLED = "cancelled"
    """The caller stopped waiting."""

    @property
    def failed(self) -> bool:
        """A job of the request's own failed (what ``Statistics.failed`` adds up)."""
        return self in FAILED


FAILED = frozenset({Outcome.ERROR, Outcome.CRASHED, Outcome.TIMEOUT, Outcome.CLOSED})
"""The outcomes of a request whose own job failed."""
OUTCOMES = tuple(outcome.value for outcome in Outcome)
FAILURES = tuple(outcome.value for outcome in Outcome if outcome.failed)
"""The outcomes that ``Statistics.failed`` adds up."""


class BenchmarkOutcome(_Named):
    """What timing one configuration ended as (``BenchmarkRecord.outcome``)."""

    OK = "ok"
    """Timed: its median and quantiles."""
    COMPILE_ERROR = "compile_error"
    """It did not compile (or its compile timed out, or crashed its worker)."""
    ERROR = "error"
    """It raised in the benchmark process (out of resources, a bad launch)."""
    FAULT = "fault"
    """It left the device unusable (an illegal address); the process was replaced."""
    CRASHED = "crashed"
    """It killed the benchmark process, which was replaced."""
    TIMEOUT = "timeout"
    """It ran past ``benchmark_timeout``; the process was killed and replaced."""
    START_FAILED = "start_failed"
    """No benchmark process could be started for it."""
    CLOSED = "closed"
    """The scheduler was closed first."""


BENCHMARK_OUTCOMES = tuple(outcome.value for outcome in BenchmarkOutcome)

# Histogram bounds in seconds, for the Prometheus collector: from a warm cache hit in a
# worker to a pathological compile (minutes).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)



@dataclass(frozen=True)
class JobRecord:
    """What one request cost and how it ended.

    Durations are in seconds; ``*_at`` times are wall-clock (``time.time()``). Fields that
    did not happen are None: a cache hit has no queue wait, a queued job that was
    cancelled never started.
    """

    event: ClassVar[str] = "request"

    key: str | None
    name: str
    """The kernel's (or function's) name."""
    backend: str
    target: str | None
    outcome: Outcome
    error: str | None
    """``"ExceptionType: message"`` when the request raised."""
    queued_at: float
    """When the request arrived."""
    started_at: float | None
    """When a worker first started its job."""
    finished_at: float
    """When the request was answered."""
    queue_wait: float | None
    """From the job's submission until a worker started it."""
    run_time: float | None
    """Measured in the worker, around the job itself (its last attempt)."""
    load_time: float | None
    """In the parent: turning the worker's answer (or the disk cache's bytes) into the result."""
    total_time: float
    """From the request's arrival to its answer, as the caller saw it."""
    stages: tuple[tuple[str, float], ...] = ()
    """The compiler's own stage times, in order, where it reports them: for Triton
    ``make_ir``, ``ttir``, ``ttgir``, ``llir``, ``ptx``/``amdgcn``, ``cubin``/``hsaco``,
    ``store``."""
    compiler_cache_hit: bool | None = None
    """The compiler found the kernel in its own on-disk cache in the worker (Triton's
    cache): a "compile" that cost a lookup."""
    attempts: int = 0
    """Workers the job was started in (more than 1 after crashes)."""
    worker_pid: int | None = None
    worker_rss: int | None = None
    """Resident memory of the worker after the job, in bytes."""
    artifact_size: int | None = None
    """Bytes of the compiled kernel (binary, metadata and IR)."""

    @classmethod
    def make(cls, *, key: str | None, name: str, backend: str, target: str | None, outcome: Outcome,
             error: str | None, queued_at: float, started_at: float | None, finished_at: float,
             queue_wait: float | None, run_time: float | None, load_time: float | None, total_time: float,
             stages: tuple[tuple[str, float], ...] = (), compiler_cache_hit: bool | None = None,
             attempts: int = 0, worker_pid: int | None = None, worker_rss: int | None = None,
             artifact_size: int | None = None) -> JobRecord:
        """The same record as ``JobRecord(...)``, made for a fraction of its cost: aiocompile
        makes one for every request, and a frozen dataclass's ``__init__`` sets each field
        through ``object.__setattr__``. The same fields, typed the same, so a type checker
        checks every call; a test keeps this signature and the fields in step."""
        record = object.__new__(cls)
        record.__dict__.update(
            key=key, name=name, backend=backend, target=target, outcome=outcome, error=error, queued_at=queued_at,
            started_at=started_at, finished_at=finished_at, queue_wait=queue_wait, run_time=run_time,
            load_time=load_time, total_time=total_time, stages=stages, compiler_cache_hit=compiler_cache_hit,
            attempts=attempts, worker_pid=worker_pid, worker_rss=worker_rss, artifact_size=artifact_size)
        return record

    @property
    def stage_times(self) -> dict[str, float]:
        return dict(self.stages)

    def to_dict(self) -> dict[str, Any]:
        # Field by field: ``dataclasses.asdict`` deep-copies, several times slower, and
        # this runs once per request when a sink is on.
        data = {name: getattr(self, name) for name in _RECORD_FIELDS}
        data["outcome"] = str(self.outcome)
        data["stages"] = dict(self.stages)
        return data


@dataclass(frozen=True)
class WorkerEvent:
    """Something a worker did, as the pool saw it.

    ``event`` is one of

    - ``"worker_started"``: a worker is ready for jobs;
    - ``"worker_exited"``: ``status`` says why: ``crashed``, ``timeout`` (killed for a job
      past its timeout), ``killed`` (for a cancelled job, or at close), ``recycled`` (past
      ``max_worker_rss``), ``idle`` (past ``idle_timeout``), ``shutdown``, or
      ``start_failed``;
    - ``"job_started"``: an attempt at a job started in worker ``pid``;
    - ``"job_ended"``: that attempt ended; ``status`` is ``ok``, ``error``, ``crashed``,
      ``timeout``, ``cancelled``, ``closed`` or ``lost`` (its worker went away for a reason
      not its own; it is retried and not counted against it). ``started_at`` says when
      the attempt started.

    ``time`` and ``started_at`` are wall-clock (``time.time()``).
    """

    event: str
    time: float
    pid: int | None
    job_id: int | None = None
    name: str | None = None
    key: str | None = None
    attempt: int = 0
    status: str | None = None
    started_at: float | None = None
    exitcode: int | None = None
    warm_up: bool = False
    """The job was a warm-up (``Scheduler.warm()``), not a caller's."""

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _EVENT_FIELDS}


@dataclass(frozen=True)
class BenchmarkRecord:
    """One configuration of an ``autotune()`` call: timed in a benchmark process, or why
    it could not be (its time is then infinite, as Triton's autotuner counts it).

    ``time_ms``, ``p20_ms`` and ``p80_ms`` are what Triton's benchmarker measured (the
    median and the 20th and 80th percentiles, in milliseconds); ``reason`` says why a
    configuration failed. ``attempt`` counts the processes it was sent to (2 when the
    first was lost before it could time it). Times are wall-clock (``time.time()``).
    """

    event: ClassVar[str] = "benchmark"

    name: str
    """The kernel's."""
    config: str
    """The configuration, as a person reads it: ``BLOCK=128, num_warps=4, ...``."""
    outcome: BenchmarkOutcome
    time_ms: float | None
    p20_ms: float | None
    p80_ms: float | None
    reason: str | None
    device: int | None
    device_name: str | None
    attempt: int
    pid: int | None
    """The benchmark process's."""
    started_at: float
    finished_at: float
    key: str | None = None
    """The compiled configuration's key (Triton's hash), when it compiled."""
    round: str | None = None
    """``"short"`` (the short timing that ranks configurations, see
    ``SchedulerConfig.tuning_screen``), ``"full"`` (timed as the autotuner times), or None
    (never timed: it did not compile)."""

    @property
    def duration(self) -> float:
        return self.finished_at - self.started_at

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in _BENCHMARK_FIELDS}
        data["outcome"] = str(self.outcome)
        return data


_BENCHMARK_FIELDS = tuple(f.name for f in fields(BenchmarkRecord))
_RECORD_FIELDS = tuple(f.name for f in fields(JobRecord))
_EVENT_FIELDS = tuple(f.name for f in fields(WorkerEvent))


@dataclass(frozen=True)
class Summary:
    """count, p50, p95, max and total of a duration, in seconds."""

    count: int = 0
    p50: float = 0.0
    p95: float = 0.0
    max: float = 0.0
    total: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Statistics:
    """A frozen snapshot of a scheduler's counters. ``to_dict()`` is JSON-ready.

    Counting is exact: every submitted request is either ``in_flight`` or counted in
    exactly one of ``outcomes`` (``sum(outcomes.values()) + in_flight == submitted``).
    """

    submitted: int = 0
    """Requests."""
    compiled: int = 0
    """Requests whose own job ran in a worker and succeeded."""
    cache_hits: int = 0
    disk_hits: int = 0
    shared_hits: int = 0
    """Requests answered from the shared cache (``cache_url``)."""
    joined: int = 0
    """Requests that shared a job another request started."""
    error_hits: int = 0
    failed: int = 0
    """Requests whose own job failed: compile error, timeout, crash beyond
    ``max_crashes``, or the scheduler closed under it."""
    cancelled: int = 0
    in_flight: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    """Requests by outcome (see ``OUTCOMES``)."""
    cache_entries: int = 0
    """Results in the memory cache now, and the bytes they hold."""
    cache_bytes: int = 0
    cache_evictions: int = 0
    disk_access: str = "none"
    """What the scheduler may do with ``cache_dir``: "read-write", "read-only" (not
    writable here), "signed-only" (not trusted, read for entries signed with
    ``cache_key``), "refused" (not trusted: neither read nor written), or "none" (no
    ``cache_dir``)."""
    disk_writes: int = 0
    disk_evictions: int = 0
    disk_corrupt: int = 0
    """Files of the disk cache that did not decode: never loaded, recompiled, and deleted
    where the directory is writable."""
    disk_refused: int = 0
    """Files of the disk cache not trusted, never loaded, recompiled: owned by another
    user, writable by group or others, not a regular file, larger than
    ``cache_dir_entry_bytes``, or, with ``cache_key``, not signed with it."""
    disk_errors: int = 0
    """Reads and writes of the disk cache that failed (permission, I/O, a full disk): a
    read that failed is a miss, a write that failed leaves the kernel out of the directory."""
    shared_state: str = "none"
    """The shared cache (``cache_url``): "closed" (in use), "open" (failing, left alone
    for now: every read a miss, every write dropped), "half-open" (one call trying it
    again), or "none" (no ``cache_url``)."""
    shared_misses: int = 0
    shared_writes: int = 0
    shared_errors: int = 0
    """Reads and writes of the shared cache that failed (server down, slow, refusing): a
    read that failed is a miss, a write that failed leaves the kernel unshared."""
    shared_skipped: int = 0
    """Reads and writes not attempted: the server was left alone after failing, the entry
    was larger than ``cache_url_entry_bytes``, or too many reads or writes were queued;
    and reads answered a miss before the server answered them, when it was found failing."""
    shared_corrupt: int = 0
    """Entries of the shared cache that did not decode: never loaded, recompiled."""
    shared_refused: int = 0
    """Entries of the shared cache not trusted, never loaded, recompiled: with
    ``cache_key``, not signed with it; or another type of value (a list, a hash) under an
    entry's name."""
    shared_opened: int = 0
    """How many times the shared cache was found failing and left alone."""
    worker_crashes: int = 0
    """Worker processes that died unasked."""
    retries: int = 0
    """Jobs started again after their worker died."""
    timeouts: int = 0
    """Jobs stopped at their timeout."""
    workers_started: int = 0
    workers_recycled: int = 0
    """Workers replaced because their memory grew past ``max_worker_rss``."""
    workers_idle_stopped: int = 0
    """Workers stopped after ``idle_timeout`` without work."""
    workers: int = 0
    busy_workers: int = 0
    queue_depth: int = 0
    """Jobs waiting for a worker now."""
    queue_depth_max: int = 0
    queue_wait: Summary = field(default_factory=Summary)
    """Of jobs that ran (compiled or failed): submission to a worker starting them."""
    run_time: Summary = field(default_factory=Summary)
    """Of jobs that ran, measured in the worker."""
    load_time: Summary = field(default_factory=Summary)
    """Worker's answer (or disk bytes) to result, in the parent."""
    total_time: Summary = field(default_factory=Summary)
    """Of every answered request: arrival to answer, as callers saw it."""
    stages: dict[str, Summary] = field(default_factory=dict)
    """The compiler's stage times, by stage."""
    slowest: tuple[tuple[str, str | None, float], ...] = ()
    """The slowest compiles: (kernel name, target, run time), slowest first."""
    tunings: int = 0
    """``autotune()`` calls answered with a configuration (tuned, or from a decision)."""
    tuned: int = 0
    """Of those, the ones that benchmarked configurations (the others found a decision,
    or had one configuration left)."""
    tuning_hits: int = 0
    """``autotune()`` calls answered by a decision kept in memory or in ``cache_dir``."""
    tuning_failures: int = 0
    """``autotune()`` calls that failed: every configuration failed, or the scheduler
    closed under them."""
    benchmarks: int = 0
    """Timings of configurations, short and full (or given up on: see
    ``benchmark_outcomes``)."""
    benchmark_outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BENCHMARK_OUTCOMES, 0))
    """Those timings by outcome (see ``BENCHMARK_OUTCOMES``)."""
    benchmarks_left_out: int = 0
    """Configurations left out after their short timing, not timed in full (see
    ``SchedulerConfig.tuning_screen``)."""
    benchmark_processes_started: int = 0
    benchmark_processes_lost: int = 0
    """Benchmark processes that died unasked: a crash, a fault, a hang, a failed start."""
    benchmark_time: Summary = field(default_factory=Summary)
    """Of configurations sent to a benchmark process: from sending to the answer."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["slowest"] = [list(item) for item in self.slowest]
        return data


