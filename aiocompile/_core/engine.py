"""The parts of one scheduler, built together, and what the rest of aiocompile may ask of
them.

``Scheduler`` is the face users hold; this is what it stands on. ``Engine`` builds the
pool (aiocompile's own, or one over a foreign executor), the three caches, the request
path, the admission gates, the metrics and their sinks, the cost history and the compiler
backends, and owns them for the scheduler's life. Each part gets what it needs at
construction; nobody reaches into another's attributes.

What an engine offers is its port: the batch (``compile_many``), the JIT coroutines
(``warmup``, ``inductor_triton``), the tuner, the backends (as their
``BackendContext``), the torch integration and the Prometheus collector each use a few of
its public methods, named in their own ``Protocol`` where they live outside this package.
A user's scheduler hands it out as ``Scheduler.port``.

Tied to no event loop: the pool is driven by its own thread, the caches and counters are
thread-safe, and each await bridges to whichever loop is running.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Mapping
from typing import Any, Callable

from aiocompile._base import bridge, checks, threads
from aiocompile._base.config import SchedulerConfig
from aiocompile._base.target import parse_target
from aiocompile._cache.disk import DiskCache
from aiocompile._cache.memory import KernelCache
from aiocompile._cache.provenance import other_triton
from aiocompile._cache.shared import SharedCache
from aiocompile._core.costs import CostHistory
from aiocompile._core.requests import Admitted, Requests
from aiocompile._foreign.executors import ExecutorSpec
from aiocompile._foreign.pool import ForeignPool
from aiocompile._observe.events import EventHub, Listener
from aiocompile._observe.metrics import Histograms, Metrics
from aiocompile._observe.progress import Progress
from aiocompile._pool.pool import WorkerPool
from aiocompile._tuning.tuner import Tuner
from aiocompile.backends import Request, SpecBackend
from aiocompile.backends.cpp import CppBackend
from aiocompile.backends.cuda import CudaBackend
from aiocompile.backends.triton import TritonBackend
from aiocompile.backends.triton._kernel import TritonKernel
from aiocompile.errors import SchedulerClosed
from aiocompile.records import BenchmarkRecord, JobRecord, Statistics


class Engine:
    """One scheduler's parts and their port (see the module's docstring)."""

    def __init__(self, config: SchedulerConfig, *, executor: ExecutorSpec | None = None,
                 on_event: Listener | None = None) -> None:
        self.config = config
        self._pool: WorkerPool | ForeignPool
        if executor is not None:
            self._pool = ForeignPool(executor, max_crashes=config.max_crashes)
        else:
            self._pool = WorkerPool(
                config.workers,
                start_method=config.start_method,
                preload=config.preload,
                max_crashes=config.max_crashes,
                max_worker_rss=config.max_worker_rss,
                idle_timeout=config.idle_timeout,
                worker_nice=config.worker_nice,
                worker_idle=config.worker_idle,
            )
        self._cache = KernelCache(config.cache_entries, config.cache_bytes, config.error_ttl)
        self._disk = None if config.cache_dir is None else DiskCache(
            config.cache_dir, config.cache_dir_bytes, config.cache_key, config.cache_dir_entry_bytes)
        self._shared = None if config.cache_url is None else SharedCache(
            config.cache_url, ttl=config.cache_url_ttl, max_entry=config.cache_url_entry_bytes,
            timeout=config.cache_url_timeout, retry_after=config.cache_url_retry, secret=config.cache_key)
        self._metrics = Metrics()
        self._events = EventHub(event_log=config.event_log if config.metrics else None, on_event=on_event)
        if self._disk is not None and self._disk.trusted:
            built_elsewhere = other_triton(self._disk.directory)
            if built_elsewhere is not None:
                self._events.warn(built_elsewhere)
        if config.metrics:
            self._pool.on_event = self._events.emit
            self._pool.job_events_wanted = self._events.job_events_wanted
        history, history_read_only = config.cost_history, False
        if history is None and self._disk is not None and self._disk.trusted:
            # Beside the kernels, under the same rules: read only from a trusted directory,
            # written only where the kernels are.
            history = os.path.join(self._disk.directory, "costs.json")
            history_read_only = self._disk.access != "read-write"
        self.costs = CostHistory(history, read_only=history_read_only, fleet=self._shared)
        self.requests = Requests(config, pool=self._pool, cache=self._cache, disk=self._disk,
                                 shared=self._shared, metrics=self._metrics, events=self._events, costs=self.costs,
                                 check_open=self.check_open)
        """The request path, with its admission gates: ``Scheduler.run`` awaits it directly."""
        self.triton = TritonBackend()
        self.cpp = CppBackend()
        self.cuda = CudaBackend()
        # compile_many's specs name their backend by their "kind".
        self._backends: dict[str, SpecBackend] = {"triton": self.triton, "cpp": self.cpp, "cuda": self.cuda}
        self._tuner: Tuner | None = None
        self._tuner_lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed or self._pid != os.getpid() or self._pool.closed

    def check_open(self) -> None:
        """``SchedulerClosed`` if this engine may not take work (closed, or a forked copy)."""
        # A pool is closed in a forked child (aiocompile's own by a fork hook, a foreign
        # one by its pid): only then is it worth asking whose scheduler this is.
        if not (self._closed or self._pool.closed):
            return
        if self._pid != os.getpid():
            raise SchedulerClosed("this scheduler belongs to the parent of a forked process; create a new one here")
        raise SchedulerClosed("the scheduler is closed")

    def start_pool(self) -> None:
        """Start loading the fork server (its preload) now, without waiting."""
        self.check_open()
        self._pool.start()

    def start_benchmark_if_asked(self) -> None:
        """With ``benchmark_at_start``: the benchmark processes start now, in the
        background (asking torch for the devices may take seconds)."""
        if self.config.benchmark_at_start and not self.closed:
            self.tuner().start_soon()

    def close(self, grace: float) -> None:
        """Stop everything, in the order that loses nothing (see ``Scheduler.aclose``)."""
        self._closed = True
        tuner = self._tuner
        if tuner is not None and self._pid == os.getpid():
            tuner.close()  # before the pool: a tuning waiting on compiles then ends with them
        self._pool.shutdown(wait=True, cancel_futures=True, grace=grace)
        if self._pid == os.getpid():
            self.cpp.sweep()  # the scratch directories of workers killed mid-compile
        if self._disk is not None:
            self._disk.close(wait=True)  # results compiled before the close reach the disk
        if self._pid == os.getpid():
            self.costs.save()  # before the shared cache lets its connections go
        if self._shared is not None:
            self._shared.close(wait=True)  # and the shared cache (each write bounded by its timeout)
        self._metrics.drain()
        self._events.close()  # after the pool: its last worker events reach the file

    # -- the request path ------------------------------------------------------------------------

    async def execute(self, request: Request, timeout: float | None) -> Any:
        """A prepared request's result, through the request path (``Requests.execute``)."""
        return await self.requests.execute(request, timeout)

    def admit(self, request: Request, timeout: float | None) -> Admitted:
        """Admit ``request`` now, without waiting its turn (``compile_many`` paces itself)."""
        return self.requests.admit(request, timeout)

    async def result(self, request: Request, admitted: Admitted) -> Any:
        return await self.requests.result(request, admitted)

    def execute_sync(self, request: Request, timeout: float | None) -> cf.Future[Any]:
        """The request path for a caller outside any event loop (Inductor's compile
        threads, a tuning thread), answered through a ``concurrent.futures.Future``."""
        return self.requests.execute_sync(request, timeout)

    async def compile_triton(self, kernel: Any, *, signature: Mapping[str, Any],
                             constexprs: Mapping[str, Any] | None = None, target: Any = None,
                             timeout: float | None = None, attrs: Mapping[str, Any] | None = None,
                             **options: Any) -> TritonKernel:
        """``Scheduler.compile_triton``, for the parts that compile on a caller's behalf."""
        checks.CALL_TIMEOUT.check("timeout", timeout)
        request = await self.triton.prepare(self, kernel, signature=signature, constexprs=constexprs, target=target,
                                            attrs=attrs, options=options)
        result: TritonKernel = await self.execute(request, timeout)
        return result

    def backend(self, kind: str) -> SpecBackend:
        """The backend for ``compile_many``'s specs of ``kind`` (checked: ``SPEC_KIND``)."""
        return self._backends[kind]

    # -- what backends may ask while they prepare a request (BackendContext) ----------------------

    async def run_in_worker(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
                            name: str | None = None) -> Any:
        """``fn(*args)`` in a worker, for a backend itself: the pool's crash handling and
        timeout (None: the configured one), but no record and no count in the caller's
        statistics. The job is the caller's alone, so a cancelled await kills it (or drops
        it from the queue) whatever ``cancel_running`` says."""
        self.check_open()
        name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        job = self._pool.submit_job(fn, args, name=name, timeout=self.config.timeout if timeout is None else timeout)
        try:
            return await bridge.wait(job.future)
        finally:
            if not job.future.done():
                self._pool.kill(job)

    async def to_thread(self, fn: Callable[[], Any]) -> Any:
        return await threads.KEYS.run(fn)

    # -- workers -------------------------------------------------------------------------------

    def warm_workers(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[cf.Future[Any]]:
        """Start every worker and run ``fn(*args)`` once in each not yet warmed, without
        waiting (a warm-up of one's own, such as importing torch for Inductor's kernels);
        the futures of those runs, for a caller that wants to wait."""
        self.check_open()
        return [job.future for job in self._pool.warm(fn, args)]

    async def warm(self, target: Any, benchmark: bool) -> None:
        """``Scheduler.warm``: its docstring says what it does."""
        self.check_open()
        from aiocompile.backends.triton import _kernel as triton_kernel
        from aiocompile.backends.triton import _worker as triton_worker
        from aiocompile.backends.triton._targets import check_target

        # None is the current GPU, as for a compile (a worker asks the driver); a target
        # Triton does not know is refused before any worker starts for it.
        parsed = parse_target(target) or await self.triton.current_target(self)
        await threads.KEYS.run(lambda: check_target(parsed))
        if benchmark:
            await self.tuner().warm()

        keys = threads.KEYS.submit(lambda: self.triton.warm_keys(parsed))
        loading = threads.LOADS.submit(lambda: triton_kernel.prime_loading(parsed.backend))
        jobs = self._pool.warm(triton_worker.warm_up, ((parsed.backend, parsed.arch, parsed.warp_size),))
        for job in jobs:
            await bridge.wait(job.future)
        await bridge.wait(keys)
        await bridge.wait(loading)

    def worker_pids(self) -> list[int]:
        return self._pool.worker_pids()

    # -- tuning ----------------------------------------------------------------------------------

    def tuner(self) -> Tuner:
        """The ``autotune()`` machinery, made on first use."""
        self.check_open()
        with self._tuner_lock:
            if self._tuner is None:
                self._tuner = Tuner(self)
            return self._tuner

    def count_tuning(self, what: str, count: int = 1) -> None:
        """Count an ``autotune()`` call (``answered``, ``tuned``, ``hits``, ``failures``), or
        configurations ``left_out`` after their short timing."""
        self._metrics.tuning(what, count)

    def record_benchmark(self, record: BenchmarkRecord) -> None:
        """Count one configuration's timing and report it, as a request's record is."""
        self._metrics.benchmark(record, keep=self.config.metrics)
        if self.config.metrics:
            self._events.emit(record)

    # -- what it tells ---------------------------------------------------------------------------

    def progress(self, total: int, enabled: bool, description: str = "compiling") -> Progress:
        """A progress bar over ``total`` things, naming the compiles under way."""
        return Progress(total, enabled=enabled, description=description,
                        subscribe=self.subscribe if self.config.metrics else None)

    def statistics(self) -> Statistics:
        """A frozen snapshot of what this engine has done (see ``Statistics``)."""
        counters = self._pool.counters
        pool = self._pool.snapshot()
        disk = self._disk
        shared = self._shared
        tuner = self._tuner
        return self._metrics.snapshot({
            "cache_entries": len(self._cache),
            "cache_bytes": self._cache.bytes,
            "cache_evictions": self._cache.evictions,
            "disk_access": disk.access if disk else "none",
            "disk_writes": disk.writes if disk else 0,
            "disk_evictions": disk.evictions if disk else 0,
            "disk_corrupt": disk.corrupt if disk else 0,
            "disk_refused": disk.refused if disk else 0,
            "disk_errors": disk.errors if disk else 0,
            "shared_state": shared.state if shared else "none",
            "shared_misses": shared.misses if shared else 0,
            "shared_writes": shared.writes if shared else 0,
            "shared_errors": shared.errors if shared else 0,
            "shared_skipped": shared.skipped if shared else 0,
            "shared_corrupt": shared.corrupt if shared else 0,
            "shared_refused": shared.refused if shared else 0,
            "shared_opened": shared.opened if shared else 0,
            "worker_crashes": counters.worker_crashes,
            "retries": counters.retries,
            "timeouts": counters.timeouts,
            "workers_started": counters.workers_started,
            "workers_recycled": counters.recycled,
            "workers_idle_stopped": counters.idle_stopped,
            "workers": pool["workers"],
            "busy_workers": pool["busy_workers"],
            "queue_depth": pool["queue_depth"],
            "queue_depth_max": counters.queue_depth_max,
            **(tuner.counters() if tuner is not None else {}),
        })

    def records(self) -> list[JobRecord]:
        return self._metrics.recent()

    def benchmark_records(self) -> list[BenchmarkRecord]:
        """The records of the most recent configurations timed (up to 1000), oldest first."""
        return self._metrics.benchmarks()

    def histograms(self) -> Histograms:
        """The duration histograms, for one Prometheus scrape."""
        return self._metrics.histograms()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._metrics.drain()  # records made before now are not its to see
        return self._events.subscribe(listener)
