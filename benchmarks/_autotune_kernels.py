"""Autotuned kernels for ``bench_autotune.py``: a matmul with 24 configurations, and two
autotuned kernels from public libraries, written out here so that the benchmark needs
neither library. Each case builds its launch (fresh tensors on the current GPU) and a
check of the output against torch.

Where they come from:

- ``matmul_kernel``: Triton's tutorial ``python/tutorials/03-matrix-multiplication.py``
  (triton-lang/triton, MIT licence, Copyright 2018-2020 Philippe Tillet, 2020-2022 OpenAI),
  with a longer list of configurations of the tutorial's kind (its 8 for fp16, and 16
  more of the same shapes with deeper K blocks, more stages and more warps).
- ``l2norm_fwd_kernel``: flash-linear-attention, ``fla/modules/l2norm.py``
  (fla-org/flash-linear-attention, MIT licence, Copyright 2023-2025 Songlin Yang, Yu
  Zhang): its 25 configurations (5 ``num_warps`` x 5 ``BT``), ``key=['D', 'NB']``.
- ``_dyt_fwd_kernel``: Liger-Kernel, ``src/liger_kernel/ops/dyt.py`` (linkedin/Liger-Kernel,
  BSD 2-Clause licence, Copyright 2024 LinkedIn Corporation): its 18 configurations
  (``BLOCK_N`` x ``num_stages`` x ``num_warps``), ``key=['N']``.
"""

from __future__ import annotations

from typing import Any, Callable

import triton
import triton.language as tl

try:
    from triton.language.extra.libdevice import tanh
except ImportError:  # pragma: no cover - older Triton layouts, as Liger-Kernel handles them
    from triton.language.extra.cuda.libdevice import tanh

# -- Triton tutorial 03: matrix multiplication ----------------------------------------------


def _matmul_configs() -> list[Any]:
    shapes = [
        # The tutorial's configurations for fp16 on CUDA:
        (128, 256, 64, 3, 8), (64, 256, 32, 4, 4), (128, 128, 32, 4, 4), (128, 64, 32, 4, 4),
        (64, 128, 32, 4, 4), (128, 32, 32, 4, 4), (64, 32, 32, 5, 2), (32, 64, 32, 5, 2),
        # More of the same kind:
        (128, 256, 64, 4, 8), (256, 128, 64, 3, 8), (256, 128, 64, 4, 8), (256, 64, 64, 4, 4),
        (64, 256, 64, 4, 4), (128, 128, 64, 3, 4), (128, 128, 64, 4, 8), (128, 128, 64, 5, 8),
        (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (128, 128, 128, 3, 8),
        (128, 64, 128, 3, 4), (64, 128, 128, 3, 4), (64, 64, 128, 4, 4), (256, 64, 32, 4, 8),
    ]
    return [triton.Config({"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": 8},
                          num_stages=stages, num_warps=warps) for m, n, k, stages, warps in shapes]


@triton.autotune(configs=_matmul_configs(), key=["M", "N", "K"])
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                  GROUP_SIZE_M: tl.constexpr):
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    offs_am = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)) % M
    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_ptr + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_SIZE_K, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_SIZE_K, other=0.0)
        accumulator = tl.dot(a, b, accumulator)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    c = accumulator.to(tl.float16)
    offs_cm = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + stride_cm * offs_cm[:, None] + stride_cn * offs_cn[None, :]
    c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
    tl.store(c_ptrs, c, mask=c_mask)


def matmul_case(size: int = 4096) -> tuple[Any, tuple[Any, ...], dict[str, Any], Any, Callable[[], float]]:
    import torch

    torch.manual_seed(0)
    a = torch.randn((size, size), device="cuda", dtype=torch.float16)
    b = torch.randn((size, size), device="cuda", dtype=torch.float16)
    c = torch.empty((size, size), device="cuda", dtype=torch.float16)
    M, K = a.shape
    _, N = b.shape

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(M, meta["BLOCK_SIZE_M"]) * triton.cdiv(N, meta["BLOCK_SIZE_N"]),)

    args = (a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    return matmul_kernel, args, {}, grid, lambda: float((c.float() - (a @ b).float()).abs().max())


# -- flash-linear-attention: l2norm forward -----------------------------------------------------

BT_LIST = [8, 16, 32, 64, 128]


@triton.autotune(
    configs=[triton.Config({"BT": BT}, num_warps=num_warps) for num_warps in [1, 2, 4, 8, 16] for BT in BT_LIST],
    key=["D", "NB"],
)
@triton.jit
def l2norm_fwd_kernel(x, y, rstd, eps, T, D: tl.constexpr, BD: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr):
    i_t = tl.program_id(0)
    p_x = tl.make_block_ptr(x, (T, D), (D, 1), (i_t * BT, 0), (BT, BD), (1, 0))
    p_y = tl.make_block_ptr(y, (T, D), (D, 1), (i_t * BT, 0), (BT, BD), (1, 0))
    p_rstd = tl.make_block_ptr(rstd, (T,), (1,), (i_t * BT,), (BT,), (0,))
    b_x = tl.load(p_x, boundary_check=(0, 1)).to(tl.float32)
    b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)
    b_y = b_x * b_rstd[:, None]
    tl.store(p_y, b_y.to(p_y.dtype.element_ty), boundary_check=(0, 1))
    tl.store(p_rstd, b_rstd.to(p_rstd.dtype.element_ty), boundary_check=(0,))


def l2norm_case(rows: int = 1 << 18, dim: int = 128) -> tuple[Any, tuple[Any, ...], dict[str, Any], Any,
                                                             Callable[[], float]]:
    import torch

    torch.manual_seed(0)
    x = torch.randn((rows, dim), device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rstd = torch.empty((rows,), dtype=torch.float32, device="cuda")
    T, D = x.shape
    BD = triton.next_power_of_2(D)
    NB = triton.cdiv(T, 2048)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(T, meta["BT"]),)

    # As fla launches it: everything by keyword.
    kwargs = {"x": x, "y": y, "rstd": rstd, "eps": 1e-6, "T": T, "D": D, "BD": BD, "NB": NB}

    def check() -> float:
        expected = torch.nn.functional.normalize(x.float(), dim=-1, eps=1e-6)
        return float((y.float() - expected).abs().max())

    return l2norm_fwd_kernel, (), kwargs, grid, check


# -- Liger-Kernel: DyT forward ------------------------------------------------------------------


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn}, num_stages=ns, num_warps=nw)
        for bn in [1024, 2048, 4096]
        for ns in [1, 2]
        for nw in [4, 8, 16]
    ],
    key=["N"],
)
@triton.jit
def _dyt_fwd_kernel(X, Y, Alpha, Gamma, Beta, HAVE_BETA: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr):
    col = tl.cast(tl.program_id(0), tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = col < N
    row_id = tl.cast(tl.program_id(1), tl.int64)

    X += row_id * N
    Y += row_id * N
    alpha = tl.load(Alpha).to(tl.float32)

    gamma = tl.load(Gamma + col, mask=mask, other=0.0).to(tl.float32)

    x = tl.load(X + col, mask=mask, other=0.0).to(tl.float32)

    tanh_x = tanh(alpha * x)
    y = tanh_x * gamma
    if HAVE_BETA:
        beta = tl.load(Beta + col, mask=mask, other=0.0).to(tl.float32)
        y += beta
    tl.store(Y + col, y, mask=mask)


def dyt_case(rows: int = 8192, dim: int = 4096) -> tuple[Any, tuple[Any, ...], dict[str, Any], Any,
                                                         Callable[[], float]]:
    import torch

    torch.manual_seed(0)
    x = torch.randn((rows, dim), device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    alpha = torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16)
    gamma = torch.randn((dim,), device="cuda", dtype=torch.bfloat16)
    beta = torch.randn((dim,), device="cuda", dtype=torch.bfloat16)
    M, N = x.shape

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(N, meta["BLOCK_N"]), M)

    def check() -> float:
        expected = torch.tanh(alpha.float() * x.float()) * gamma.float() + beta.float()
        return float((y.float() - expected).abs().max())

    return _dyt_fwd_kernel, (x, y, alpha, gamma, beta, True, N), {}, grid, check


CASES: dict[str, Callable[[], tuple[Any, tuple[Any, ...], dict[str, Any], Any, Callable[[], float]]]] = {
    "matmul_fp16_4096": matmul_case,
    "fla_l2norm_fwd": l2norm_case,
    "liger_dyt_fwd": dyt_case,
}
