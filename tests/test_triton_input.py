"""What compile_triton makes of its kernel: the whole story of a compile error in a
helper, constexpr defaults, and a TritonSource's imports. Real compiles, for cuda:80."""

import pickle

import pytest
from triton_kernels import even_kernel

import aiocompile


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
