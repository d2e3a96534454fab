"""Timing records and the scheduler's statistics snapshot.

Every request ends in exactly one outcome and yields one frozen :class:`JobRecord`;
``Scheduler.statistics()`` returns a frozen :class:`Statistics` built from the counters at
that moment. Both are plain values: compare them, keep them, ``to_dict()`` them to JSON.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["JobRecord", "Statistics", "Summary", "OUTCOMES"]

# What a request can end as. "compiled": its own job ran and succeeded; "cache_hit":
# answered from memory; "disk_hit": answered from the disk cache; "joined": shared a job
# (or disk read) another request started; "error_hit": answered with a compile error
# remembered from a moment ago; "failed": its own job ended in an error (compile error,
# timeout, crash beyond max_crashes, closed); "cancelled": the caller stopped waiting.
OUTCOMES = ("compiled", "cache_hit", "disk_hit", "joined", "error_hit", "failed", "cancelled")

_SAMPLES = 10_000


@dataclass(frozen=True)
class JobRecord:
    """What one request cost and how it ended. Times are in seconds."""

    key: str | None
    name: str
    backend: str
    target: str | None
    outcome: str
    error: str | None
    submitted_at: float
    """Wall-clock time (``time.time()``) the request arrived."""
    queue_wait: float | None
    """From submission until a worker started the job (None if it never ran)."""
    run_time: float | None
    """Measured in the worker, around the job itself."""
    load_time: float | None
    """In the parent: turning the worker's answer into the result."""
    total_time: float
    """From the request's arrival to its answer, as the caller saw it."""
    attempts: int
    worker_pid: int | None
    result_size: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    """A frozen snapshot of a scheduler's counters. ``to_dict()`` is JSON-ready."""

    submitted: int = 0
    compiled: int = 0
    cache_hits: int = 0
    disk_hits: int = 0
    joined: int = 0
    error_hits: int = 0
    failed: int = 0
    cancelled: int = 0
    in_flight: int = 0
    cache_entries: int = 0
    """Results in the memory cache now, and the bytes they hold."""
    cache_bytes: int = 0
    cache_evictions: int = 0
    disk_writes: int = 0
    disk_evictions: int = 0
    disk_corrupt: int = 0
    """Files of the disk cache that did not decode, deleted and recompiled."""
    worker_crashes: int = 0
    retries: int = 0
    timeouts: int = 0
    workers_started: int = 0
    workers_recycled: int = 0
    """Workers replaced because their memory grew past ``max_worker_rss``."""
    workers_idle_stopped: int = 0
    """Workers stopped after ``idle_timeout`` without work."""
    workers: int = 0
    busy_workers: int = 0
    queue_depth: int = 0
    queue_depth_max: int = 0
    queue_wait: Summary = field(default_factory=Summary)
    run_time: Summary = field(default_factory=Summary)
    slowest: tuple[tuple[str, str | None, float], ...] = ()
    """The slowest compiles: (kernel name, target, run time), slowest first."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["slowest"] = [list(item) for item in self.slowest]
        return data


class _Durations:
    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.samples: collections.deque[float] = collections.deque(maxlen=_SAMPLES)

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.max = max(self.max, value)
        self.samples.append(value)

    def summary(self) -> Summary:
        if not self.count:
            return Summary()
        ordered = sorted(self.samples)

        def pct(p: float) -> float:
            return ordered[min(len(ordered) - 1, int(round(p * (len(ordered) - 1))))]

        return Summary(self.count, pct(0.50), pct(0.95), self.max, self.total)


class Metrics:
    """Counters behind ``statistics()``; written from event loops and the supervisor."""

    def __init__(self, keep_records: int = 1000) -> None:
        self._lock = threading.Lock()
        self.submitted = 0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.queue_wait = _Durations()
        self.run_time = _Durations()
        self.slowest: list[tuple[float, str, str | None]] = []
        self.records: collections.deque[JobRecord] = collections.deque(maxlen=keep_records)

    def submit(self) -> None:
        with self._lock:
            self.submitted += 1

    def finish(self, record: JobRecord) -> None:
        with self._lock:
            self.outcomes[record.outcome] += 1
            self.records.append(record)
            if record.outcome in ("compiled", "failed"):
                if record.queue_wait is not None:
                    self.queue_wait.add(record.queue_wait)
                if record.run_time is not None:
                    self.run_time.add(record.run_time)
                    if record.outcome == "compiled":
                        self.slowest.append((record.run_time, record.name, record.target))
                        self.slowest.sort(reverse=True)
                        del self.slowest[10:]

    def snapshot(self, pool: dict[str, int]) -> Statistics:
        with self._lock:
            done = sum(self.outcomes.values())
            return Statistics(
                submitted=self.submitted,
                compiled=self.outcomes["compiled"],
                cache_hits=self.outcomes["cache_hit"],
                disk_hits=self.outcomes["disk_hit"],
                joined=self.outcomes["joined"],
                error_hits=self.outcomes["error_hit"],
                failed=self.outcomes["failed"],
                cancelled=self.outcomes["cancelled"],
                in_flight=self.submitted - done,
                queue_wait=self.queue_wait.summary(),
                run_time=self.run_time.summary(),
                slowest=tuple((name, target, t) for t, name, target in self.slowest),
                **pool,
            )
