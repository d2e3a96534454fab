"""Triton kernels the tests compile, importable by workers (shipped by reference)."""

import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


ADD_SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}


@triton.jit
def type_error_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    # A pointer cannot be multiplied by a pointer: Triton rejects this at compile time.
    tl.store(x_ptr + offsets, x_ptr * x_ptr)


@triton.jit
def axpy_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    if SQUARE:
        x = x * x
    tl.store(out_ptr + offsets, alpha * x + tl.load(y_ptr + offsets, mask=mask), mask=mask)


@triton.jit
def _check_even(N: tl.constexpr):
    tl.static_assert(N % 2 == 0, "N must be even")


@triton.jit
def _doubled(x, N: tl.constexpr):
    _check_even(N)
    return x * 2


@triton.jit
def even_kernel(x_ptr, N: tl.constexpr):
    # A helper of a helper refuses an odd N: Triton's error for the kernel points at the
    # call of _doubled; the reason is two causes down.
    offsets = tl.arange(0, 16)
    tl.store(x_ptr + offsets, _doubled(tl.load(x_ptr + offsets), N))


@triton.jit
def _tile_product(a, b):
    return tl.dot(a, b)


@triton.jit
def tile_matmul_kernel(a_ptr, b_ptr, c_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One tile of C = A @ B: its dot is in a helper, so only a look at its callees finds it.
    rows, cols, inner = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + rows[:, None] * BLOCK_K + inner[None, :])
    b = tl.load(b_ptr + inner[:, None] * BLOCK_N + cols[None, :])
    tl.store(c_ptr + rows[:, None] * BLOCK_N + cols[None, :], _tile_product(a, b))


MATMUL_SIGNATURE = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32"}
