"""Autotuned Triton kernels for the tuning tests, importable by workers (shipped by
reference). ``MODE`` and ``COST`` are constexprs the stand-in timer reads (see
``tuning_stand_in``); the kernels ignore them."""

import triton
import triton.language as tl


@triton.jit
def scale_base(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr, MODE: tl.constexpr, COST: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * factor, mask=mask)


def config(block, mode=0, cost=1, num_warps=4, num_stages=3):
    return triton.Config({"BLOCK": block, "MODE": mode, "COST": cost}, num_warps=num_warps, num_stages=num_stages)


def tuned(configs, key=("n",), **options):
    """A fresh autotuner over ``scale_base`` (its own cache, as a new process would have)."""
    return triton.autotune(configs=list(configs), key=list(key), **options)(scale_base)


def grid(meta):
    return (triton.cdiv(meta["n"], meta["BLOCK"]),)


# -- kernels with heuristics around the autotuner ------------------------------------------


@triton.jit
def masked_base(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr, WIDE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets))
    else:
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)


# @triton.heuristics below the autotuner: computed from each configuration's BLOCK.
inner_heuristics = triton.autotune(
    configs=[triton.Config({"BLOCK": b, "WIDE": 0}, num_warps=w) for b, w in ((64, 2), (128, 4), (256, 4), (512, 8))],
    key=["n"],
)(triton.heuristics({"EVEN": lambda args: args["n"] % args["BLOCK"] == 0})(masked_base))

# @triton.heuristics above the autotuner: WIDE, from the arguments, is part of what it sees.
outer_heuristics = triton.heuristics({"WIDE": lambda args: int(args["n"] > 10_000)})(
    triton.autotune(
        configs=[triton.Config({"BLOCK": b, "EVEN": 0}, num_warps=w, num_stages=s)
                 for b, w, s in ((64, 2, 2), (128, 4, 3), (256, 8, 4))],
        key=["n", "WIDE"],
    )(masked_base)
)


def _keep_wide_blocks(configs, named_args, **kwargs):
    # Sees what Triton gives early_config_prune: the configurations, the arguments by
    # name, and the launch's keywords (grid and warmup among them).
    assert "grid" in kwargs and "warmup" in kwargs
    return [c for c in configs if c.kwargs["BLOCK"] * 4 <= named_args["n"]]


def _model(**kwargs):
    # A made-up performance model: bigger blocks are "faster" for big n.
    return abs(kwargs["n"] / kwargs["BLOCK"] - 64) + kwargs["num_warps"]


pruned_early = triton.autotune(
    configs=[config(b, num_warps=w) for b in (64, 128, 256, 1024, 4096) for w in (2, 4)],
    key=["n"],
    prune_configs_by={"early_config_prune": _keep_wide_blocks},
)(scale_base)

pruned_by_model = triton.autotune(
    configs=[config(b, num_warps=w) for b in (32, 64, 128, 256, 512) for w in (2, 4)],
    key=["n"],
    prune_configs_by={"perf_model": _model, "top_k": 3},
)(scale_base)

pruned_both = triton.autotune(
    configs=[config(b, num_warps=w) for b in (64, 128, 256, 1024) for w in (1, 2, 4, 8)],
    key=["n"],
    prune_configs_by={"early_config_prune": _keep_wide_blocks, "perf_model": _model, "top_k": 0.5},
)(scale_base)


@triton.jit
def accumulate_base(x_ptr, total_ptr, n, BLOCK: tl.constexpr, MODE: tl.constexpr, COST: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(total_ptr, tl.sum(tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)))


accumulate = triton.autotune(
    configs=[config(b, cost=c) for b, c in ((64, 30), (128, 20), (256, 40))],
    key=["n"],
    reset_to_zero=["total_ptr"],
)(accumulate_base)
