"""The counters and summaries behind ``Scheduler.statistics()``: written from event loops,
the pool's supervisor and tuning threads, read as frozen values (``aiocompile.records``)."""

from __future__ import annotations

import bisect
import collections
import threading
from dataclasses import dataclass
from typing import Any, Callable

from aiocompile.records import (
    BENCHMARK_OUTCOMES,
    BUCKETS,
    FAILED,
    OUTCOMES,
    BenchmarkRecord,
    JobRecord,
    Outcome,
    Statistics,
    Summary,
)

_SAMPLES = 10_000
_SLOWEST = 10


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
        # Whether a ``scheduled_drain`` is on its way (a loop's callback, not yet run).
        self._drain_scheduled = False

    def later(self, bookkeeping: Callable[[], None]) -> bool:
        """Keep ``bookkeeping`` (a record's making, counting and emitting) for ``drain``;
        returns whether the caller is to schedule :meth:`scheduled_drain` (none is on its
        way). Every read of these metrics drains first, so nothing kept here is ever
        missing from what they say. A drain scheduled on a loop that stopped before
        running it leaves the records waiting; past ``_LATER_MAX`` of them they are made
        here and now, so that they never pile up."""
        later = self._later
        later.append(bookkeeping)
        if len(later) > _LATER_MAX:
            self.drain()
            return False
        if self._drain_scheduled:
            return False
        self._drain_scheduled = True
        return True

    def scheduled_drain(self) -> None:
        """``drain``, as the callback that ``later`` asked for."""
        self._drain_scheduled = False
        self.drain()

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

    def benchmarks(self) -> list[BenchmarkRecord]:
        with self._lock:
            return list(self.benchmark_records)

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

    def count(self, outcome: Outcome) -> None:
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
            if record.outcome is not Outcome.COMPILED and record.outcome not in FAILED:
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
            if record.outcome is Outcome.COMPILED and (
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
                failed=sum(count for name, count in outcomes.items() if Outcome(name).failed),
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
