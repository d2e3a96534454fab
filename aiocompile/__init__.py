"""aiocompile: an asyncio-native compile scheduler for GPU kernels.

``kernel = await aiocompile.compile_triton(add_kernel, signature=..., target="cuda:90")``
compiles in a supervised pool of worker processes while the event loop keeps serving;
``compile_cpp`` and ``compile_cuda`` do the same for C++ and CUDA sources.

This front door holds what a user needs on day one. Beside it:

- ``aiocompile.errors``: the whole error tree;
- ``aiocompile.records``: what things cost (``JobRecord``, ``Statistics``, ...);
- ``aiocompile.results``: what the compiles return (``TritonKernel``, ``NativeLibrary``,
  ``CudaBinary``, ``AutotuneResult``), for annotations;
- ``aiocompile.lowlevel``: what experts reach for (``WorkerPool``, the default scheduler,
  ``inductor_triton``);
- ``aiocompile.torch``, ``aiocompile.dask``, ``aiocompile.prometheus``: integrations.

Importing this package imports neither Triton nor torch, nor anything else until a name is
first used: worker processes import parts of this package, and must not pay for the rest.
"""

import importlib as _importlib
import logging as _logging
import typing as _typing

from aiocompile._base.version import VERSION as __version__  # noqa: F401 - the package's version

# Printing is the application's choice: without a handler of ours, logging's last resort
# would print every warning (a compile error the caller caught, a retried crash) on stderr.
_logging.getLogger("aiocompile").addHandler(_logging.NullHandler())

# Public name -> the module that defines it.
_EXPORTS = {
    "AiocompileError": "aiocompile.errors",
    "CompileError": "aiocompile.errors",
    "JobError": "aiocompile.errors",
    "JobTimeout": "aiocompile.errors",
    "Scheduler": "aiocompile._core.scheduler",
    "SchedulerClosed": "aiocompile.errors",
    "SchedulerConfig": "aiocompile._base.config",
    "Target": "aiocompile._base.target",
    "TritonSource": "aiocompile.backends.triton",
    "WorkerCrashed": "aiocompile.errors",
    "autotune": "aiocompile._core.default",
    "compile_cpp": "aiocompile._core.default",
    "compile_cuda": "aiocompile._core.default",
    "compile_many": "aiocompile._core.default",
    "compile_triton": "aiocompile._core.default",
    "run": "aiocompile._core.default",
    "statistics": "aiocompile._core.default",
    "wait": "aiocompile._core.default",
    "warm": "aiocompile._core.default",
    "warmup": "aiocompile._core.default",
}

__all__ = [
    "AiocompileError",
    "CompileError",
    "JobError",
    "JobTimeout",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerConfig",
    "Target",
    "TritonSource",
    "WorkerCrashed",
    "autotune",
    "compile_cpp",
    "compile_cuda",
    "compile_many",
    "compile_triton",
    "run",
    "statistics",
    "wait",
    "warm",
    "warmup",
]

# Names an earlier release had at the top, now in their own modules: they still work here,
# off the front door (not in ``__all__`` or ``dir()``).
_MOVED = {
    "AutotuneError": "aiocompile.errors",
    "CompilerNotFound": "aiocompile.errors",
    "AutotuneResult": "aiocompile.results",
    "CudaBinary": "aiocompile.results",
    "CudaKernel": "aiocompile.results",
    "NativeLibrary": "aiocompile.results",
    "TritonKernel": "aiocompile.results",
    "BenchmarkRecord": "aiocompile.records",
    "JobRecord": "aiocompile.records",
    "Statistics": "aiocompile.records",
    "Summary": "aiocompile.records",
    "WorkerEvent": "aiocompile.records",
    "WorkerPool": "aiocompile.lowlevel",
    "default_scheduler": "aiocompile.lowlevel",
    "inductor_triton": "aiocompile.lowlevel",
}
_RENAMED = ("CompileTimeout", "WorkerCrashedError")


def __getattr__(name: str) -> _typing.Any:
    module = _EXPORTS.get(name) or _MOVED.get(name)
    if module is None:
        if name in _RENAMED:
            from aiocompile import errors

            return errors.renamed(name)
        raise AttributeError(f"module 'aiocompile' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    if name in _EXPORTS:
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if _typing.TYPE_CHECKING:
    from aiocompile._base.config import SchedulerConfig
    from aiocompile._base.target import Target
    from aiocompile._core.default import (
        autotune,
        compile_cpp,
        compile_cuda,
        compile_many,
        compile_triton,
        run,
        statistics,
        wait,
        warm,
        warmup,
    )
    from aiocompile._core.scheduler import Scheduler
    from aiocompile.backends.triton import TritonSource
    from aiocompile.errors import (
        AiocompileError,
        CompileError,
        JobError,
        JobTimeout,
        SchedulerClosed,
        WorkerCrashed,
    )
