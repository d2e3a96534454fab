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
    "AiocompileError": "aiocompile._errors",
    "AutotuneError": "aiocompile._errors",
    "AutotuneResult": "aiocompile._tuning._tuner",
    "BenchmarkRecord": "aiocompile._metrics",
    "CompileError": "aiocompile._errors",
    "CompileTimeout": "aiocompile._errors",
    "CompilerNotFound": "aiocompile._errors",
    "CudaBinary": "aiocompile.backends.cuda._binary",
    "CudaKernel": "aiocompile.backends.cuda._binary",
    "JobRecord": "aiocompile._metrics",
    "NativeLibrary": "aiocompile.backends.cpp._library",
    "Scheduler": "aiocompile._scheduler",
    "SchedulerClosed": "aiocompile._errors",
    "SchedulerConfig": "aiocompile._config",
    "Statistics": "aiocompile._metrics",
    "Summary": "aiocompile._metrics",
    "Target": "aiocompile._target",
    "TritonKernel": "aiocompile.backends.triton._kernel",
    "TritonSource": "aiocompile.backends.triton",
    "WorkerCrashedError": "aiocompile._errors",
    "WorkerEvent": "aiocompile._metrics",
    "WorkerPool": "aiocompile._pool",
    "autotune": "aiocompile._default",
    "compile_cpp": "aiocompile._default",
    "compile_cuda": "aiocompile._default",
    "compile_many": "aiocompile._default",
    "compile_triton": "aiocompile._default",
    "default_scheduler": "aiocompile._default",
    "inductor_triton": "aiocompile._default",
    "run": "aiocompile._default",
    "statistics": "aiocompile._default",
    "wait": "aiocompile._default",
    "warm": "aiocompile._default",
    "warmup": "aiocompile._default",
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
    from aiocompile._config import SchedulerConfig
    from aiocompile._default import (
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
    from aiocompile._errors import (
        AiocompileError,
        AutotuneError,
        CompileError,
        CompilerNotFound,
        CompileTimeout,
        SchedulerClosed,
        WorkerCrashedError,
    )
    from aiocompile._metrics import BenchmarkRecord, JobRecord, Statistics, Summary, WorkerEvent
    from aiocompile._pool import WorkerPool
    from aiocompile._scheduler import Scheduler
    from aiocompile._target import Target
    from aiocompile._tuning._tuner import AutotuneResult
    from aiocompile.backends.cpp._library import NativeLibrary
    from aiocompile.backends.cuda._binary import CudaBinary, CudaKernel
    from aiocompile.backends.triton import TritonSource
    from aiocompile.backends.triton._kernel import TritonKernel
