"""``install()``: Inductor's compiles sent to an aiocompile scheduler, by replacing what
``torch._inductor.async_compile.AsyncCompile`` does (``PATCHED``; ``uninstall()`` puts back
exactly what was there):

- ``triton``: the kernel submitted to the scheduler (``async_triton``), answered with an
  Inductor ``LambdaFuture`` that Inductor's own ``wait()`` resolves, or with the kernel
  itself when Inductor runs with one compile thread;
- ``cpp``, ``cpp_pybinding``: Inductor writes the source and makes its build commands; the
  build it would hand to a compile thread runs in a worker (``_NativeSubmit``), and
  Inductor loads the library itself;
- ``cuda``: ``CUDACodeCache.compile`` (nvcc) in a worker; the library is loaded here;
- ``rocm``: the same with ``ROCmCodeCache`` (ROCm's Clang, HIP);
- ``halide``: Halide's runtime, then each kernel's build (its generator, its C++ glue)
  in a worker; Inductor loads the kernel's binding here;
- ``use_process_pool``: true whenever Inductor would compile in parallel and a worker has
  finished its warm-up, so that it starts compiles during code generation; until then
  false, as Inductor's own answer is while its pool starts (template choices are then
  precompiled in its threads rather than queued for workers not yet there); its own pool
  is never started;
- ``warm_pool``, ``wakeup``, ``wait_pool_ready``: instead of Inductor's pool warm-up, the
  scheduler's workers are started (and, under max-autotune, the benchmark processes).

Also patched while installed: Inductor's debug wrapper (``graph_repro``: an error of
Inductor's leaves a repro bundle) and its tuning pool (``autotune``). And where the
installation has no bytecode (and Python writes none), the modules of Inductor's packages
(``PRELOAD_PACKAGES``) that this process imports read aiocompile's
(``bytecode.PackageImports``), which helper processes compile as ``install()`` starts the
fork server (``bytecode.prepare``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any, Callable

from aiocompile._base import bytecode, checks
from aiocompile._base.config import TRITON_PRELOAD, SchedulerConfig, named_in_env
from aiocompile._core.scheduler import Scheduler
from aiocompile._observe import repro
from aiocompile._torch import async_triton, autotune, graph_repro
from aiocompile._torch.installation import STATE, Installation
from aiocompile.backends.inductor._worker import PRELOAD, PRELOAD_PACKAGES
from aiocompile.errors import SchedulerClosed

# The attributes of AsyncCompile that install() replaces, with what replaces them below.
PATCHED = ("triton", "cpp", "cpp_pybinding", "cuda", "rocm", "halide", "use_process_pool", "warm_pool", "wakeup",
           "wait_pool_ready")




def install(scheduler: Scheduler | None = None, *, timeout: float | None = None, warm: bool = True) -> Scheduler:
    """Make Inductor's compiles (Triton kernels, C++, CUDA and Halide builds) run in ``scheduler``
    and return it; with None, in a scheduler of its own (configured from the environment,
    its workers forked with torch already imported where Triton kernels may come), which
    starts loading at once and which ``uninstall()`` closes.

    ``timeout`` is the per-kernel compile timeout in seconds (None: the scheduler's).
    With ``warm`` (the default), every worker is started ahead of the first compile:
    where Triton kernels may come, by the first ``torch.compile`` on a GPU, while
    Inductor traces and generates code (each worker imports Inductor's Triton runtime),
    as Inductor does with its own pool; with a CPU build of torch, whose workers have
    nothing to import, at once (Inductor starts no pool for a model on the CPU, so
    nothing would). Raises ``RuntimeError`` if already installed, ``ImportError``
    without torch.
    """
    if scheduler is not None and not isinstance(scheduler, Scheduler):
        raise TypeError(f"scheduler must be an aiocompile.Scheduler or None, got {type(scheduler).__name__}")
    checks.CALL_TIMEOUT.check("timeout", timeout)
    if scheduler is not None and scheduler.closed:
        raise SchedulerClosed("the scheduler is closed: pass an open one, or None for one of aiocompile's")
    _use_torch_ptxas()
    # A scheduler of our own starts its fork server before this process imports Inductor
    # (seconds): the fork server's own import of torch is what the first kernels wait for.
    early = _early_scheduler() if scheduler is None else None
    try:
        installation = _patch(scheduler, early, timeout, warm)
    except BaseException:
        if early is not None:
            early.close()
        raise
    if warm and not _triton_kernels_possible():
        _warm(installation)
    return installation.scheduler


def _use_torch_ptxas() -> None:
    """Give this process's Triton the ptxas that Inductor's compile workers use (torch's
    own, where torch ships one and ``TRITON_PTXAS_PATH`` names none), as Inductor does
    itself when it compiles a kernel in this process; the workers, the fork server and the
    benchmark processes inherit it.

    Triton's cache key holds the ptxas version, which Triton asks once per process and
    keeps, and Inductor asks for it as it generates code (``triton_hash_with_backend``),
    before its first compile. So it is set here, before any of that, and a version Triton
    already asked is forgotten. Otherwise the kernels Inductor loads in this process
    itself (to time a fusion under max-autotune) find none of the workers' binaries in
    Triton's cache and compile again here, each a second or so on the clock."""
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # a torch without it: Inductor does not do it either
        return
    before = os.environ.get("TRITON_PTXAS_PATH")
    _set_triton_ptxas_path()
    if os.environ.get("TRITON_PTXAS_PATH") == before:
        return
    compiler = sys.modules.get("triton.backends.nvidia.compiler")
    asked = getattr(compiler, "get_ptxas_version", None)
    if asked is not None and hasattr(asked, "cache_clear"):
        asked.cache_clear()


def _early_scheduler() -> Scheduler | None:
    """``_own_scheduler()``, its fork server loading, unless ``install()`` is bound to fail
    (already installed: nothing to start; no torch: ``async_compile_module`` says so)."""
    if STATE.current is not None:
        return None
    try:
        return _own_scheduler()
    except ImportError:
        return None


def _patch(scheduler: Scheduler | None, early: Scheduler | None, timeout: float | None,
           warm: bool) -> Installation:
    module = async_triton.async_compile_module()
    target = module.AsyncCompile
    missing = [name for name in ("triton", "use_process_pool") if not hasattr(target, name)]
    if missing:
        raise RuntimeError(f"this torch's AsyncCompile has no {', '.join(missing)}: unsupported torch version")
    with STATE.lock:
        if STATE.current is not None:
            raise RuntimeError("aiocompile.torch is already installed; call aiocompile.torch.uninstall() first")
        owned = scheduler is None
        if scheduler is None:
            scheduler = early if early is not None else _own_scheduler()
        installation = Installation(scheduler, owned, _own_scheduler, timeout, warm, target)
        for name in PATCHED:
            if name in target.__dict__:
                installation.originals[name] = (True, target.__dict__[name])
            elif hasattr(target, name):
                installation.originals[name] = (False, None)
        for name in installation.originals:
            setattr(target, name, _REPLACEMENTS[name])
        # An Inductor error in this process leaves a repro bundle too.
        installation.graph_hook = graph_repro.patch(lambda: repro.root_of(installation.scheduler.config))
        # max-autotune: template choices timed in aiocompile's benchmark processes.
        installation.tuning = autotune.patch(
            autotune.TuningPool(lambda: installation.current_scheduler().port, lambda: _NativeSubmit(installation)))
        # Inductor's own imports here read the bytecode prepared for the fork server.
        if bytecode.directory() is not None:
            installation.imports = bytecode.PackageImports(PRELOAD_PACKAGES)
            installation.imports.install()
        STATE.current = installation
    return installation


def _own_scheduler() -> Scheduler:
    config = _own_config()
    if PRELOAD in config.preload:
        bytecode.prepare(PRELOAD_PACKAGES)  # for the fork server's imports, where there is none
    scheduler = Scheduler(config=config)
    # The fork server preloads now, while the program goes on to torch.compile.
    scheduler.port.start_pool()
    return scheduler


def _own_config() -> SchedulerConfig:
    """The environment's configuration, with two defaults of this drop-in's own.

    Preload: torch and Triton (the import, Triton's key, a throw-away compile per vendor)
    only where Inductor may compile Triton kernels (``_triton_kernels_possible``). A CPU
    build of torch compiles only C++ kernels, which the workers build without torch: its
    fork server preloads nothing and is ready at once, instead of spending seconds of a
    CPU on imports beside ``torch.compile`` and ahead of its first build.

    Worker priority: the program's (``worker_nice=0``) unless ``AIOCOMPILE_WORKER_NICE``
    says otherwise. Inductor's own compile threads and processes run at the program's
    priority, and the thread that called ``torch.compile`` waits for every compile: at a
    lower priority they would lose to any other work on the machine.
    """
    config = SchedulerConfig.from_env()
    if _triton_kernels_possible():
        preload: tuple[str, ...] = (*config.preload, PRELOAD)
    else:
        preload = tuple(entry for entry in config.preload if entry != TRITON_PRELOAD)
    changes: dict[str, Any] = {"preload": preload}
    if "worker_nice" not in named_in_env():
        changes["worker_nice"] = 0
    return config.with_changes(**changes)


def _triton_kernels_possible() -> bool:
    """Whether Inductor may compile Triton kernels in this program: with a torch built for
    a GPU (CUDA, ROCm, XPU), or with its Triton CPU backend. Asked of the build, not of
    the devices, which would initialise a GPU driver in this process."""
    import torch
    from torch._inductor import config as inductor_config

    gpu_build = any(getattr(torch.version, name, None) for name in ("cuda", "hip", "xpu"))
    return gpu_build or getattr(inductor_config, "cpu_backend", "cpp") == "triton"


def uninstall() -> bool:
    """Put back what ``install()`` replaced; returns whether anything was installed.

    Kernels already handed to Inductor stay valid. A scheduler ``install()`` made is
    closed (compiles still running get its ``close_grace``); one you gave is left open.
    An attribute that someone else replaced after ``install()`` is left as it is, with a
    ``RuntimeWarning``.
    """
    with STATE.lock:
        installation = STATE.current
        if installation is None:
            return False
        target = installation.target
        for name, (own, raw) in installation.originals.items():
            if target.__dict__.get(name) is not _REPLACEMENTS[name]:
                warnings.warn(f"AsyncCompile.{name} was replaced by someone else after aiocompile.torch.install(); "
                              "left as it is", RuntimeWarning, stacklevel=2)
                continue
            if own:
                setattr(target, name, raw)
            else:
                delattr(target, name)
        if installation.graph_hook is not None and not graph_repro.unpatch(installation.graph_hook):
            warnings.warn("torch._inductor.compile_fx.wrap_compiler_debug was replaced by someone else after "
                          "aiocompile.torch.install(); left as it is", RuntimeWarning, stacklevel=2)
        if installation.tuning is not None and not autotune.unpatch(installation.tuning):
            warnings.warn("Inductor's tuning pool (autotune_process) was replaced by someone else after "
                          "aiocompile.torch.install(); left as it is", RuntimeWarning, stacklevel=2)
        if installation.imports is not None:
            installation.imports.uninstall()
        STATE.current = None
    if installation.owned and installation.pid == os.getpid():
        installation.scheduler.close()
    return True


@contextlib.contextmanager
def installed(
    scheduler: Scheduler | None = None, *, timeout: float | None = None, warm: bool = True
) -> Iterator[Scheduler]:
    """``install()`` for the duration of a ``with`` block, which gets the scheduler."""
    sched = install(scheduler, timeout=timeout, warm=warm)
    try:
        yield sched
    finally:
        uninstall()


def is_installed() -> bool:
    return STATE.current is not None


# -- what replaces Inductor's methods ------------------------------------------------------------


def _active(cls: type, name: str) -> Installation | None:
    installation = STATE.current
    if installation is None and cls.__dict__.get(name) is _REPLACEMENTS[name]:  # pragma: no cover - invariant
        raise RuntimeError(f"AsyncCompile.{name} is aiocompile's, but nothing is installed")
    return installation


def _triton(self: Any, kernel_name: str, source_code: str, device_str: str = "cuda") -> Any:
    installation = _active(type(self), "triton")
    if installation is None:
        # A reference taken while installed, used after uninstall(): Inductor's own path.
        return type(self).triton(self, kernel_name, source_code, device_str)
    return async_triton.submit_triton(installation, self, kernel_name, source_code, device_str)


def _cpp(self: Any, source_code: str) -> Any:
    installation = _active(type(self), "cpp")
    if installation is None:
        return type(self).cpp(self, source_code)
    from torch._inductor.codecache import CppCodeCache

    module = async_triton.async_compile_module()
    _log_kernel(module, "CPP Kernel:\n%s", source_code)
    submit = _NativeSubmit(installation)
    get_result = CppCodeCache.load_async(source_code, submit_fn=submit)
    if not _threads(module):
        return get_result().kernel
    return async_triton.lambda_future(module, lambda: get_result().kernel, submit.future)


def _cpp_pybinding(self: Any, argtypes: list[str], source_code: str) -> Any:
    installation = _active(type(self), "cpp_pybinding")
    if installation is None:
        return type(self).cpp_pybinding(self, argtypes, source_code)
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    module = async_triton.async_compile_module()
    _log_kernel(module, "CPP+Bindings Kernel:\n%s", source_code)
    submit = _NativeSubmit(installation)
    get_result = CppPythonBindingsCodeCache.load_pybinding_async(argtypes, source_code, submit_fn=submit)
    if not _threads(module):
        return get_result()
    return async_triton.lambda_future(module, get_result, submit.future)


def _cuda(self: Any, source_code: str, dst_file_ext: str, aot_compile: bool = False) -> Any:
    installation = _active(type(self), "cuda")
    if installation is None:
        return type(self).cuda(self, source_code, dst_file_ext, aot_compile)
    return _gpu_build(installation, "cuda", source_code, dst_file_ext, aot_compile)


def _rocm(self: Any, source_code: str, dst_file_ext: str, aot_compile: bool = False) -> Any:
    installation = _active(type(self), "rocm")
    if installation is None:
        return type(self).rocm(self, source_code, dst_file_ext, aot_compile)
    return _gpu_build(installation, "rocm", source_code, dst_file_ext, aot_compile)


def _gpu_build(installation: Installation, kind: str, source_code: str, dst_file_ext: str, aot_compile: bool) -> Any:
    """``AsyncCompile.cuda`` or ``.rocm``: the build in a worker, the library loaded here."""
    from torch._inductor import codecache

    from aiocompile.backends.inductor import _native

    cache = codecache.CUDACodeCache if kind == "cuda" else codecache.ROCmCodeCache
    module = async_triton.async_compile_module()
    _log_kernel(module, f"{'CUDA' if kind == 'cuda' else 'ROCm'} Kernel:\n%s", source_code)
    make = _native.cuda_request if kind == "cuda" else _native.rocm_request
    answer = installation.current_scheduler().port.execute_sync(make(source_code, dst_file_ext, aot_compile),
                                                                installation.timeout)

    def load() -> Any:
        # What Inductor's compile thread does once the build is done: the compile finds
        # its files and compiles nothing; the library is loaded here.
        async_triton.result(answer)
        if aot_compile:
            output_path, *_ = cache.compile(source_code, "o")
            cache.aot_kernels_o.append(output_path)
        return cache.load(source_code, dst_file_ext)[0]

    if not _threads(module):
        return load()
    return async_triton.lambda_future(module, load, answer)


def _halide(self: Any, meta: Any, source_code: str) -> Any:
    installation = _active(type(self), "halide")
    if installation is None:
        return type(self).halide(self, meta, source_code)
    from torch._inductor.codecache import HalideCodeCache

    from aiocompile.backends.inductor import _native

    module = async_triton.async_compile_module()
    _log_kernel(module, "Halide Kernel:\n%r\n%s", meta, source_code)
    target = "cuda" if meta.is_cuda() else "cpu"
    _halide_runtime(installation, target)
    submit = _NativeSubmit(installation, functools.partial(_native.halide_request, target=target))
    get_result = HalideCodeCache.generate_halide_async(meta, source_code, submit_fn=submit)
    if not _threads(module):
        return get_result()
    return async_triton.lambda_future(module, get_result, submit.future)


def _halide_runtime(installation: Installation, target: str) -> None:
    """Halide's runtime library, built in a worker before Inductor asks for it. Inductor
    builds it in the calling thread for the first Halide kernel of a cache directory,
    importing Halide into this process and compiling with it; built first in a worker, it
    is found done there. Waited for: the kernel's build links against it."""
    from torch._inductor.codecache import HalideCodeCache

    from aiocompile.backends.inductor import _native

    previous = getattr(HalideCodeCache, "_standalone_runtime_path", None)
    if previous and os.path.exists(previous):
        return
    request = _native.halide_runtime_request(previous, target)
    async_triton.result(installation.current_scheduler().port.execute_sync(request, installation.timeout))


class _NativeSubmit:
    """The ``submit_fn`` Inductor's ``CppCodeCache.load_async`` (or
    ``HalideCodeCache.generate_halide_async``) hands its build to: a request to the
    scheduler instead of a compile thread. Inductor waits on the future it returns
    (``future.result()``), then loads the library itself, in the thread that asks for the
    kernel. Inductor calls it only when the library is not on disk yet."""

    def __init__(self, installation: Installation, request: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        self.installation = installation
        self.request = request
        self.future: cf.Future[Any] | None = None

    def __call__(self, build: Callable[[], Any]) -> cf.Future[Any]:
        from aiocompile.backends.inductor import _native

        request = (self.request or _native.cpp_request)(build)
        self.future = self.installation.current_scheduler().port.execute_sync(request, self.installation.timeout)
        return self.future


def _threads(module: Any) -> bool:
    """Whether Inductor compiles with threads (its ``wait()`` resolves futures) rather
    than one kernel after another in the caller."""
    return bool(module.get_compile_threads() > 1)


def _log_kernel(module: Any, message: str, *args: Any) -> None:
    code_log = getattr(module, "kernel_code_log", None)
    if code_log is not None:
        code_log.info(message, *args)


def _use_process_pool(cls: Any) -> bool:
    installation = _active(cls, "use_process_pool")
    if installation is None:
        return bool(cls.use_process_pool())
    return async_triton.parallel() and installation.workers_ready()


def _warm_pool(cls: type) -> None:
    installation = STATE.current
    if installation is not None and installation.warm:
        _warm(installation)
        _warm_tuning(installation)


def _warm_tuning(installation: Installation) -> None:
    """Under max-autotune (``wakeup()`` runs under the compile's settings), start the
    benchmark processes now, at the start of the compile, rather than when Inductor first
    asks for its tuning pool (its first matmul): each imports torch and Inductor and opens
    its GPU, seconds that the first choices' timing otherwise waited for."""
    if installation.tuning is None:
        return
    from torch._inductor import config

    if getattr(config, "max_autotune", False) or getattr(config, "max_autotune_gemm", False):
        installation.tuning.pool.warm()


def _no_op(cls: type, *args: Any, **kwargs: Any) -> None:
    return None


_REPLACEMENTS: dict[str, Any] = {
    "triton": _triton,
    "cpp": _cpp,
    "cpp_pybinding": _cpp_pybinding,
    "cuda": _cuda,
    "rocm": _rocm,
    "halide": _halide,
    "use_process_pool": classmethod(_use_process_pool),
    "warm_pool": classmethod(_warm_pool),
    # torch.compile's own backend calls wakeup() alone, for a graph with GPU inputs;
    # warm_pool() only where dynamo looks its "inductor" backend up by name.
    "wakeup": classmethod(_warm_pool),
    "wait_pool_ready": classmethod(_no_op),
}


def _warm(installation: Installation) -> None:
    scheduler = installation.current_scheduler()
    with STATE.lock:
        if installation.warmed:
            return
        installation.warmed = True
    try:
        installation.warming = scheduler.port.warm_workers(_warm_up_function())
    except Exception:  # a closed scheduler, a pool that cannot start: the compile will say
        pass


def _warm_up_function() -> Callable[[], float]:
    """What readies a worker: importing Inductor's Triton runtime where Triton kernels may
    come; else nothing (C++ builds need no torch in the worker), only starting it."""
    from aiocompile.backends.inductor import _native_worker
    from aiocompile.backends.inductor import _worker as _inductor_worker

    return _inductor_worker.warm_up if _triton_kernels_possible() else _native_worker.ready


