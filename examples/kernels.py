"""A kernel set to pre-build: vector add, softmax, matmul in several tile configs, layer norm.

``aiocompile build examples/kernels.py --target cuda:90`` compiles every entry of
``KERNELS`` for every target given. Each entry holds ``compile_triton``'s keyword
arguments, the kernel under ``"kernel"`` and a ``"label"`` naming the variant.
"""

import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


@triton.jit
def softmax_kernel(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK: tl.constexpr):
    """Row-wise softmax: one program per row, the whole row in one block."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    numerator = tl.exp(x)
    y = numerator / tl.sum(numerator, axis=0)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C = A @ B with fp32 accumulation, tiles grouped along M for L2 reuse."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    group = pid // group_size
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c = acc.to(c_ptr.dtype.element_ty)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, c, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def layer_norm_kernel(x_ptr, y_ptr, w_ptr, b_ptr, row_stride, n_cols, eps, BLOCK: tl.constexpr):
    """y = (x - mean) / sqrt(var + eps) * w + b, one program per row."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    diff = tl.where(mask, x - mean, 0.0)
    var = tl.sum(diff * diff, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask)
    b = tl.load(b_ptr + cols, mask=mask)
    y = diff * rstd * w + b
    tl.store(y_ptr + row * row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _matmul(label, dtype, block_m, block_n, block_k, num_warps, num_stages):
    return {
        "label": label,
        "kernel": matmul_kernel,
        "signature": {
            "a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}",
            "M": "i32", "N": "i32", "K": "i32",
            "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32",
            "stride_bn": "i32", "stride_cm": "i32", "stride_cn": "i32",
        },
        "constexprs": {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8},
        "num_warps": num_warps,
        "num_stages": num_stages,
    }


def _rowwise(label, kernel, signature, block, num_warps):
    return {"label": label, "kernel": kernel, "signature": signature, "constexprs": {"BLOCK": block},
            "num_warps": num_warps}


_SOFTMAX = {"out_ptr": "*fp32", "in_ptr": "*fp32", "in_row_stride": "i32", "out_row_stride": "i32", "n_cols": "i32"}
_LAYER_NORM = {"x_ptr": "*fp16", "y_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "row_stride": "i32",
               "n_cols": "i32", "eps": "fp32"}

KERNELS = [
    {"label": "add_fp32", "kernel": add_kernel,
     "signature": {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
     "constexprs": {"BLOCK": 1024}, "num_warps": 4},
    {"label": "add_fp16", "kernel": add_kernel,
     "signature": {"x_ptr": "*fp16", "y_ptr": "*fp16", "out_ptr": "*fp16", "n": "i32"},
     "constexprs": {"BLOCK": 1024}, "num_warps": 4},
    _rowwise("softmax_1024", softmax_kernel, _SOFTMAX, 1024, 4),
    _rowwise("softmax_4096", softmax_kernel, _SOFTMAX, 4096, 8),
    _matmul("matmul_fp16_128x128x64", "fp16", 128, 128, 64, 8, 3),
    _matmul("matmul_fp16_128x64x32", "fp16", 128, 64, 32, 4, 4),
    _matmul("matmul_fp16_64x128x32", "fp16", 64, 128, 32, 4, 4),
    _matmul("matmul_fp16_64x64x32", "fp16", 64, 64, 32, 4, 3),
    _matmul("matmul_fp32_64x64x32", "fp32", 64, 64, 32, 4, 3),
    _rowwise("layer_norm_1024", layer_norm_kernel, _LAYER_NORM, 1024, 4),
    _rowwise("layer_norm_4096", layer_norm_kernel, _LAYER_NORM, 4096, 8),
]
