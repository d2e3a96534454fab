"""What compile_triton makes of its kernel: the whole story of a compile error in a
helper, constexpr defaults, and a TritonSource's imports. Real compiles, for cuda:80."""

import pickle

import pytest
from triton_kernels import ADD_SIGNATURE, axpy_kernel, even_kernel

import aiocompile

AXPY_SIGNATURE = {**ADD_SIGNATURE, "alpha": "fp32"}


async def test_a_compile_error_in_a_helper_carries_the_helpers_reason(scheduler):
    with pytest.raises(aiocompile.CompileError) as info:
        await scheduler.compile_triton(even_kernel, signature={"x_ptr": "*fp32"}, constexprs={"N": 3},
                                       target="cuda:80")
    exc = info.value
    # Each link of Triton's chain, outermost first: the call of _doubled in the kernel,
    # the call of _check_even in _doubled, and the failed assertion with its message.
    message = exc.message
    assert "N must be even" in message and "N must be even" in str(exc)
    calls = [message.index(text) for text in ("_doubled(tl.load", "_check_even(N)", "tl.static_assert(N % 2")]
    assert calls == sorted(calls)
    assert message.count("caused by ") == 2
    assert "N must be even" in str(pickle.loads(pickle.dumps(exc)))
    # The same kernel with an even N compiles.
    kernel = await scheduler.compile_triton(even_kernel, signature={"x_ptr": "*fp32"}, constexprs={"N": 4},
                                            target="cuda:80")
    assert kernel.name == "even_kernel"


# -- constexpr defaults ---------------------------------------------------------------------


async def test_a_constexpr_with_a_default_takes_it_and_is_the_same_kernel_as_given(scheduler):
    left_out = await scheduler.compile_triton(axpy_kernel, signature=AXPY_SIGNATURE, constexprs={"BLOCK": 64},
                                              target="cuda:80")
    assert left_out.constexprs == {"BLOCK": 64, "SQUARE": False}
    assert left_out.key == left_out.metadata["hash"]  # the hash Triton gave what it compiled
    given = await scheduler.compile_triton(axpy_kernel, signature=AXPY_SIGNATURE,
                                           constexprs={"BLOCK": 64, "SQUARE": False}, target="cuda:80")
    assert given is left_out
    typed = await scheduler.compile_triton(axpy_kernel, signature={**AXPY_SIGNATURE, "SQUARE": "constexpr"},
                                           constexprs={"BLOCK": 64}, target="cuda:80")
    assert typed is left_out
    squared = await scheduler.compile_triton(axpy_kernel, signature=AXPY_SIGNATURE,
                                             constexprs={"BLOCK": 64, "SQUARE": True}, target="cuda:80")
    assert squared.key != left_out.key
    with pytest.raises(ValueError, match="BLOCK"):  # no default: still required
        await scheduler.compile_triton(axpy_kernel, signature=AXPY_SIGNATURE, target="cuda:80")


async def test_the_default_is_what_tritons_own_jit_passes(scheduler):
    torch = pytest.importorskip("torch", reason="example tensors come from torch")
    from aiocompile.backends.triton import _warmup as _triton_warmup

    # Triton's own binder specialises a launch that leaves SQUARE out...
    plan = _triton_warmup.plan(axpy_kernel, (torch.float32, torch.float32, torch.float32, 2.0, 1000),
                               {"BLOCK": 64}, "cuda:80")
    request = plan.request()
    assert request["constexprs"]["SQUARE"] is False
    from_jit = await scheduler.compile_triton(plan.fn, **request)
    # ... and the same request with SQUARE left out here comes to the same key.
    left_out = await scheduler.compile_triton(
        axpy_kernel, **{**request, "signature": {k: v for k, v in request["signature"].items() if k != "SQUARE"},
                        "constexprs": {"BLOCK": 64}})
    assert left_out is from_jit and left_out.key == left_out.metadata["hash"]


DEFAULTS_SOURCE = """
from __future__ import annotations

import triton
import triton.language as tl

DEFAULT_BLOCK = 64


@triton.jit
def fill(out_ptr, n, value, BLOCK: tl.constexpr = DEFAULT_BLOCK, TWICE: tl.constexpr = 1, k=3):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, value * (2 if TWICE else 1), mask=offsets < n)
"""
FILL_SIGNATURE = {"out_ptr": "*fp32", "n": "i32", "value": "fp32", "k": "i32"}


async def test_a_triton_source_takes_its_defaults_too(scheduler):
    source = aiocompile.TritonSource(DEFAULTS_SOURCE, "fill")
    assert source.defaulted == ("BLOCK", "TWICE")  # k's default is no constexpr's
    left_out = await scheduler.compile_triton(source, signature=FILL_SIGNATURE, target="cuda:80")
    assert left_out.constexprs == {"BLOCK": 64, "TWICE": 1}
    given = await scheduler.compile_triton(source, signature=FILL_SIGNATURE, constexprs={"BLOCK": 64, "TWICE": 1},
                                           target="cuda:80")
    assert given is left_out and left_out.key == left_out.metadata["hash"]
    # A runtime argument with a default still needs its type.
    with pytest.raises(ValueError, match="missing type for argument 'k'"):
        await scheduler.compile_triton(source, signature={"out_ptr": "*fp32", "n": "i32", "value": "fp32"},
                                       target="cuda:80")


# -- a TritonSource's imports ----------------------------------------------------------------


@pytest.mark.parametrize("line", ["from .helpers import scale", "from . import helpers",
                                  "from ..package.helpers import scale"])
def test_a_triton_source_with_a_relative_import_is_refused_when_made(line):
    text = f"import triton\n{line}\n\n@triton.jit\ndef k(x_ptr):\n    pass\n"
    with pytest.raises(ValueError, match="relative import on line 2") as info:
        aiocompile.TritonSource(text, "k")
    assert line in str(info.value) and "standalone module" in str(info.value)
    assert "absolute names" in str(info.value)


ABSOLUTE_IMPORT_SOURCE = """
import triton
import triton.language as tl
from triton_kernels import add_kernel  # an installed (importable) module, by its absolute name


@triton.jit
def add_twice(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + x + tl.load(y_ptr + offsets, mask=mask), mask=mask)
"""


async def test_a_triton_source_with_absolute_imports_compiles(scheduler):
    source = aiocompile.TritonSource(ABSOLUTE_IMPORT_SOURCE, "add_twice")
    kernel = await scheduler.compile_triton(source, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64},
                                            target="cuda:80")
    assert kernel.name == "add_twice"
