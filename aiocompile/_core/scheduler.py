"""``Scheduler``: the async front door.

A request goes through four steps, in this order:

1. the backend checks the arguments and builds a :class:`~aiocompile.backends.Request`
   with its key (bad input raises here, before any worker is involved);
2. the cache answers it, joins it to the job already compiling that key, or starts a job;
3. the caller waits for the job without blocking its event loop (asyncio, uvloop or trio);
4. the outcome is recorded.

The scheduler is the face; its :class:`~aiocompile._core.engine.Engine` builds and owns
the parts (pool, caches, request path, metrics, backends), and the coroutines here check
their arguments and hand over to it, to the batch (``compile_many``), to the JIT helpers
(``warmup``, ``inductor_triton``) or to the tuner (``autotune``).

Not tied to an event loop: one scheduler (the default one in particular) serves several
``asyncio.run()`` calls in a row, trio, and loops in several threads at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

import anyio

from aiocompile._base import checks, threads
from aiocompile._base.config import SchedulerConfig
from aiocompile._core import jit
from aiocompile._core.batch import compile_batch
from aiocompile._core.engine import Engine
from aiocompile._core.waiting import wait_many
from aiocompile._foreign.executors import ExecutorSpec
from aiocompile._observe.events import Listener
from aiocompile._tuning.tuner import AutotuneResult
from aiocompile.backends import Request
from aiocompile.backends.cpp import NativeLibrary
from aiocompile.backends.cuda import CudaBinary
from aiocompile.backends.triton._kernel import TritonKernel
from aiocompile.records import JobRecord, Statistics


class Scheduler:
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
    cache and ``cache_dir`` (see ``_cache.shared``): a kernel any machine compiled is
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
        self._engine = Engine(self.config, executor=executor, on_event=on_event)
        # Made inside a running loop (the default scheduler always is): warm anyio now.
        self._async_preloaded = threads.preload_for_current_loop()

    @property
    def port(self) -> Engine:
        """What aiocompile's own integrations (``aiocompile.torch``, the Prometheus
        collector, the tuner) use of this scheduler: its engine, through a few public
        methods. Not for applications: its methods may change between releases."""
        return self._engine

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Scheduler:
        # Let the fork server load the compiler while the caller gets on with its own
        # start-up; workers still start on demand.
        self._engine.start_pool()
        if not self._async_preloaded:
            self._async_preloaded = threads.preload_for_current_loop()
        self._engine.start_benchmark_if_asked()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._engine.closed

    async def aclose(self, grace: float | None = None) -> None:
        """Stop accepting work and shut the pool down.

        Queued jobs fail with ``SchedulerClosed``; running jobs get ``grace`` seconds
        (default ``config.close_grace``) to finish, then their workers are killed and their
        callers get ``SchedulerClosed``. Returns once every worker process has exited.
        A ``grace`` that is not a finite number of seconds >= 0 raises ``TypeError`` or
        ``ValueError`` at once, and closes nothing.
        """
        checks.CLOSE_GRACE.check("grace", grace)
        if self._engine.closed:
            return
        await anyio.to_thread.run_sync(lambda: self.close(grace))

    def close(self, grace: float | None = None) -> None:
        """Blocking counterpart of :meth:`aclose`, for code outside an event loop."""
        checks.CLOSE_GRACE.check("grace", grace)
        self._engine.close(self.config.close_grace if grace is None else grace)

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
        if not isinstance(benchmark, bool):
            raise TypeError(f"benchmark must be True or False, got {benchmark!r}")
        await self._engine.warm(target, benchmark)

    # -- introspection ----------------------------------------------------------------------

    def statistics(self) -> Statistics:
        """A frozen snapshot of what this scheduler has done (see ``Statistics``)."""
        return self._engine.statistics()

    def records(self) -> list[JobRecord]:
        """The timing records of the most recent requests (up to 1000), oldest first."""
        return self._engine.records()

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
        return self._engine.subscribe(listener)

    def worker_pids(self) -> list[int]:
        return self._engine.worker_pids()

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
        kernel does not compile (the pool is unaffected), ``JobTimeout`` if it takes
        longer than ``timeout`` seconds of worker time (its worker is killed, no other), and
        ``WorkerCrashed`` if it killed ``max_crashes`` workers.

        Concurrent requests for the same kernel share one compile; a compiled kernel is
        kept in memory and returned at once the next time. Cancelling the await does not
        stop a compile that already started (its result is kept for the next caller),
        nor one that other callers are waiting for; a queued compile nobody waits for any
        more is dropped.
        """
        return await self._engine.compile_triton(kernel, signature=signature, constexprs=constexprs, target=target,
                                                 timeout=timeout, attrs=attrs, **options)

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
        ``JobTimeout`` past ``timeout`` seconds of worker time, ``WorkerCrashed``
        after ``max_crashes`` worker deaths: either way the worker is killed with every
        compiler process it started, no other. Single flight, caches and cancellation are
        ``compile_triton``'s; with ``cancel_running="kill"`` a cancelled compile nobody
        waits for dies with its compiler.
        """
        checks.CALL_TIMEOUT.check("timeout", timeout)
        request = await self._engine.cpp.prepare(self._engine, timeout=timeout, source=source, flags=flags,
                                                 include_dirs=include_dirs, libraries=libraries, compiler=compiler,
                                                 name=name)
        result: NativeLibrary = await self._engine.execute(request, timeout)
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
        request = await self._engine.cuda.prepare(self._engine, timeout=timeout, source=source, arch=arch,
                                                  output=output, flags=flags, include_dirs=include_dirs,
                                                  compiler=compiler, name=name)
        result: CudaBinary = await self._engine.execute(request, timeout)
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
        return await compile_batch(self._engine, specs, progress=progress, return_exceptions=return_exceptions)

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
        return await wait_many(awaitables, lambda total: self._engine.progress(total, progress), return_exceptions)

    async def run(
        self, fn: Callable[..., Any], *args: Any, key: str | None = None, timeout: float | None = None
    ) -> Any:
        """Run ``fn(*args)`` in a worker process and return its result.

        ``fn`` and ``args`` must pickle (functions by reference; one defined in
        ``__main__`` needs cloudpickle), or ``TypeError`` is raised at once. An exception
        ``fn`` raises is re-raised here with the worker's traceback as its ``__cause__``.
        The same pool and the same semantics as compiles: ``timeout`` seconds of worker
        time, then ``JobTimeout`` (its worker is killed); ``WorkerCrashed`` after
        ``max_crashes`` worker deaths. With a ``key``, concurrent calls with that key share
        one run and the result is remembered. Cancelling the await drops the job if it has
        not started; a started one runs to its end. ``fn`` that is not callable, or a bad
        ``timeout``, raises ``TypeError``/``ValueError`` at once, counted nowhere.
        """
        checks.check_callable("fn", fn)
        checks.CALL_TIMEOUT.check("timeout", timeout)
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        request = Request(backend="python", key=key, name=name, target=None, fn=fn, args=args, finish=None,
                          direct=True, subject="function")
        return await self._engine.requests.execute_now(request, timeout)

    async def warmup(
        self,
        kernel: Any,
        *args: Any,
        grid: Any = None,
        target: Any = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> TritonKernel:
        """Compile, in the pool, what Triton's JIT would compile for
        ``kernel[grid](*args, **kwargs)``, and prime the JIT so that the next ordinary
        launch with such arguments compiles nothing.

        ``args`` are example arguments: tensors (or anything with ``data_ptr()`` and
        ``dtype``; a torch dtype stands for a tensor of that type), integers,
        floats; ``kwargs`` the constexprs and options the launch passes. The
        specialisation is Triton's own: argument types, divisibility by 16, integers equal
        to 1, constexprs and options (see ``aiocompile.backends.triton._warmup``). ``grid``
        is accepted so that a launch can be copied as it is; it plays no part in the
        compile.

        With ``target=None`` the kernel is compiled for the current device and put into
        its JIT cache, binary loaded and launcher built (in a thread). With an explicit
        target (``"cuda:90"``...) nothing is primed: that is for building ahead on a
        machine that will not launch. Returns the ``TritonKernel``.

        Errors, timeouts and crashes are those of ``compile_triton``; a kernel wrapped by
        ``triton.autotune``/``heuristics`` raises ``TypeError``. Cancelling the await while
        the compile runs lets it finish (and be cached) and primes nothing.
        """
        return await jit.warmup(self._engine, kernel, args, kwargs, grid=grid, target=target, timeout=timeout)

    async def autotune(
        self,
        kernel: Any,
        *args: Any,
        grid: Any = None,
        device: int | None = None,
        timeout: float | None = None,
        progress: bool = False,
        **kwargs: Any,
    ) -> AutotuneResult:
        """Tune a ``@triton.autotune`` kernel for ``kernel[grid](*args, **kwargs)`` without
        stalling: every configuration compiled in the pool, each timed in a benchmark
        process (one per GPU, never this process), and Triton primed with the choice, so
        that the ordinary launch with such arguments neither compiles nor benchmarks.

        ``args`` and ``kwargs`` are what the launch passes (real tensors: their shapes,
        strides and values are copied to the benchmark process), ``grid`` its grid (a tuple
        or a callable, as for the launch). The key, the pruning (``prune_configs_by``) and
        each configuration's specialisation are Triton's own, and configurations are timed
        as Triton's autotuner times them (its ``do_bench``, ``reset_to_zero``,
        ``restore_value`` and hooks), so the choice is the one Triton would make on this
        machine. ``device`` tunes for that GPU, timed on it; None tunes for the current
        device, timed on any visible GPU of the same model (a batch of calls spreads over
        them). ``progress=True`` shows a bar over the compiles and the timings.

        The decision is kept (in memory, and in ``cache_dir`` when there is one) by the
        kernel, the autotuner's key, the device model and Triton's version: a later call,
        here or in a restarted process, tunes nothing. Returns an ``AutotuneResult``.

        Errors: a kernel without ``@triton.autotune`` raises ``TypeError`` (use
        ``warmup()``); arguments that do not bind raise what ``warmup()`` raises; no GPU
        for the device raises ``RuntimeError``, at once, before anything compiles. A
        configuration that does not compile (within ``timeout`` seconds of worker time),
        runs out of resources, faults the GPU, crashes its benchmark process or runs past
        ``benchmark_timeout`` counts as infinitely slow, with its reason in its
        ``BenchmarkRecord``; a process it brought down is replaced and the others go on.
        If every configuration fails, ``AutotuneError`` lists each one and why.

        Concurrent calls with the same decision key share one tuning. Cancelling the await
        leaves a started tuning running (its decision is kept for the next call) and
        primes nothing.
        """
        return await self._engine.tuner().autotune(kernel, args, kwargs, grid=grid, device=device, timeout=timeout,
                                                   progress=progress)

    async def inductor_triton(
        self, kernel_name: str, source_code: str, *, device_str: str = "cuda", timeout: float | None = None
    ) -> Any:
        """Compile a kernel that PyTorch Inductor generated, and return the kernel object
        Inductor expects: what ``async_compile.triton(kernel_name, source_code,
        device_str=...)`` in Inductor's output code yields (a ``CachingAutotuner``, its
        launchers built).

        ``source_code`` is the kernel's whole module source, ``kernel_name`` the kernel it
        defines. A wrong type raises ``TypeError`` at once; a source that does not parse,
        defines no such kernel, or was generated for another device than ``device_str``
        raises ``ValueError`` before any worker is involved.

        The worker does what Inductor's own compile workers do (every autotuning
        configuration through Triton); this process then builds the launchers, in a
        thread. Concurrent requests for one source share one compile, keyed as Inductor
        keys it (the source and ``torch_key()``). ``CompileError`` if it does not compile
        (the worker's traceback as its cause), ``JobTimeout`` past ``timeout``
        seconds of worker time (its worker is killed, no other), ``WorkerCrashed``
        after ``max_crashes`` worker deaths; a death before that is retried on a fresh
        worker. Cancelling the await lets a started compile finish, kept for the next
        caller. Needs torch; a worker imports it on its first such job, unless the fork
        server preloads it (``aiocompile.torch.PRELOAD`` in ``config.preload``).
        """
        return await jit.inductor_triton(self._engine, kernel_name, source_code, device_str=device_str,
                                         timeout=timeout)
