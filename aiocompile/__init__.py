"""aiocompile: an asyncio-native compile scheduler for GPU kernels.

``kernel = await aiocompile.compile_triton(add_kernel, signature=..., target="cuda:90")``
compiles in a supervised pool of worker processes while the event loop keeps serving;
``compile_cpp`` and ``compile_cuda`` do the same for C++ and CUDA sources.

Importing this package imports neither Triton nor torch, nor anything else until a name is
first used: worker processes import parts of this package, and must not pay for the rest.
"""

import importlib as _importlib
import typing as _typing

__version__ = "0.1.0"

# Public name -> the private module that defines it.
_EXPORTS = {
    "AiocompileError": "aiocompile.errors",
    "AutotuneError": "aiocompile.errors",
    "AutotuneResult": "aiocompile._tuning.tuner",
    "BenchmarkRecord": "aiocompile.records",
    "CompileError": "aiocompile.errors",
    "CompileTimeout": "aiocompile.errors",
    "CompilerNotFound": "aiocompile.errors",
    "CudaBinary": "aiocompile.backends.cuda._binary",
    "CudaKernel": "aiocompile.backends.cuda._binary",
    "JobRecord": "aiocompile.records",
    "NativeLibrary": "aiocompile.backends.cpp._library",
    "Scheduler": "aiocompile._core.scheduler",
    "SchedulerClosed": "aiocompile.errors",
    "SchedulerConfig": "aiocompile._core.config",
    "Statistics": "aiocompile.records",
    "Summary": "aiocompile.records",
    "Target": "aiocompile._base.target",
    "TritonKernel": "aiocompile.backends.triton._kernel",
    "TritonSource": "aiocompile.backends.triton",
    "WorkerCrashedError": "aiocompile.errors",
    "WorkerEvent": "aiocompile.records",
    "WorkerPool": "aiocompile._pool.pool",
    "autotune": "aiocompile._core.default",
    "compile_cpp": "aiocompile._core.default",
    "compile_cuda": "aiocompile._core.default",
    "compile_many": "aiocompile._core.default",
    "compile_triton": "aiocompile._core.default",
    "default_scheduler": "aiocompile._core.default",
    "inductor_triton": "aiocompile._core.default",
    "run": "aiocompile._core.default",
    "statistics": "aiocompile._core.default",
    "wait": "aiocompile._core.default",
    "warm": "aiocompile._core.default",
    "warmup": "aiocompile._core.default",
}

__all__ = [
    "AiocompileError",
    "AutotuneError",
    "AutotuneResult",
    "BenchmarkRecord",
    "CompileError",
    "CompileTimeout",
    "CompilerNotFound",
    "CudaBinary",
    "CudaKernel",
    "JobRecord",
    "NativeLibrary",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerConfig",
    "Statistics",
    "Summary",
    "Target",
    "TritonKernel",
    "TritonSource",
    "WorkerCrashedError",
    "WorkerEvent",
    "WorkerPool",
    "__version__",
    "autotune",
    "compile_cpp",
    "compile_cuda",
    "compile_many",
    "compile_triton",
    "default_scheduler",
    "inductor_triton",
    "run",
    "statistics",
    "wait",
    "warm",
    "warmup",
]


def __getattr__(name: str) -> _typing.Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiocompile' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if _typing.TYPE_CHECKING:
    from aiocompile._base.target import Target
    from aiocompile._core.config import SchedulerConfig
    from aiocompile._core.default import (
        autotune,
        compile_cpp,
        compile_cuda,
        compile_many,
        compile_triton,
        default_scheduler,
        inductor_triton,
        run,
        statistics,
        wait,
        warm,
        warmup,
    )
    from aiocompile._core.scheduler import Scheduler
    from aiocompile._pool.pool import WorkerPool
    from aiocompile._tuning.tuner import AutotuneResult
    from aiocompile.backends.cpp._library import NativeLibrary
    from aiocompile.backends.cuda._binary import CudaBinary, CudaKernel
    from aiocompile.backends.triton import TritonSource
    from aiocompile.backends.triton._kernel import TritonKernel
    from aiocompile.errors import (
        AiocompileError,
        AutotuneError,
        CompileError,
        CompilerNotFound,
        CompileTimeout,
        SchedulerClosed,
        WorkerCrashedError,
    )
    from aiocompile.records import BenchmarkRecord, JobRecord, Statistics, Summary, WorkerEvent
