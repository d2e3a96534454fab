"""The kernel sets bench_throughput.py compiles, and the functions its worker pools run.

A module of its own (not the script's ``__main__``) so that worker processes of every pool
import it by name. The kernels are those of ``examples/kernels.py`` in more tile, dtype,
block and ``num_warps`` configurations; each spec holds ``compile_triton``'s keyword
arguments, the kernel under ``"kernel"`` and a ``"label"``.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "examples") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "examples"))

import kernels as _examples  # noqa: E402  (examples/kernels.py)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
_MATMUL_TILES = [
    (128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4),
    (64, 64, 32, 4, 3), (64, 64, 64, 4, 4), (32, 64, 32, 2, 4), (64, 32, 32, 2, 5),
    (128, 256, 64, 8, 3), (256, 64, 32, 8, 3), (32, 32, 32, 2, 3),
]
_FP32_MATMUL_TILES = [
    (64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (32, 64, 32, 2, 4), (64, 32, 32, 2, 5), (128, 128, 32, 8, 3),
    (32, 32, 32, 2, 3),
]


def _matmul(dtype: str, tile: tuple[int, int, int, int, int]) -> dict:
    block_m, block_n, block_k, warps, stages = tile
    label = f"matmul_{dtype}_{block_m}x{block_n}x{block_k}_w{warps}_s{stages}"
    spec: dict = _examples._matmul(label, dtype, block_m, block_n, block_k, warps, stages)
    return spec


def _rowwise(name: str, kernel: object, signature: dict, block: int, warps: int) -> dict:
    spec: dict = _examples._rowwise(f"{name}_{block}_w{warps}", kernel, signature, block, warps)
    return spec


def _retyped(signature: dict, dtype: str) -> dict:
    return {name: f"*{dtype}" if kind.startswith("*") else kind for name, kind in signature.items()}


def heavy(target: str) -> list[dict]:
    """The matmul-heavy set: 28 matmuls (the long compiles) interleaved with 36 vector adds,
    softmaxes and layer norms. Its compiles add up to about 12x the longest, so that on 16
    workers every worker is busy for most of the batch."""
    out: list[dict] = []
    for dtype in ("fp16", "bf16"):
        out += [_matmul(dtype, tile) for tile in _MATMUL_TILES]
    out += [_matmul("fp32", tile) for tile in _FP32_MATMUL_TILES]
    add = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    for dtype in ("fp32", "fp16", "bf16"):
        for block, warps in ((256, 2), (1024, 4), (4096, 8)):
            out.append(_rowwise(f"add_{dtype}", _examples.add_kernel, _retyped(add, dtype), block, warps))
    for dtype in ("fp32", "fp16", "bf16"):
        for block, warps in ((512, 4), (1024, 4), (2048, 8), (4096, 8), (8192, 16)):
            out.append(_rowwise(f"softmax_{dtype}", _examples.softmax_kernel, _retyped(_examples._SOFTMAX, dtype),
                                block, warps))
    for dtype in ("fp16", "bf16", "fp32"):
        for block, warps in ((512, 4), (1024, 4), (2048, 8), (4096, 8)):
            signature = {**_retyped(_examples._LAYER_NORM, dtype), "eps": "fp32"}
            out.append(_rowwise(f"layer_norm_{dtype}", _examples.layer_norm_kernel, signature, block, warps))
    # Interleave long and short compiles, as a real request stream would mix them.
    long, short = out[:28], out[28:]
    mixed: list[dict] = []
    while long or short:
        if long:
            mixed.append(long.pop(0))
        if short:
            mixed.append(short.pop(0))
    return mixed


# (dtype, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)): one long compile, the rest short
_MIXED_MATMULS = [
    ("fp16", (128, 256, 64, 8, 3)), ("bf16", (64, 128, 32, 4, 4)), ("fp16", (64, 64, 64, 4, 4)),
    ("bf16", (32, 64, 32, 2, 4)), ("fp16", (64, 32, 32, 2, 5)), ("fp32", (64, 64, 32, 4, 3)),
    ("bf16", (64, 64, 32, 4, 3)), ("fp16", (32, 32, 32, 2, 3)), ("bf16", (32, 32, 32, 2, 3)),
    ("fp16", (16, 32, 32, 1, 2)),
]


def mixed(target: str) -> list[dict]:
    """The mixed set: 10 matmuls, one of them long (128x256 tiles, 8 warps), and 54 vector
    adds, softmaxes and layer norms, in a shuffled order (a fixed seed). Its compiles add up
    to about 7x the longest, so that on 16 workers the longest compile bounds the batch."""
    import random

    out = [_matmul(dtype, tile) for dtype, tile in _MIXED_MATMULS]
    add = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    for dtype in ("fp32", "fp16", "bf16"):
        for block, warps in ((256, 2), (1024, 4), (2048, 4), (4096, 8), (8192, 8), (16384, 16)):
            out.append(_rowwise(f"add_{dtype}", _examples.add_kernel, _retyped(add, dtype), block, warps))
        for block, warps in ((256, 2), (512, 4), (1024, 4), (2048, 8), (4096, 8), (8192, 16)):
            out.append(_rowwise(f"softmax_{dtype}", _examples.softmax_kernel, _retyped(_examples._SOFTMAX, dtype),
                                block, warps))
        for block, warps in ((256, 2), (512, 4), (1024, 4), (2048, 8), (4096, 8), (8192, 16)):
            signature = {**_retyped(_examples._LAYER_NORM, dtype), "eps": "fp32"}
            out.append(_rowwise(f"layer_norm_{dtype}", _examples.layer_norm_kernel, signature, block, warps))
    random.Random(0).shuffle(out)  # requests in no order of their cost
    return out


# 18 matmuls of several tile sizes, one of them long (128x256 tiles, 8 warps)
_ADDS_MATMULS = [
    ("fp16", (128, 256, 64, 8, 3)), ("fp16", (128, 128, 64, 8, 3)), ("fp16", (128, 128, 32, 4, 4)),
    ("fp16", (128, 64, 32, 4, 4)), ("fp16", (64, 128, 32, 4, 4)), ("fp16", (64, 64, 64, 4, 4)),
    ("fp16", (64, 64, 32, 4, 3)), ("fp16", (32, 64, 32, 2, 4)), ("fp16", (32, 32, 32, 2, 3)),
    ("bf16", (128, 128, 32, 4, 4)), ("bf16", (128, 64, 32, 4, 4)), ("bf16", (64, 128, 32, 4, 4)),
    ("bf16", (64, 64, 32, 4, 3)), ("bf16", (32, 64, 32, 2, 4)), ("bf16", (16, 32, 32, 1, 2)),
    ("fp32", (64, 64, 32, 4, 3)), ("fp32", (128, 64, 32, 4, 3)), ("fp32", (32, 32, 32, 2, 3)),
]
_ADD_BLOCKS = [(128, 1), (256, 2), (512, 2), (1024, 4), (2048, 4), (4096, 8), (8192, 8), (16384, 16)]


def adds_matmuls(target: str) -> list[dict]:
    """The first-run set: 32 vector adds and 18 matmuls of several tile sizes, in a
    shuffled order (a fixed seed) that puts the longest compile (the 128x256 matmul) 34th:
    a batch in no order of cost, whose expensive kernel comes among cheap ones. On 16
    workers that compile is the batch's lower bound."""
    import random

    out = [_matmul(dtype, tile) for dtype, tile in _ADDS_MATMULS]
    add = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    for dtype in ("fp32", "fp16", "bf16"):
        for block, warps in _ADD_BLOCKS:
            out.append(_rowwise(f"add_{dtype}", _examples.add_kernel, _retyped(add, dtype), block, warps))
    for dtype in ("fp32", "fp16"):
        for block, warps in ((1024, 8), (2048, 8), (4096, 4), (8192, 16)):
            out.append(_rowwise(f"add_{dtype}", _examples.add_kernel, _retyped(add, dtype), block, warps))
    random.Random(1).shuffle(out)  # requests in no order of their cost
    return out


SETS = {"mixed": mixed, "heavy": heavy, "adds_matmuls": adds_matmuls}
SIZES = {"mixed": 64, "heavy": 64, "adds_matmuls": 50}


def specs(target: str, kind: str = "mixed") -> list[dict]:
    """The distinct kernels of set ``kind`` (``SETS``), each for ``target``."""
    out = SETS[kind](target)
    labels = [spec["label"] for spec in out]
    assert len(out) == SIZES[kind] and len(set(labels)) == SIZES[kind], labels
    return [dict(spec, target=target) for spec in out]


def triton_args(spec: dict) -> tuple:
    """(ASTSource, GPUTarget, options) for ``triton.compile``, from one spec."""
    from triton.compiler import ASTSource

    from aiocompile._base.target import parse_target

    kernel = spec["kernel"]
    signature = dict(spec["signature"])
    constexprs = dict(spec.get("constexprs", {}))
    signature.update({name: "constexpr" for name in constexprs})
    ordered = {name: signature[name] for name in kernel.arg_names}
    options = {k: spec[k] for k in ("num_warps", "num_stages") if k in spec}
    target = parse_target(spec["target"]).to_gpu_target()
    return ASTSource(kernel, ordered, constexprs), target, options


def compile_spec(spec: dict) -> float:
    """``triton.compile`` one spec in this process; the seconds it took."""
    import triton

    src, target, options = triton_args(spec)
    started = time.perf_counter()
    triton.compile(src, target=target, options=options)
    return time.perf_counter() - started


def warm_up(target: str) -> None:
    """One tiny compile in a scratch cache directory: pays the compiler's per-process set-up
    (MLIR and LLVM initialisation, ``triton_key()``) without touching a measured cache."""
    import tempfile

    saved = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as scratch:
        os.environ["TRITON_CACHE_DIR"] = scratch
        try:
            spec = _rowwise("warm", _examples.add_kernel,
                            {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}, 64, 1)
            compile_spec(dict(spec, target=target))
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = saved


def warm_worker(target: str, hold: float) -> int:
    """A pool's warm-up job: the tiny compile, then ``hold`` seconds busy so that the other
    warm-up jobs land on other workers. Returns this worker's pid."""
    warm_up(target)
    time.sleep(hold)
    return os.getpid()


def compile_in_worker(index: int, target: str, cache_dir: str, kind: str = "mixed") -> tuple[int, float]:
    """A pool's job: compile kernel ``index`` of ``specs(target, kind)`` into ``cache_dir``."""
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    return os.getpid(), compile_spec(_specs_for(target, kind)[index])


_SPECS: dict[tuple[str, str], list[dict]] = {}  # per-process memo: a worker builds the list once


def _specs_for(target: str, kind: str) -> list[dict]:
    if (target, kind) not in _SPECS:
        _SPECS[target, kind] = specs(target, kind)
    return _SPECS[target, kind]
