"""The default scheduler, behind the module-level functions (``aiocompile.compile_triton``
and the others): one object, created on first use from the environment's configuration,
and created anew after ``aclose()`` or in a forked child."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any, Callable

from aiocompile._base.config import SchedulerConfig
from aiocompile._core.scheduler import Scheduler
from aiocompile._tuning.tuner import AutotuneResult
from aiocompile.backends.cpp._library import NativeLibrary
from aiocompile.backends.cuda._binary import CudaBinary
from aiocompile.backends.triton._kernel import TritonKernel
from aiocompile.records import Statistics


class _DefaultScheduler:
    """The scheduler behind the module-level functions: created on first use, from the
    environment's configuration, and created anew after ``aclose()`` or in a forked child."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scheduler: Scheduler | None = None

    def get(self) -> Scheduler:
        scheduler = self._scheduler
        if scheduler is not None and not scheduler.closed:
            return scheduler
        with self._lock:
            if self._scheduler is None or self._scheduler.closed:
                self._scheduler = Scheduler(config=SchedulerConfig.from_env())
                self._scheduler.port.start_benchmark_if_asked()
            return self._scheduler


_default = _DefaultScheduler()


def default_scheduler() -> Scheduler:
    """The scheduler the module-level functions use (created on first use)."""
    return _default.get()


async def compile_triton(kernel: Any, **kwargs: Any) -> TritonKernel:
    """``Scheduler.compile_triton`` on the default scheduler."""
    return await _default.get().compile_triton(kernel, **kwargs)


async def compile_cpp(source: str, **kwargs: Any) -> NativeLibrary:
    """``Scheduler.compile_cpp`` on the default scheduler."""
    return await _default.get().compile_cpp(source, **kwargs)


async def compile_cuda(source: str, **kwargs: Any) -> CudaBinary:
    """``Scheduler.compile_cuda`` on the default scheduler."""
    return await _default.get().compile_cuda(source, **kwargs)


async def compile_many(specs: Iterable[Mapping[str, Any]], **kwargs: Any) -> list[Any]:
    """``Scheduler.compile_many`` on the default scheduler."""
    return await _default.get().compile_many(specs, **kwargs)


async def run(fn: Callable[..., Any], *args: Any, key: str | None = None, timeout: float | None = None) -> Any:
    """``Scheduler.run`` on the default scheduler."""
    return await _default.get().run(fn, *args, key=key, timeout=timeout)


async def wait(awaitables: Any, **kwargs: Any) -> Any:
    """``Scheduler.wait`` on the default scheduler (whose compiles the progress bar names)."""
    return await _default.get().wait(awaitables, **kwargs)


async def warmup(kernel: Any, *args: Any, **kwargs: Any) -> TritonKernel:
    """``Scheduler.warmup`` on the default scheduler."""
    return await _default.get().warmup(kernel, *args, **kwargs)


async def warm(target: Any = "cuda:90", *, benchmark: bool = False) -> None:
    """``Scheduler.warm`` on the default scheduler."""
    await _default.get().warm(target, benchmark=benchmark)


async def autotune(kernel: Any, *args: Any, **kwargs: Any) -> AutotuneResult:
    """``Scheduler.autotune`` on the default scheduler."""
    return await _default.get().autotune(kernel, *args, **kwargs)


def statistics() -> Statistics:
    """``Scheduler.statistics`` of the default scheduler."""
    return _default.get().statistics()


async def inductor_triton(kernel_name: str, source_code: str, **kwargs: Any) -> Any:
    """``Scheduler.inductor_triton`` on the default scheduler."""
    return await _default.get().inductor_triton(kernel_name, source_code, **kwargs)
