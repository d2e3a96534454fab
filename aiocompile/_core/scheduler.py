"""Scheduler: the async front door.

A request goes through four steps, in this order:

1. the backend checks the arguments and builds a :class:`~aiocompile.backends.Request`
   with its key (bad input raises here, before any worker is involved);
2. the cache answers it, joins it to the job already compiling that key, or starts a job;
3. the caller waits for the job without blocking its event loop (asyncio, uvloop or trio);
4. the outcome is recorded.

The scheduler is not tied to an event loop: its pool is driven by a thread, its cache and
counters are thread-safe, and each await bridges to whichever loop is running. So one
scheduler (the default one in particular) serves several ``asyncio.run()`` calls in a row,
trio, and loops in several threads at once.

Its coroutines for Triton's JIT and PyTorch Inductor (``warmup``, ``autotune``,
``inductor_triton``) are in ``_jit``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

import anyio

from aiocompile._base import bridge, checks, threads
from aiocompile._base.frozen import build
from aiocompile._base.target import parse_target
from aiocompile._cache.disk import DiskCache
from aiocompile._cache.memory import KernelCache
from aiocompile._cache.shared import SharedCache
from aiocompile._core.admission import Gates
from aiocompile._core.batch import compile_batch
from aiocompile._core.config import SchedulerConfig
from aiocompile._core.costs import CostHistory
from aiocompile._core.jit import JitHooks
from aiocompile._core.requests import Requests
from aiocompile._core.waiting import wait_many
from aiocompile._foreign.executors import ExecutorSpec
from aiocompile._foreign.pool import ForeignPool
from aiocompile._observe.events import EventHub, Listener
from aiocompile._observe.progress import Progress
from aiocompile._pool.pool import WorkerPool
from aiocompile._tuning.tuner import Tuner
from aiocompile.backends import Request, SpecBackend
from aiocompile.backends.cpp import CppBackend, NativeLibrary
from aiocompile.backends.cuda import CudaBackend, CudaBinary
from aiocompile.backends.triton import TritonBackend
from aiocompile.backends.triton._kernel import TritonKernel
from aiocompile.errors import SchedulerClosed
from aiocompile.records import JobRecord, Metrics, Statistics


class _Context:
    """What backends may ask of the scheduler (see ``BackendContext``)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    async def run_in_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        # The backend's own errand, not a caller's request: the pool's crash handling, but
        # no record and no count in the caller's statistics.
        self._scheduler._check_open()
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        job = self._scheduler._pool.submit_job(fn, args, name=name)
        return await bridge.wait(job.future)

    async def to_thread(self, fn: Callable[[], Any]) -> Any:
        return await threads.KEYS.run(fn)


class Scheduler(JitHooks):
    """Compiles kernels in a supervised pool of worker processes, from async code.

    ``Scheduler(workers=8, timeout=120, max_crashes=2)``, or ``Scheduler(config=...)``.
    Use it as ``async with Scheduler() as sched:``, or create it and call ``aclose()``
    when done. Workers start on demand, or all at once with ``await sched.warm()``.

    Every request leaves a :class:`JobRecord` (``records()``) and counts in
    ``statistics()``. Records and the pool's :class:`WorkerEvent` values are logged to the
    ``aiocompile`` logger, appended to ``event_log`` (a JSON-lines file) if given, and
    passed to ``on_event`` and to listeners added with ``subscribe()``.
    ``config.metrics=False`` keeps only the counters.

    ``executor=`` runs jobs in any ``concurrent.futures.Executor`` instead of aiocompile's
    own pool: an executor, or a factory making one (needed to rebuild a broken one, except
    for a stdlib ``ProcessPoolExecutor``, whose settings are copied). A broken process pool
    is rebuilt and its lost jobs re-run so that no innocent job fails (see ``_foreign``);
    such an executor cannot stop a running job, so timeouts and ``cancel_running="kill"``
    only stop the waiting there. A Dask ``distributed.Client`` (or
    ``aiocompile.dask.executor(client)``) runs jobs on a cluster with this pool's crash,
    timeout and kill semantics (see ``aiocompile.dask``).

    ``cache_url="redis://host:6379/0"`` adds a cache shared by a fleet behind the memory
    cache and ``cache_dir`` (see ``_shared_cache``): a kernel any machine compiled is
    read from there rather than compiled again.
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        timeout: float | None = None,
        max_crashes: int | None = None,
        start_method: str | None = None,
        cancel_running: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_url: str | None = None,
        event_log: str | os.PathLike[str] | None = None,
        on_event: Listener | None = None,
        config: SchedulerConfig | None = None,
        executor: ExecutorSpec | None = None,
    ) -> None:
        if config is not None and not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig or None, got {config!r} ({type(config).__name__})")
        base = config or SchedulerConfig()
        # The configuration checks each of these (and turns paths into str).
        self.config = base.with_changes(
            workers=workers, timeout=timeout, max_crashes=max_crashes, start_method=start_method,
            cancel_running=cancel_running, cache_dir=cache_dir, cache_url=cache_url, event_log=event_log,
        )
        if on_event is not None:
            checks.check_callable("on_event", on_event)
        self._pool: WorkerPool | ForeignPool
        if executor is not None:
            self._pool = ForeignPool(executor, max_crashes=self.config.max_crashes)
        else:
            self._pool = WorkerPool(
                self.config.workers,
                start_method=self.config.start_method,
                preload=self.config.preload,
                max_crashes=self.config.max_crashes,
                max_worker_rss=self.config.max_worker_rss,
                idle_timeout=self.config.idle_timeout,
                worker_nice=self.config.worker_nice,
            )
        self._cache = KernelCache(self.config.cache_entries, self.config.cache_bytes, self.config.error_ttl)
        self._disk = None if self.config.cache_dir is None else DiskCache(
            self.config.cache_dir, self.config.cache_dir_bytes, self.config.cache_key)
        self._shared = None if self.config.cache_url is None else SharedCache(
            self.config.cache_url, ttl=self.config.cache_url_ttl, max_entry=self.config.cache_url_entry_bytes,
            timeout=self.config.cache_url_timeout, retry_after=self.config.cache_url_retry,
            secret=self.config.cache_key)
        self._metrics = Metrics()
        self._events = EventHub(event_log=self.config.event_log if self.config.metrics else None,
                                on_event=on_event)
        if self.config.metrics:
            self._pool.on_event = self._events.emit
            self._pool.job_events_wanted = self._events.job_events_wanted
        history, history_read_only = self.config.cost_history, False
        if history is None and self._disk is not None and self._disk.trusted:
            # Beside the kernels, under the same rules: read only from a trusted directory,
            # written only where the kernels are.
            history = os.path.join(self._disk.directory, "costs.json")
            history_read_only = self._disk.access != "read-write"
        self._costs = CostHistory(history, read_only=history_read_only, fleet=self._shared)
        self._context = _Context(self)
        self._gates = Gates()
        self._requests = Requests(self.config, pool=self._pool, cache=self._cache, disk=self._disk,
                                  shared=self._shared, metrics=self._metrics, events=self._events, costs=self._costs,
                                  check_open=self._check_open)
        self._triton = TritonBackend()
        self._tuner: Tuner | None = None
        self._tuner_lock = threading.Lock()
        self._cpp = CppBackend()
        self._cuda = CudaBackend()
        # compile_many's specs name their backend by their "kind".
        self._backends: dict[str, SpecBackend] = {"triton": self._triton, "cpp": self._cpp, "cuda": self._cuda}
        self._pid = os.getpid()
        self._closed = False
        # Made inside a running loop (the default scheduler always is): warm anyio now.
        self._async_preloaded = threads.preload_for_current_loop()

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Scheduler:
        self._check_open()
        # Let the fork server load the compiler while the caller gets on with its own
        # start-up; workers still start on demand.
        self._pool.start()
        if not self._async_preloaded:
            self._async_preloaded = threads.preload_for_current_loop()
        self._start_benchmark_if_asked()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _start_benchmark_if_asked(self) -> None:
        """With ``benchmark_at_start``: the benchmark processes start now, in the
        background (asking torch for the devices may take seconds)."""
        if self.config.benchmark_at_start and not self.closed:
            self._tuning().start_soon()

    @property
    def closed(self) -> bool:
        return self._closed or self._pid != os.getpid() or self._pool.closed

    async def aclose(self, grace: float | None = None) -> None:
        """Stop accepting work and shut the pool down.

        Queued jobs fail with ``SchedulerClosed``; running jobs get ``grace`` seconds
        (default ``config.close_grace``) to finish, then their workers are killed and their
        callers get ``SchedulerClosed``. Returns once every worker process has exited.
        A ``grace`` that is not a finite number of seconds >= 0 raises ``TypeError`` or
        ``ValueError`` at once, and closes nothing.
        """
        checks.CLOSE_GRACE.check("grace", grace)
        if self._closed:
            return
        await anyio.to_thread.run_sync(lambda: self.close(grace))

    def close(self, grace: float | None = None) -> None:
        """Blocking counterpart of :meth:`aclose`, for code outside an event loop."""
        checks.CLOSE_GRACE.check("grace", grace)
        self._closed = True
        grace = self.config.close_grace if grace is None else grace
        tuner = self._tuner
        if tuner is not None and self._pid == os.getpid():
            tuner.close()  # before the pool: a tuning waiting on compiles then ends with them
        self._pool.shutdown(wait=True, cancel_futures=True, grace=grace)
        if self._disk is not None:
            self._disk.close(wait=True)  # results compiled before the close reach the disk
        if self._pid == os.getpid():
            self._costs.save()  # before the shared cache lets its connections go
        if self._shared is not None:
            self._shared.close(wait=True)  # and the shared cache (each write bounded by its timeout)
        self._metrics.drain()
        self._events.close()  # after the pool: its last worker events reach the file

    def _check_open(self) -> None:
        # A pool is closed in a forked child (aiocompile's own by a fork hook, a foreign
        # one by its pid): only then is it worth asking whose scheduler this is.
        if not (self._closed or self._pool.closed):
            return
        if self._pid != os.getpid():
            raise SchedulerClosed("this scheduler belongs to the parent of a forked process; create a new one here")
        raise SchedulerClosed("the scheduler is closed")

    async def warm(self, target: Any = "cuda:90", *, benchmark: bool = False) -> None:
        """Start every worker now and run one tiny compile in each, so that the compiler's
        per-process set-up is paid before the first real job; meanwhile, pay this process's
        own first-key cost for ``target`` (hashing Triton, asking ptxas its version) and,
        where this machine has a GPU of ``target``'s kind, its one-time cost of loading
        kernels (Triton's GPU driver, the device's context; see ``prime_loading``).

        With ``benchmark=True``, also start the benchmark processes ``autotune()`` times
        configurations in (one per device), without waiting for them to be ready.

        Cancelling the await leaves the workers starting; they serve later jobs.
        """
        self._check_open()
        if not isinstance(benchmark, bool):
            raise TypeError(f"benchmark must be True or False, got {benchmark!r}")
        if benchmark:
            await self._tuning().warm()
        parsed = parse_target(target) or parse_target("cuda:90")
        assert parsed is not None
        from aiocompile.backends.triton import _kernel as _triton_kernel
        from aiocompile.backends.triton import _worker as _triton_worker

        keys = threads.KEYS.submit(lambda: self._triton.warm_keys(parsed))
        loading = threads.LOADS.submit(lambda: _triton_kernel.prime_loading(parsed.backend))
        jobs = self._pool.warm(_triton_worker.warm_up, ((parsed.backend, parsed.arch, parsed.warp_size),))
        for job in jobs:
            await bridge.wait(job.future)
        await bridge.wait(keys)
        await bridge.wait(loading)

    # -- introspection ----------------------------------------------------------------------

    def statistics(self) -> Statistics:
        """A frozen snapshot of what this scheduler has done (see ``Statistics``)."""
        counters = self._pool.counters
        pool = self._pool.snapshot()
        disk = self._disk
        shared = self._shared
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
            **(self._tuner.counters() if self._tuner is not None else {}),
        })

    def records(self) -> list[JobRecord]:
        """The timing records of the most recent requests (up to 1000), oldest first."""
        return self._metrics.recent()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event)`` with every ``JobRecord``, ``WorkerEvent`` and
        ``BenchmarkRecord`` from now on; returns a function that stops it.

        The listener runs in the thread where the event happened (an event loop's thread
        for records, the pool's supervisor thread for worker events, a tuning's thread for
        benchmark records), so it must be quick
        and thread-safe; to reach an event loop, use its ``call_soon_threadsafe``. An
        exception it raises is logged once and otherwise ignored. Nothing is reported when
        ``config.metrics`` is off.
        """
        self._metrics.drain()  # records made before now are not its to see
        return self._events.subscribe(listener)

    def worker_pids(self) -> list[int]:
        return self._pool.worker_pids()

    # -- the public coroutines ------------------------------------------------------------------

    async def compile_triton(
        self,
        kernel: Any,
        *,
        signature: Mapping[str, Any],
        constexprs: Mapping[str, Any] | None = None,
        target: Any = None,
        timeout: float | None = None,
        attrs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> TritonKernel:
        """Compile a Triton kernel in a worker process and return a ``TritonKernel``.

        ``kernel`` is a ``@triton.jit`` function (importable, or defined in ``__main__`` or
        a notebook cell) or an ``aiocompile.TritonSource``. ``signature`` maps each runtime
        argument to its Triton type ("*fp32", "i32", ...), ``constexprs`` each constexpr
        argument to its value. ``target`` is "cuda:90", "hip:gfx942", a ``GPUTarget`` or
        None for the current GPU. Other keywords are Triton compile options (num_warps,
        num_stages, ...); ``attrs`` maps arguments to specialisation hints such as
        ``[("tt.divisibility", 16)]``.

        Raises ``ValueError``/``TypeError`` at once for bad input, ``CompileError`` if the
        kernel does not compile (the pool is unaffected), ``CompileTimeout`` if it takes
        longer than ``timeout`` seconds of worker time (its worker is killed, no other), and
        ``WorkerCrashedError`` if it killed ``max_crashes`` workers.

        Concurrent requests for the same kernel share one compile; a compiled kernel is
        kept in memory and returned at once the next time. Cancelling the await does not
        stop a compile that already started (its result is kept for the next caller),
        nor one that other callers are waiting for; a queued compile nobody waits for any
        more is dropped.
        """
        checks.CALL_TIMEOUT.check("timeout", timeout)
        request = await self._triton.prepare(
            self._context, kernel, signature=signature, constexprs=constexprs, target=target,
            attrs=attrs, options=options,
        )
        result: TritonKernel = await self._execute(request, timeout)
        return result

    async def compile_cpp(
        self,
        source: str,
        *,
        flags: Sequence[str] = (),
        include_dirs: Sequence[str | os.PathLike[str]] = (),
        libraries: Sequence[str] = (),
        compiler: str | os.PathLike[str] | None = None,
        name: str | None = None,
        timeout: float | None = None,
    ) -> NativeLibrary:
        """Build a shared library from C++ ``source`` in a worker process; returns a
        ``NativeLibrary`` (``lib.symbol("f")`` calls ``f`` through ctypes).

        ``flags`` go to the compiler as they are, ``include_dirs`` as ``-I``, ``libraries``
        are names (``"m"``: ``-lm``) or files; ``compiler`` is a path or a name on PATH
        (default: ``c++``, ``g++`` or ``clang++``). The key covers them, the compiler's
        identity and version, and the headers the source reads from its include
        directories (an edited header compiles anew).

        ``TypeError``/``ValueError`` for bad arguments and ``CompilerNotFound`` at once,
        before any worker; ``CompileError`` with the diagnostics and command line;
        ``CompileTimeout`` past ``timeout`` seconds of worker time, ``WorkerCrashedError``
        after ``max_crashes`` worker deaths: either way the worker is killed with every
        compiler process it started, no other. Single flight, caches and cancellation are
        ``compile_triton``'s; with ``cancel_running="kill"`` a cancelled compile nobody
        waits for dies with its compiler.
        """
        checks.CALL_TIMEOUT.check("timeout", timeout)
        request = await self._cpp.prepare(self._context, source=source, flags=flags, include_dirs=include_dirs,
                                          libraries=libraries, compiler=compiler, name=name)
        result: NativeLibrary = await self._execute(request, timeout)
        return result

    async def compile_cuda(
        self,
        source: str,
        *,
        arch: str | Sequence[str] = "sm_90",
        output: str = "cubin",
        flags: Sequence[str] = (),
        include_dirs: Sequence[str | os.PathLike[str]] = (),
        compiler: str | os.PathLike[str] | None = None,
        name: str | None = None,
        timeout: float | None = None,
    ) -> CudaBinary:
        """Compile CUDA ``source`` with nvcc in a worker process (no GPU needed); returns a
        ``CudaBinary``. On a GPU, ``await binary.load()``, then
        ``binary.kernel("name")[grid, block](*args)``.

        ``arch``: one architecture or several (``("sm_80", "sm_90")``, ``"compute_90"``
        for PTX); ``output``: ``"cubin"`` or ``"ptx"`` (one per architecture),
        ``"fatbin"``, or ``"shared"`` (a host library). AMD architectures (``"gfx942"``)
        compile with hipcc into a code object (``"hsaco"``) or a shared library.
        ``compiler``: default nvcc from ``CUDA_HOME``, ``CUDA_PATH``, PATH or
        ``/usr/local/cuda``. The record's stages are nvcc's own phase times. Errors,
        timeouts, crashes, caching and cancellation are ``compile_cpp``'s.
        """
        checks.CALL_TIMEOUT.check("timeout", timeout)
        request = await self._cuda.prepare(self._context, source=source, arch=arch, output=output, flags=flags,
                                           include_dirs=include_dirs, compiler=compiler, name=name)
        result: CudaBinary = await self._execute(request, timeout)
        return result

    async def compile_many(
        self,
        specs: Iterable[Mapping[str, Any]],
        *,
        progress: bool = False,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Compile many kernels concurrently; results in the order of ``specs``.

        Each spec is a mapping of ``compile_triton``'s keyword arguments with the kernel
        under ``"kernel"``; or, with ``"kind": "cpp"`` or ``"kind": "cuda"``, of
        ``compile_cpp``'s or ``compile_cuda``'s, the source under ``"source"``. With
        ``return_exceptions`` a failed compile's exception takes its place in the list;
        otherwise the first failure is raised once the compiles that already started have
        been let go (they finish in the background and are cached). ``progress=True``
        shows a progress bar, naming the kernels being compiled, on a terminal or in a
        notebook (nowhere else).
        """
        return await compile_batch(self, specs, progress=progress, return_exceptions=return_exceptions)

    async def wait(
        self,
        awaitables: Any,
        *,
        progress: bool = False,
        return_exceptions: bool = False,
    ) -> Any:
        """Wait for many compiles at once: coroutines, tasks or futures
        (``asyncio``/``concurrent.futures``, and PyTorch Inductor's compile futures, whose
        blocking ``result()`` runs in a thread), awaited concurrently.

        Given a mutable mapping, such as a module's ``globals()``, each value that is
        awaitable is replaced in place by its result and the mapping is returned; other
        values (a kernel already compiled, say) are left alone. Given an iterable, the list
        of results is returned in its order. ``progress=True`` shows a progress bar, as
        ``compile_many`` does.

        The first failure is raised once the others have been let go (cancelled; a compile
        that already started finishes in the background and is cached), unless
        ``return_exceptions`` puts exceptions in place of results. Cancelling ``wait()``
        cancels the waiting, with the same rule for started compiles.
        """
        return await wait_many(awaitables, lambda total: self._progress(total, progress), return_exceptions)

    def _progress(self, total: int, enabled: bool, description: str = "compiling") -> Progress:
        return Progress(total, enabled=enabled, description=description,
                        subscribe=self.subscribe if self.config.metrics else None)

    async def run(
        self, fn: Callable[..., Any], *args: Any, key: str | None = None, timeout: float | None = None
    ) -> Any:
        """Run ``fn(*args)`` in a worker process and return its result.

        ``fn`` and ``args`` must pickle (functions by reference; one defined in
        ``__main__`` needs cloudpickle), or ``TypeError`` is raised at once. An exception
        ``fn`` raises is re-raised here with the worker's traceback as its ``__cause__``.
        The same pool and the same semantics as compiles: ``timeout`` seconds of worker
        time, then ``CompileTimeout`` (its worker is killed); ``WorkerCrashedError`` after
        ``max_crashes`` worker deaths. With a ``key``, concurrent calls with that key share
        one run and the result is remembered. Cancelling the await drops the job if it has
        not started; a started one runs to its end. ``fn`` that is not callable, or a bad
        ``timeout``, raises ``TypeError``/``ValueError`` at once, counted nowhere.
        """
        checks.check_callable("fn", fn)
        checks.CALL_TIMEOUT.check("timeout", timeout)
        # Its turn first (see _admission): in a burst, most requests wait here, and what
        # they have not built yet costs the loop nothing now.
        if not self._gates.enter_now():
            await self._gates.enter()
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        request = build(Request, {"backend": "python", "key": key, "name": name, "target": None, "fn": fn,
                                  "args": args, "finish": None, "encode": None, "decode": None, "size": None,
                                  "details": None, "direct": True, "features": ()})
        admitted = self._requests.admit(request, timeout)
        result = await self._requests.result(request, admitted)
        if admitted[0] in ("started", "joined"):
            self._gates.waited()  # it waited for its job: the loop has gone round (see _admission)
        return result

    # -- the request path ---------------------------------------------------------------------

    async def _execute(self, request: Request, timeout: float | None) -> Any:
        # A burst of requests is admitted a loop iteration's slice at a time (see
        # _admission); one waiting its turn has not been counted or started yet.
        await self._gates.enter()
        admitted = self._requests.admit(request, timeout)
        result = await self._requests.result(request, admitted)
        if admitted[0] in ("started", "joined"):
            self._gates.waited()  # it waited for its job: the loop has gone round (see _admission)
        return result
