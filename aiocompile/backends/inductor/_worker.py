"""The Inductor backend's side inside a worker process.

Importing this module imports neither torch nor Triton, so the parent can name these
functions in a job for free. Workers get torch from the fork server when its preload list
holds ``PRELOAD`` (as the scheduler ``aiocompile.torch.install()`` makes does), and import
it on their first Inductor job otherwise.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Mapping
from typing import Any

from aiocompile.backends.triton._worker import StageTimes
from aiocompile.errors import CompileError

PRELOAD = "aiocompile.backends.inductor._worker:prepare_process"
"""The fork server preload entry (see ``SchedulerConfig.preload``) that imports torch's
Inductor runtime before workers are forked."""

PRELOAD_PACKAGES = ("torch._inductor", "torch._dynamo", "torch._functorch", "torch.fx", "torch.export",
                    "torch._export", "torch.distributed", "sympy", "mpmath", "networkx", "triton")
"""The packages whose modules that preload and Inductor's compiles import, beside those the
program has imported already: their bytecode is prepared ahead where the installation has
none (``bytecode.prepare``)."""

# What the fork server imports (the bulk of the import time)...
_TORCH_MODULES = ("torch", "torch._inductor.codecache")
# ... and what each worker imports itself (a small part of it): importing Inductor's Triton
# runtime loads the GPU driver, which starts a thread, and a process that has loaded the
# driver must not fork.
_WORKER_MODULES = (
    *_TORCH_MODULES,
    "torch._inductor.runtime.triton_heuristics",
    "torch._inductor.runtime.compile_tasks",
)
# Thread pools that importing torch would start (numpy's BLAS, OpenMP): one thread each is
# plenty for processes that only compile, and none is started at import then.
_THREAD_POOL_SIZES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def prepare_process() -> None:
    """Preload hook (see ``aiocompile._pool.zygote.Preload``): import torch and most of
    Inductor in the fork server, so that every worker forked from it starts with them.
    That takes seconds; a worker that does it itself makes its first kernel wait that
    long, and a whole pool doing it at once competes for the CPUs.

    The fork server must stay single-threaded to fork safely. Importing torch imports
    numpy, whose BLAS starts a thread per CPU at load unless told otherwise, so the thread
    pool sizes are set to 1 first (compile workers do no linear algebra; the workers
    inherit the setting). Each import is then checked to have started no thread; if one
    did, the imports stop there and the problem is reported (workers import the rest
    themselves). All of it happens before the fork server reports ready, so no worker
    starts half-prepared.
    """
    for name in _THREAD_POOL_SIZES:
        os.environ[name] = "1"
    import importlib

    from aiocompile._base import generated

    # The code torch's modules generate at import (Inductor's kernel templates, dataclasses'
    # methods) is compiled once for all of aiocompile's processes: the serving process's
    # imports for a load read it (``generated``).
    generated.install(everywhere=True)

    before = _threads()
    for name in _TORCH_MODULES:
        importlib.import_module(name)
        after = _threads()
        if before is not None and after is not None and after > before:
            raise RuntimeError(
                f"importing {name} started {after - before} thread(s) in the fork server; the rest of torch is "
                "not preloaded, and workers import it on their first Inductor kernel"
            )


_driver_ready = False


def warm_up() -> float:
    """Get this worker ready for its first Inductor kernel; returns the seconds it took (0
    when already done): import Inductor's Triton runtime, then activate Triton's GPU driver
    (``_activate_driver``)."""
    import importlib
    import sys

    global _driver_ready
    started = time.perf_counter()
    for name in _WORKER_MODULES:
        if name not in sys.modules:
            importlib.import_module(name)
    if not _driver_ready:
        _driver_ready = True
        _activate_driver()
    return time.perf_counter() - started


def _activate_driver() -> None:
    """What loading the first kernel's module does (``set_driver_to_gpu()``): initialise
    the GPU driver and load Triton's driver utilities, which Triton builds with the C
    compiler into its cache directory where they are not there yet (a fresh cache: every
    worker builds them at once, a second or more each). In the warm-up this happens while
    Inductor traces the model; otherwise on the first kernel of every worker, while
    Inductor waits for it (max-autotune's first template choices). Nothing happens where
    there is no GPU backend: such a worker compiles nothing that needs it."""
    try:
        from torch._inductor.runtime import triton_helpers

        triton_helpers.set_driver_to_gpu()
    except Exception:  # noqa: BLE001 - a head start only; the first kernel reports the real error
        pass


def _load_kernel(kernel_name: str, source_code: str) -> Any:
    from torch._inductor.codecache import PyCodeCache

    return getattr(PyCodeCache.load(source_code), kernel_name)


def _torch_arguments(worker: Any, values: Mapping[str, Any]) -> list[Any]:
    """The positional arguments for Inductor's worker function of the installed torch:
    ``(load_kernel, extra_env)`` in older releases, ``(load_kernel, extra_env,
    extra_config)`` since; parameters added later without a default get None (streaming
    switched off, the blocking path)."""
    arguments = []
    for param in inspect.signature(worker).parameters.values():
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            break
        if param.name in values:
            arguments.append(values[param.name])
        elif param.default is param.empty:
            arguments.append(None)
        else:
            break
    return arguments


def compile_triton(
    kernel_name: str,
    source_code: str,
    env: dict[str, str],
    unset: tuple[str, ...],
    extra_config: dict[str, Any],
    key: str,
    target: str | None,
) -> dict[str, Any]:
    """Compile one Inductor kernel the way Inductor's own compile workers do, with
    Inductor's own worker function: load the module, ``precompile(warm_cache_only=True)``,
    ``prepare_for_pickle()``. Returns the autotuner (it pickles), Inductor's elapsed time
    in microseconds, and Triton's stage times summed over the autotuning configurations.

    A kernel that does not compile raises ``CompileError``; the message is the
    compiler's, the traceback reaches the parent as the error's cause.
    """
    warm_up()
    from torch._inductor.runtime import compile_tasks

    for name in unset:
        # Inductor's worker only ever sets variables; one unset in the parent since the
        # last job must not linger here.
        os.environ.pop(name, None)
    worker = compile_tasks._worker_compile_triton
    load = functools.partial(_load_kernel, kernel_name, source_code)
    arguments = _torch_arguments(worker, {"load_kernel": load, "extra_env": env, "extra_config": extra_config})
    with StageTimes() as stages:
        try:
            answer = worker(*arguments)
        except Exception as exc:
            raise CompileError(_format_error(exc), kernel_name=kernel_name, key=key, target=target) from exc
    if isinstance(answer, tuple):
        kernel, elapsed_us = answer[0], answer[1]
    else:
        kernel, elapsed_us = answer, None
    if kernel is None:
        raise RuntimeError(
            f"torch {_torch_version()}'s compile worker returned no kernel for {kernel_name!r}; "
            "this torch version is not supported"
        )
    return {"kernel": kernel, "elapsed_us": elapsed_us, "stages": stages.stages, "cache_hit": stages.cache_hit}


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _format_error(exc: BaseException) -> str:
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
