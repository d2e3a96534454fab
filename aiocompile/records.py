"""Timing records, worker events and the scheduler's statistics snapshot.

Every request ends in exactly one outcome and yields one frozen :class:`JobRecord`; the
pool reports what its workers do as frozen :class:`WorkerEvent` values (a worker started
or exited, an attempt at a job started or ended); ``Scheduler.statistics()`` returns a
frozen :class:`Statistics` built from the counters at that moment. All three are plain
values: compare them, keep them, ``to_dict()`` them to JSON. Sinks (``_events``) and the
Prometheus collector read the same values.
"""

from __future__ import annotations

import bisect
import collections
import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, ClassVar

__all__ = ["BenchmarkRecord", "JobRecord", "Statistics", "Summary", "WorkerEvent", "OUTCOMES", "FAILURES",
           "BENCHMARK_OUTCOMES"]

# What a request can end as, exactly one each:
#   compiled     its own job ran in a worker and succeeded
#   cache_hit    answered from the memory cache
#   disk_hit     answered from the disk cache (``cache_dir``)
#   shared_hit   answered from the shared cache (``cache_url``)
#   joined       shared a job, or a disk read, that another request started (whatever
#                that job's fate: ``error`` on the record says if it failed)
#   error_hit    answered with a compile error remembered from a moment ago
#   error        its own job raised: the kernel did not compile, or a ``run()`` function
#                raised, or its result could not be read back
#   crashed      its own job killed ``max_crashes`` workers (``WorkerCrashedError``)
#   timeout      its own job ran past its timeout (``CompileTimeout``)
#   closed       the scheduler was closed before its job finished (``SchedulerClosed``)
#   cancelled    the caller stopped waiting
OUTCOMES = (
    "compiled", "cache_hit", "disk_hit", "shared_hit", "joined", "error_hit",
    "error", "crashed", "timeout", "closed", "cancelled",
)
FAILURES = ("error", "crashed", "timeout", "closed")
"""The outcomes that ``Statistics.failed`` adds up: a job of the request's own failed."""

# What one configuration's benchmark can end as (``BenchmarkRecord.outcome``):
#   ok             timed: its median and quantiles
#   compile_error  it did not compile (or its compile timed out, or crashed its worker)
#   error          it raised in the benchmark process (out of resources, a bad launch)
#   fault          it left the device unusable (an illegal address); the process was replaced
#   crashed        it killed the benchmark process; replaced
#   timeout        it ran past ``benchmark_timeout``; the process was killed and replaced
#   start_failed   no benchmark process could be started for it
#   closed         the scheduler was closed first
BENCHMARK_OUTCOMES = ("ok", "compile_error", "error", "fault", "crashed", "timeout", "start_failed", "closed")

# Histogram bounds in seconds, for the Prometheus collector: from a warm cache hit in a
# worker (well under 5 ms) to a pathological compile (minutes).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

_SAMPLES = 10_000
_SLOWEST = 10


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
    outcome: str
    """One of ``OUTCOMES``."""
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

    @property
    def stage_times(self) -> dict[str, float]:
        return dict(self.stages)

    def to_dict(self) -> dict[str, Any]:
        # Field by field: ``dataclasses.asdict`` deep-copies, several times slower, and
        # this runs once per request when a sink is on.
        data = {name: getattr(self, name) for name in _RECORD_FIELDS}
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
    outcome: str
    """One of ``BENCHMARK_OUTCOMES``."""
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
        return {name: getattr(self, name) for name in _BENCHMARK_FIELDS}


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
    user, writable by group or others, not a regular file, or, with ``cache_key``, not
    signed with it."""
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
    was larger than ``cache_url_entry_bytes``, or too many writes were queued."""
    shared_corrupt: int = 0
    """Entries of the shared cache that did not decode: never loaded, recompiled."""
    shared_refused: int = 0
    """Entries of the shared cache not trusted, never loaded, recompiled: with
    ``cache_key``, not signed with it."""
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


class _Durations:
    """A duration's count, total and max since the start, percentiles over the latest
    samples, and cumulative histogram buckets (for Prometheus)."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.samples: collections.deque[float] = collections.deque(maxlen=_SAMPLES)
        self.buckets = [0] * (len(BUCKETS) + 1)  # the last one is +Inf

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if value > self.max:
            self.max = value
        self.samples.append(value)
        self.buckets[bisect.bisect_left(BUCKETS, value)] += 1

    def summary(self) -> Summary:
        if not self.count:
            return Summary()
        ordered = sorted(self.samples)

        def pct(p: float) -> float:
            return ordered[min(len(ordered) - 1, int(round(p * (len(ordered) - 1))))]

        return Summary(self.count, pct(0.50), pct(0.95), self.max, self.total)

    def histogram(self) -> tuple[list[int], float]:
        """Cumulative counts per bucket bound (the last is +Inf), and the sum."""
        cumulative, running = [], 0
        for count in self.buckets:
            running += count
            cumulative.append(running)
        return cumulative, self.total


@dataclass
class Histograms:
    """A copy of the histograms, read under the lock, for one Prometheus scrape."""

    compile_seconds: dict[str, tuple[list[int], float]]
    """By backend."""
    queue_wait_seconds: tuple[list[int], float]
    stage_seconds: dict[str, tuple[list[int], float]]
    benchmark_seconds: tuple[list[int], float] = ([0] * (len(BUCKETS) + 1), 0.0)


# Records left for a drain, at most (see ``Metrics.later``).
_LATER_MAX = 64


class Metrics:
    """Counters behind ``statistics()``; written from event loops and the supervisor."""

    def __init__(self, keep_records: int = 1000) -> None:
        self._lock = threading.Lock()
        self.submitted = 0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.queue_wait = _Durations()
        self.run_time = _Durations()
        self.load_time = _Durations()
        self.total_time = _Durations()
        self.stages: dict[str, _Durations] = {}
        self.by_backend: dict[str, _Durations] = {}
        self.slowest: list[tuple[float, str, str | None]] = []
        self.records: collections.deque[JobRecord] = collections.deque(maxlen=keep_records)
        self.tunings = dict.fromkeys(("answered", "tuned", "hits", "failures", "left_out"), 0)
        self.benchmark_outcomes = dict.fromkeys(BENCHMARK_OUTCOMES, 0)
        self.benchmark_time = _Durations()
        self.benchmark_records: collections.deque[BenchmarkRecord] = collections.deque(maxlen=keep_records)
        # Records whose bookkeeping waits for the event loop's next turn (``later``).
        self._later: collections.deque[Callable[[], None]] = collections.deque()

    def later(self, bookkeeping: Callable[[], None]) -> bool:
        """Keep ``bookkeeping`` (a record's making, counting and emitting) for ``drain``;
        returns whether it is the first waiting, i.e. whether a drain should be scheduled.
        Every read of these metrics drains first, so nothing kept here is ever missing
        from what they say. A drain scheduled on a loop that stopped before running it
        leaves the records waiting; past ``_LATER_MAX`` of them they are made here and now,
        so that they never pile up."""
        later = self._later
        later.append(bookkeeping)
        if len(later) > _LATER_MAX:
            self.drain()
            return False
        return len(later) == 1

    def drain(self) -> None:
        """Do the bookkeeping kept by ``later``, oldest first (from any thread)."""
        later = self._later
        while later:
            try:
                bookkeeping = later.popleft()
            except IndexError:  # another thread took the last one
                return
            bookkeeping()

    def recent(self) -> list[JobRecord]:
        self.drain()
        with self._lock:
            return list(self.records)

    def tuning(self, what: str, count: int = 1) -> None:
        """Count an ``autotune()`` call: ``answered``, ``tuned``, ``hits`` or ``failures``;
        or configurations ``left_out`` after their short timing."""
        with self._lock:
            self.tunings[what] += count

    def benchmark(self, record: BenchmarkRecord, keep: bool = True) -> None:
        with self._lock:
            self.benchmark_outcomes[record.outcome] += 1
            if not keep:
                return
            self.benchmark_records.append(record)
            if record.pid is not None:
                self.benchmark_time.add(record.duration)

    def submit(self) -> None:
        with self._lock:
            self.submitted += 1

    def count(self, outcome: str) -> None:
        """Count an outcome without a record (metrics turned off)."""
        with self._lock:
            self.outcomes[outcome] += 1

    def finish(self, record: JobRecord) -> None:
        with self._lock:
            self.outcomes[record.outcome] += 1
            self.records.append(record)
            self.total_time.add(record.total_time)
            if record.load_time is not None:
                self.load_time.add(record.load_time)
            if record.outcome != "compiled" and record.outcome not in FAILURES:
                return
            if record.queue_wait is not None:
                self.queue_wait.add(record.queue_wait)
            if record.run_time is None:
                return
            self.run_time.add(record.run_time)
            backend = self.by_backend.get(record.backend)
            if backend is None:
                backend = self.by_backend[record.backend] = _Durations()
            backend.add(record.run_time)
            for stage, seconds in record.stages:
                durations = self.stages.get(stage)
                if durations is None:
                    durations = self.stages[stage] = _Durations()
                durations.add(seconds)
            if record.outcome == "compiled" and (
                len(self.slowest) < _SLOWEST or record.run_time > self.slowest[-1][0]
            ):
                self.slowest.append((record.run_time, record.name, record.target))
                self.slowest.sort(key=lambda item: item[0], reverse=True)
                del self.slowest[_SLOWEST:]

    def histograms(self) -> Histograms:
        self.drain()
        with self._lock:
            return Histograms(
                compile_seconds={name: d.histogram() for name, d in self.by_backend.items()},
                queue_wait_seconds=self.queue_wait.histogram(),
                stage_seconds={name: d.histogram() for name, d in self.stages.items()},
                benchmark_seconds=self.benchmark_time.histogram(),
            )

    def snapshot(self, pool: dict[str, Any]) -> Statistics:
        self.drain()
        with self._lock:
            outcomes = dict(self.outcomes)
            return Statistics(
                submitted=self.submitted,
                compiled=outcomes["compiled"],
                cache_hits=outcomes["cache_hit"],
                disk_hits=outcomes["disk_hit"],
                shared_hits=outcomes["shared_hit"],
                joined=outcomes["joined"],
                error_hits=outcomes["error_hit"],
                failed=sum(outcomes[name] for name in FAILURES),
                cancelled=outcomes["cancelled"],
                in_flight=self.submitted - sum(outcomes.values()),
                outcomes=outcomes,
                queue_wait=self.queue_wait.summary(),
                run_time=self.run_time.summary(),
                load_time=self.load_time.summary(),
                total_time=self.total_time.summary(),
                stages={name: d.summary() for name, d in self.stages.items()},
                slowest=tuple((name, target, t) for t, name, target in self.slowest),
                tunings=self.tunings["answered"],
                tuned=self.tunings["tuned"],
                tuning_hits=self.tunings["hits"],
                tuning_failures=self.tunings["failures"],
                benchmarks=sum(self.benchmark_outcomes.values()),
                benchmark_outcomes=dict(self.benchmark_outcomes),
                benchmarks_left_out=self.tunings["left_out"],
                benchmark_time=self.benchmark_time.summary(),
                **pool,
            )
