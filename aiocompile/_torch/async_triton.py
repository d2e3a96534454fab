"""How ``AsyncCompile.triton`` is answered while installed: the kernel compiled in the
scheduler, handed back the way Inductor's own path hands it back (a ``LambdaFuture`` its
``wait()`` resolves, or the kernel itself with one compile thread), with Inductor's
counters, logs and compile-time metrics kept as its own path keeps them, and a repro
bundle for a kernel that does not compile.

Also the small pieces the C++ and CUDA replacements in ``aiocompile.torch`` share with it:
the module, the futures, waiting for an answer.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import importlib
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable

from aiocompile._observe import repro
from aiocompile._torch import bundles
from aiocompile.errors import CompileError

if TYPE_CHECKING:
    from aiocompile._torch.installation import Installation


def async_compile_module() -> Any:
    try:
        return importlib.import_module("torch._inductor.async_compile")
    except ImportError as exc:
        raise ImportError(
            f"aiocompile.torch needs PyTorch with Inductor (pip install 'aiocompile[torch]'): {exc}"
        ) from exc


def parallel() -> bool:
    """Whether Inductor compiles in parallel, i.e. whether its ``wait()`` resolves
    futures: more than one compile thread, and no Proton profiling (which needs the
    compile in this process; then the kernel is compiled in the pool but waited for at
    once)."""
    module = async_compile_module()
    from torch._inductor import config

    if module.get_compile_threads() <= 1:
        return False
    return not getattr(getattr(config, "triton", None), "proton_profiling", False)


def submit_triton(installation: Installation, async_compile: Any, kernel_name: str, source_code: str,
                  device_str: str) -> Any:
    """``AsyncCompile.triton`` through the scheduler: the same bookkeeping as Inductor's,
    the compile in the pool."""
    module = async_compile_module()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        # The interpreter runs kernels in this process; nothing to compile.
        return installation.original("triton")(async_compile, kernel_name, source_code, device_str)
    import torch
    from torch._dynamo.utils import counters

    from aiocompile.backends import inductor

    counters["inductor"]["async_compile_cache_miss"] += 1
    code_log = getattr(module, "kernel_code_log", None)
    if code_log is not None:
        code_log.info("Triton Kernel:\n%s", source_code)
    compile_start = getattr(module, "_compile_start", None)
    if compile_start is not None:
        compile_start()
    in_parallel = parallel()
    compile_id = torch._guards.CompileContext.current_compile_id()
    is_backward = bool(getattr(module.V.graph, "is_backward", False)) if hasattr(module, "V") else False

    held = held_by_inductor(module, kernel_name, source_code)
    if held is not None:
        counters["inductor"]["async_compile_cache_hit"] += 1
        return held if in_parallel else held.result()

    request = inductor.build_request(kernel_name, source_code, strict=False)
    answer = installation.current_scheduler().port.execute_sync(request, installation.timeout)
    graph = bundles.graph_context(module)  # for a repro bundle, should the kernel fail

    def get_result() -> Any:
        artifact: inductor.InductorArtifact = result_or_bundle(answer, installation, kernel_name, source_code, graph)
        kernel = artifact.ready((compile_id, is_backward))
        if artifact.elapsed_us is not None:
            report_compile_time(module, kernel, kernel_name, artifact.elapsed_us)
        return kernel

    if not in_parallel:
        return get_result()
    # Inductor reads ``future`` too: autotuning waits on it for (kernel, microseconds).
    exposed = chain(answer, lambda artifact: (artifact.kernel, artifact.elapsed_us or 0))
    return lambda_future(module, get_result, exposed)


def report_compile_time(module: Any, kernel: Any, kernel_name: str, elapsed_us: int) -> None:
    """Tell Inductor's own metrics what the compile took, as its own path does."""
    emit = getattr(module, "_emit_triton_kernel_compile_metric", None)
    if emit is not None:
        emit(kernel, kernel_name, elapsed_us)
        return
    add_info = getattr(module, "_add_triton_kernel_info", None)
    metrics_context = getattr(module, "get_metrics_context", None)
    if add_info is None or metrics_context is None:
        return
    metrics_context().add_top_n("triton_kernel_compile_times_us", kernel_name, elapsed_us)
    info = getattr(kernel, "autotune_cache_info", None) or {}
    info["compile_time_us"] = elapsed_us
    add_info(kernel_name, info)


def held_by_inductor(module: Any, kernel_name: str, source_code: str) -> Any:
    """A kernel Inductor itself holds for this source: a statically launchable autotuner
    its caches loaded (``StaticAutotunerFuture``), or a future of its own from before
    ``install()``. Answered as Inductor answers it."""
    kernels = getattr(module, "CompiledTritonKernels", None)
    if kernels is None:
        return None
    held = kernels.get(source_code)
    if held is None:
        return None
    static = getattr(module, "StaticAutotunerFuture", None)
    if static is not None and isinstance(held, static):
        kernels.remove_future(source_code)
        from torch._inductor.codecache import _load_triton_kernel_from_source

        held.reload_kernel_from_src = functools.partial(_load_triton_kernel_from_source, kernel_name, source_code)
    return held


def lambda_future(module: Any, result_fn: Callable[[], Any], future: cf.Future[Any] | None) -> Any:
    lambda_future = module.LambdaFuture
    try:
        return lambda_future(result_fn, future=future)
    except TypeError:  # older torch: LambdaFuture(result_fn) only
        made = lambda_future(result_fn)
        made.future = future
        return made


def result(answer: cf.Future[Any]) -> Any:
    """The answer, waiting for it; its error raised afresh (several callers may share it)."""
    exc = answer.exception()
    if exc is not None:
        raise exc.with_traceback(None)
    return answer.result()


def result_or_bundle(answer: cf.Future[Any], installation: Installation, kernel_name: str, source_code: str,
                     graph: Any) -> Any:
    """``result``, with a repro bundle written for a kernel that did not compile, once
    however many callers share its error (the error's ``repro`` names it)."""
    try:
        return result(answer)
    except CompileError as exc:
        root = repro.root_of(installation.scheduler.config)
        if root is not None and exc.repro is None:
            try:
                exc.repro = bundles.kernel_failure(root, exc, kernel_name, source_code, graph)
            except Exception as error:  # noqa: BLE001 - the compile's error is the one to raise
                warnings.warn(f"the repro bundle of {kernel_name!r} could not be written: {error}", RuntimeWarning,
                              stacklevel=2)
        raise


def chain(answer: cf.Future[Any], convert: Callable[[Any], Any]) -> cf.Future[Any]:
    """A future of ``convert(answer's result)``; cancelling it cancels ``answer``."""
    exposed: cf.Future[Any] = cf.Future()

    def forward(done: cf.Future[Any]) -> None:
        if done.cancelled():
            exposed.cancel()
            return
        if not exposed.set_running_or_notify_cancel():
            return
        exc = done.exception()
        if exc is not None:
            exposed.set_exception(exc)
            return
        try:
            exposed.set_result(convert(done.result()))
        except BaseException as error:  # noqa: BLE001 - it belongs to whoever waits
            exposed.set_exception(error)

    def backward(done: cf.Future[Any]) -> None:
        if done.cancelled():
            answer.cancel()

    exposed.add_done_callback(backward)
    answer.add_done_callback(forward)
    return exposed
