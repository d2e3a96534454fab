"""Prometheus metrics for a scheduler (needs ``prometheus-client``).

::

    from prometheus_client import REGISTRY
    from aiocompile.prometheus import SchedulerCollector

    REGISTRY.register(SchedulerCollector())      # the default scheduler
    REGISTRY.register(SchedulerCollector(sched, labels={"pool": "serving"}))

The collector reads the scheduler when it is scraped, so it costs nothing between scrapes
and always agrees with ``statistics()``: counters and gauges from the snapshot, histograms
from the scheduler's own buckets (``records.BUCKETS``), every duration in seconds. Each
metric is declared once, with its help text, in :meth:`SchedulerCollector.collect`;
docs/metrics.md lists them for users.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from aiocompile.records import BENCHMARK_OUTCOMES, BUCKETS, OUTCOMES

if TYPE_CHECKING:
    from aiocompile._core.scheduler import Scheduler

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.registry import Collector as _Collector
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "aiocompile.prometheus needs prometheus-client: pip install 'aiocompile[prometheus]'"
    ) from exc

__all__ = ["SchedulerCollector"]


def _bounds() -> list[str]:
    return [repr(float(bound)) for bound in BUCKETS] + ["+Inf"]


class SchedulerCollector(_Collector):
    """A Prometheus collector of one scheduler's metrics (the default scheduler's if
    ``scheduler`` is None, found anew at each scrape), with ``labels`` added to every
    sample."""

    def __init__(self, scheduler: Scheduler | None = None, *, labels: Mapping[str, str] | None = None) -> None:
        self._scheduler = scheduler
        self._labels = dict(labels or {})
        for name in self._labels:
            if name in ("backend", "stage", "outcome", "le"):
                raise ValueError(f"label {name!r} is used by aiocompile's own metrics")

    def describe(self) -> list[Any]:
        # Without describe(), registering would scrape once to learn the names; with an
        # empty list, registering costs nothing and the names are not checked for clashes.
        return []

    def _target(self) -> Scheduler:
        if self._scheduler is not None:
            return self._scheduler
        from aiocompile._core.default import default_scheduler

        return default_scheduler()

    def collect(self) -> Iterator[Any]:
        scheduler = self._target()
        stats = scheduler.statistics()
        histograms = scheduler.port.histograms()
        names = list(self._labels)
        values = list(self._labels.values())
        bounds = _bounds()

        def histogram(name: str, doc: str, label: str | None,
                      series: Mapping[str, tuple[list[int], float]]) -> HistogramMetricFamily:
            family = HistogramMetricFamily(name, doc, labels=names + ([label] if label else []), unit="seconds")
            for value, (cumulative, total) in sorted(series.items()):
                family.add_metric(values + ([value] if label else []), list(zip(bounds, cumulative)), total)
            return family

        yield histogram("aiocompile_compile_seconds", "Run time in a worker of jobs that ran.", "backend",
                        histograms.compile_seconds)
        yield histogram("aiocompile_compile_stage_seconds", "Time in each stage of the compiler.", "stage",
                        histograms.stage_seconds)
        yield histogram("aiocompile_queue_wait_seconds", "Time from submission to a worker starting the job.",
                        None, {"": histograms.queue_wait_seconds})

        requests = CounterMetricFamily("aiocompile_requests", "Answered requests, by outcome.",
                                       labels=names + ["outcome"])
        for outcome in OUTCOMES:
            requests.add_metric(values + [outcome], stats.outcomes[outcome])
        yield requests

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("aiocompile_requests_in_flight", "Requests not answered yet.", stats.in_flight)
        yield gauge("aiocompile_queue_depth", "Jobs waiting for a worker now.", stats.queue_depth)
        yield gauge("aiocompile_queue_depth_max", "The most jobs that waited for a worker at once.",
                    stats.queue_depth_max)
        yield gauge("aiocompile_workers", "Worker processes now.", stats.workers)
        yield gauge("aiocompile_busy_workers", "Worker processes running a job now.", stats.busy_workers)
        yield counter("aiocompile_worker_crashes", "Worker processes that died unasked.", stats.worker_crashes)
        yield counter("aiocompile_job_retries", "Jobs started again after their worker died.", stats.retries)
        yield counter("aiocompile_job_timeouts", "Jobs stopped at their timeout.", stats.timeouts)
        yield counter("aiocompile_workers_started", "Worker processes started.", stats.workers_started)
        yield gauge("aiocompile_cache_entries", "Compiled results in the memory cache.", stats.cache_entries)
        yield gauge("aiocompile_cache_bytes", "Bytes of compiled results in the memory cache.", stats.cache_bytes)
        yield counter("aiocompile_cache_evictions", "Results dropped from the memory cache.", stats.cache_evictions)

        yield counter("aiocompile_tunings", "autotune() calls answered with a configuration.", stats.tunings)
        yield counter("aiocompile_tunings_benchmarked", "autotune() calls that benchmarked configurations.",
                      stats.tuned)
        yield counter("aiocompile_tuning_hits", "autotune() calls answered by a decision kept.", stats.tuning_hits)
        yield counter("aiocompile_tuning_failures", "autotune() calls that failed.", stats.tuning_failures)
        benchmarks = CounterMetricFamily("aiocompile_benchmarks", "Configurations benchmarked, by outcome.",
                                         labels=names + ["outcome"])
        for outcome in BENCHMARK_OUTCOMES:
            benchmarks.add_metric(values + [outcome], stats.benchmark_outcomes[outcome])
        yield benchmarks
        yield counter("aiocompile_benchmarks_left_out",
                      "Configurations left out after their short timing, not timed in full.",
                      stats.benchmarks_left_out)
        yield histogram("aiocompile_benchmark_seconds", "Time of one configuration in a benchmark process.", None,
                        {"": histograms.benchmark_seconds})
        yield counter("aiocompile_benchmark_processes_started", "Benchmark processes started.",
                      stats.benchmark_processes_started)
        yield counter("aiocompile_benchmark_processes_lost", "Benchmark processes that died unasked.",
                      stats.benchmark_processes_lost)
        yield counter("aiocompile_shared_cache_errors", "Reads and writes of the shared cache that failed.",
                      stats.shared_errors)
        yield counter("aiocompile_shared_cache_skipped", "Reads and writes of the shared cache not attempted.",
                      stats.shared_skipped)
        yield counter("aiocompile_shared_cache_refused", "Entries of the shared cache not trusted or not decoding.",
                      stats.shared_refused + stats.shared_corrupt)
        yield gauge("aiocompile_shared_cache_open", "1 while the shared cache is left alone after failing.",
                    1 if stats.shared_state in ("open", "half-open") else 0)
