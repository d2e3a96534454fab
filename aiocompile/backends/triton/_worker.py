"""The Triton backend's side inside a worker process.

Importing this module does not import Triton, so the parent can name these functions in a
job without paying for Triton itself.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiocompile._pool.procs import environment
from aiocompile.backends.triton._ship import Resolver
from aiocompile.errors import CompileError

_resolver = Resolver()
_warm_kernels: dict[str, Any] = {}


def _tiny_kernel() -> Any:
    kernel = _warm_kernels.get("add")
    if kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _aiocompile_warm_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            x = tl.load(x_ptr + offsets, mask=mask)
            y = tl.load(y_ptr + offsets, mask=mask)
            tl.store(out_ptr + offsets, x + y, mask=mask)

        kernel = _warm_kernels["add"] = _aiocompile_warm_add
    return kernel


def _compile_tiny(target: Any, block: int) -> float:
    import triton
    from triton.compiler import ASTSource

    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    started = time.perf_counter()
    triton.compile(ASTSource(_tiny_kernel(), signature, {"BLOCK": block}), target=target, options={"num_warps": 1})
    return time.perf_counter() - started


def prepare_process() -> Iterator[None]:
    """Preload hook (see ``aiocompile._pool.zygote.Preload``): import Triton and compute its
    expensive one-time state, so that processes forked afterwards have it for free.

    ``triton_key()`` hashes all of Triton's sources and its shared library, the costliest
    step of a first key, and is memoised per process. It comes before the fork server is ready: the parent
    computes it at the same time for its first key, so it is not on the first kernel's
    path twice, and no worker ever computes it again.

    Then, one step at a time while nobody waits for a fork, a throw-away compile per
    vendor loads MLIR, LLVM and the backend. It runs single-threaded
    (``MLIR_DISABLE_MULTITHREADING``) in a scratch cache directory: forking a process that
    has started threads is unsafe, and the user's cache is not ours to fill. So only a
    process of aiocompile's own takes the steps after the first ``yield``: the fork server.
    """
    import triton  # noqa: F401
    from triton.backends.compiler import GPUTarget
    from triton.runtime.cache import triton_key

    triton_key()
    for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
        yield
        _scratch_compile(target)


def _scratch_compile(target: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="aiocompile-warm-") as scratch:
        with environment({"MLIR_DISABLE_MULTITHREADING": "1", "TRITON_CACHE_DIR": scratch}):
            try:
                _compile_tiny(target, 64)
            except Exception:
                pass  # a backend this Triton build lacks only stays cold


def warm_up(target: tuple[str, Any, int]) -> float:
    """One tiny real compile in this worker (``Scheduler.warm``), bypassing Triton's
    cache so that the compiler's per-process set-up is really paid."""
    from triton.backends.compiler import GPUTarget

    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    try:
        return _compile_tiny(GPUTarget(*target), 128)
    finally:
        os.environ.pop("TRITON_ALWAYS_COMPILE", None)


def detect_target() -> tuple[str, Any, int]:
    """The current device's target, asked of the GPU driver here rather than in the
    parent, so that the parent does not initialise the driver on our account."""
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


def _format_error(exc: BaseException) -> str:
    text = str(exc).strip()
    name = type(exc).__name__
    if not text:
        return name
    return text if name in ("CompilationError",) or text.startswith(name) else f"{name}: {text}"


def _format_chain(exc: BaseException) -> str:
    """``exc``'s message followed by those of its causes. Triton reports a failure inside
    a ``@jit`` helper as an error pointing at the helper's call site; the helper's own
    error, which says what went wrong ("N must be even"), is only its ``__cause__``, and
    a traceback does not cross to the parent."""
    parts = [_format_error(exc)]
    seen = {id(exc)}
    link = exc
    for _ in range(16):
        if link.__cause__ is not None:
            how, following = "caused by", link.__cause__
        elif link.__context__ is not None and not link.__suppress_context__:
            how, following = "while handling", link.__context__
        else:
            break
        if id(following) in seen:
            break
        link = following
        seen.add(id(link))
        text = _format_error(link)
        if not any(text in part for part in parts):
            parts.append(f"{how} {text}")
    return "\n\n".join(parts)


def compile_kernel(spec: Any) -> dict[str, Any]:
    """Compile one ``TritonSpec``; returns the artifact as plain data (text and bytes)."""
    import triton

    try:
        fn = _resolver.resolve(spec.kernel)
        arg_names = list(fn.arg_names)
        if arg_names != list(spec.arg_names):
            raise TypeError(
                f"the kernel the worker loaded takes ({', '.join(arg_names)}), not "
                f"({', '.join(spec.arg_names)}); was its module changed after it was imported?"
            )
        started = time.perf_counter()
        with StageTimes() as stages:
            compiled = triton.compile(spec.ast_source(fn), target=spec.target.to_gpu_target(),
                                      options=dict(spec.options))
        compile_time = time.perf_counter() - started
    except CompileError:
        raise
    except Exception as exc:
        raise CompileError(_format_chain(exc), kernel_name=spec.name, key=spec.key, target=str(spec.target)) from None
    metadata_path = next(Path(p) for name, p in compiled.metadata_group.items() if name.endswith(".json"))
    asm = {ext: value for ext, value in compiled.asm.items() if isinstance(value, (str, bytes))}
    return {
        "name": compiled.name,
        "hash": compiled.hash,
        "metadata_json": metadata_path.read_text(),
        "asm": asm,
        "compile_time": compile_time,
        "stages": stages.stages,
        "cache_hit": stages.cache_hit,
        "triton_version": triton.__version__,
    }


class StageTimes:
    """Triton's per-stage compile times, through its compilation listener
    (``knobs.compilation.listener``, Triton 3.4 and later; nothing on older ones), while
    the ``with`` block runs.

    Stages come in Triton's order, in seconds: ``make_ir`` (Python AST to the first IR),
    then one per lowering stage named by its file extension (``ttir``, ``ttgir``,
    ``llir``, ``ptx``/``amdgcn``, ``cubin``/``hsaco``), then ``store`` (writing Triton's
    cache). Several compiles in one block (an Inductor autotuner's configurations) are
    summed per stage. ``cache_hit`` is True when every compile was found in Triton's own
    disk cache, False when any was built, None when none was reported.
    """

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}
        self.cache_hit: bool | None = None
        self._knobs: Any = None
        self._previous: Any = None

    @property
    def stages(self) -> list[tuple[str, float]]:
        return list(self._totals.items())

    def __enter__(self) -> StageTimes:
        try:
            from triton import knobs
        except ImportError:
            return self
        if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
            return self
        self._knobs = knobs
        self._previous = knobs.compilation.listener
        knobs.compilation.listener = self._listen
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._knobs is not None:
            self._knobs.compilation.listener = self._previous

    def _listen(self, *, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        self.cache_hit = bool(cache_hit) if self.cache_hit is None else (self.cache_hit and bool(cache_hit))
        if not cache_hit:
            stages = [("make_ir", times.ir_initialization)]
            stages.extend((str(name), duration) for name, duration in times.lowering_stages)
            stages.append(("store", times.store_results))
            for name, duration in stages:
                self._totals[name] = self._totals.get(name, 0.0) + duration / 1e6  # microseconds
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                           cache_hit=cache_hit)
