"""aiocompile: an asyncio-native compile scheduler for GPU kernels.

``kernel = await aiocompile.compile_triton(add_kernel, signature=..., target="cuda:90")``
compiles in a supervised pool of worker processes while the event loop keeps serving.

Importing this package imports neither Triton nor torch.
"""

from aiocompile._config import SchedulerConfig
from aiocompile._errors import (
    AiocompileError,
    CompileError,
    CompileTimeout,
    SchedulerClosed,
    WorkerCrashedError,
)
from aiocompile._metrics import JobRecord, Statistics, Summary
from aiocompile._pool import WorkerPool
from aiocompile._scheduler import (
    Scheduler,
    compile_many,
    compile_triton,
    default_scheduler,
    run,
    statistics,
    warm,
)
from aiocompile._target import Target
from aiocompile.backends.triton import TritonKernel, TritonSource

__version__ = "0.1.0"

__all__ = [
    "AiocompileError",
    "CompileError",
    "CompileTimeout",
    "JobRecord",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerConfig",
    "Statistics",
    "Summary",
    "Target",
    "TritonKernel",
    "TritonSource",
    "WorkerCrashedError",
    "WorkerPool",
    "__version__",
    "compile_many",
    "compile_triton",
    "default_scheduler",
    "run",
    "statistics",
    "warm",
]
