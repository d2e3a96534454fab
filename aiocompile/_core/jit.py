"""The scheduler's coroutines for Triton's JIT and PyTorch Inductor.

``warmup()`` and ``autotune()`` compile (and time) in the pool what Triton's JIT and
autotuner would do in the launching process, then prime them; ``inductor_triton()`` and
the synchronous helpers beside it are what ``aiocompile.torch`` plugs into Inductor. Each
ends in the scheduler's own request path (``compile_triton``, ``_execute``), so crashes,
timeouts, caching and cancellation are the same as for any compile.

A base of :class:`~aiocompile._core.scheduler.Scheduler`, which sets up the state declared here.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Callable

from aiocompile._base import checks, threads
from aiocompile._tuning.tuner import AutotuneResult, Tuner
from aiocompile.backends import Request

if TYPE_CHECKING:
    from aiocompile._core.requests import Requests
    from aiocompile._core.scheduler import _Context
    from aiocompile._foreign.pool import ForeignPool
    from aiocompile._pool.pool import WorkerPool
    from aiocompile.backends.triton._kernel import TritonKernel


class JitHooks:
    """What ``Scheduler`` does for Triton's JIT and PyTorch Inductor."""

    _pool: WorkerPool | ForeignPool
    _requests: Requests
    _context: _Context
    _tuner: Tuner | None
    _tuner_lock: threading.Lock

    _check_open: Callable[[], None]
    compile_triton: Callable[..., Awaitable[TritonKernel]]
    _execute: Callable[[Request, float | None], Awaitable[Any]]

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
        from aiocompile.backends.triton import _warmup as _triton_warmup

        checks.CALL_TIMEOUT.check("timeout", timeout)
        if grid is not None and not (callable(grid) or isinstance(grid, (tuple, list, int))):
            raise TypeError(f"grid must be a tuple of ints or a callable, as for a launch; got {grid!r}")
        self._check_open()
        plan = await threads.LOADS.run(lambda: _triton_warmup.plan(kernel, args, kwargs, target))
        compiled: TritonKernel = await self.compile_triton(plan.fn, timeout=timeout, **plan.request())
        if plan.device is not None:
            await threads.LOADS.run(lambda: _triton_warmup.prime(plan, compiled))
        return compiled

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
        tuner = self._tuning()
        return await tuner.autotune(kernel, args, kwargs, grid=grid, device=device, timeout=timeout,
                                    progress=progress)

    def _tuning(self) -> Tuner:
        self._check_open()
        with self._tuner_lock:
            if self._tuner is None:
                self._tuner = Tuner(self)  # type: ignore[arg-type]  # always a Scheduler
            return self._tuner

    # -- PyTorch Inductor --------------------------------------------------------------------

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
        (the worker's traceback as its cause), ``CompileTimeout`` past ``timeout``
        seconds of worker time (its worker is killed, no other), ``WorkerCrashedError``
        after ``max_crashes`` worker deaths; a death before that is retried on a fresh
        worker. Cancelling the await lets a started compile finish, kept for the next
        caller. Needs torch; a worker imports it on its first such job, unless the fork
        server preloads it (``aiocompile.torch.PRELOAD`` in ``config.preload``).
        """
        from aiocompile.backends import inductor

        checks.CALL_TIMEOUT.check("timeout", timeout)
        request = await inductor.prepare(self._context, kernel_name, source_code, device_str)
        artifact: inductor.InductorArtifact = await self._execute(request, timeout)
        return await threads.LOADS.run(artifact.ready)

    def _execute_sync(self, request: Request, timeout: float | None) -> cf.Future[Any]:
        """The request path for a caller outside any event loop (``Requests.execute_sync``)."""
        return self._requests.execute_sync(request, timeout)

    def _prepare_pool(self) -> None:
        """Start loading the fork server now (its preload), without waiting."""
        self._check_open()
        self._pool.start()

    def _warm_workers(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> None:
        """Start every worker and run ``fn(*args)`` once in each not yet warmed, without
        waiting (a backend's warm-up, such as importing torch for Inductor's kernels)."""
        self._check_open()
        self._pool.warm(fn, args)
