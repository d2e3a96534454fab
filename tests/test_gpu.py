"""On a GPU: compile through the pool, launch, and compare with torch.

Run with ``pytest -m gpu``; skipped where torch or a CUDA device is missing. The tests
are plain functions around ``asyncio.run`` so they need no async plugin.
"""

import asyncio

import pytest
from conftest import example_spec

import aiocompile

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def sched():
    scheduler = aiocompile.Scheduler(workers=4)
    yield scheduler
    scheduler.close()


def compile_example(sched, label, **overrides):
    spec = {**example_spec(label), **overrides}
    return asyncio.run(sched.compile_triton(**spec))


def test_current_device_target(sched):
    # target=None: the parent has not touched CUDA yet, so a worker asks the driver.
    kernel = compile_example(sched, "add_fp32")
    major, minor = torch.cuda.get_device_capability()
    assert kernel.target == f"cuda:{major * 10 + minor}"


@pytest.mark.parametrize(("label", "dtype"), [("add_fp32", torch.float32), ("add_fp16", torch.float16)])
def test_add(sched, label, dtype):
    kernel = compile_example(sched, label)
    n = 98_432
    x = torch.rand(n, device="cuda", dtype=dtype)
    y = torch.rand(n, device="cuda", dtype=dtype)
    out = torch.empty_like(x)
    kernel[lambda meta: (triton_cdiv(n, meta["BLOCK"]),)](x, y, out, n)
    torch.testing.assert_close(out, x + y)


def triton_cdiv(a, b):
    return (a + b - 1) // b


@pytest.mark.parametrize(("label", "n_cols"), [("softmax_1024", 781), ("softmax_4096", 4096)])
def test_softmax(sched, label, n_cols):
    kernel = compile_example(sched, label)
    x = torch.randn(1823, n_cols, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    kernel[(x.shape[0],)](y, x, x.stride(0), y.stride(0), n_cols)
    torch.testing.assert_close(y, torch.softmax(x, dim=1))


@pytest.mark.parametrize(
    ("label", "dtype", "tolerance"),
    [
        ("matmul_fp16_128x128x64", torch.float16, 1e-2),
        ("matmul_fp16_128x64x32", torch.float16, 1e-2),
        ("matmul_fp16_64x128x32", torch.float16, 1e-2),
        ("matmul_fp16_64x64x32", torch.float16, 1e-2),
        # fp32 inputs go through tf32 tensor cores by default, as torch does with TF32 on.
        ("matmul_fp32_64x64x32", torch.float32, 2e-2),
    ],
)
def test_matmul(sched, label, dtype, tolerance):
    kernel = compile_example(sched, label)
    M, N, K = 512, 384, 320
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype)
    c = torch.empty(M, N, device="cuda", dtype=dtype)
    grid = lambda meta: (triton_cdiv(M, meta["BLOCK_M"]) * triton_cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    expected = (a.float() @ b.float()).to(dtype)
    torch.testing.assert_close(c, expected, rtol=tolerance, atol=tolerance * K ** 0.5)


@pytest.mark.parametrize(("label", "n_cols"), [("layer_norm_1024", 1000), ("layer_norm_4096", 4096)])
def test_layer_norm(sched, label, n_cols):
    kernel = compile_example(sched, label)
    x = torch.randn(512, n_cols, device="cuda", dtype=torch.float16)
    w = torch.rand(n_cols, device="cuda", dtype=torch.float16)
    b = torch.rand(n_cols, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    kernel[(x.shape[0],)](x, y, w, b, x.stride(0), n_cols, 1e-5)
    expected = torch.nn.functional.layer_norm(x.float(), (n_cols,), w.float(), b.float(), 1e-5).half()
    torch.testing.assert_close(y, expected, rtol=1e-2, atol=1e-2)


def test_load_ahead_and_launch_a_kernel_read_back_from_bytes(sched):
    built = compile_example(sched, "add_fp16")
    kernel = aiocompile.TritonKernel.from_bytes(built.to_bytes())
    assert not kernel.loaded
    asyncio.run(kernel.load())
    assert kernel.loaded
    x = torch.rand(4096, device="cuda", dtype=torch.float16)
    out = torch.empty_like(x)
    kernel[(4,)](x_ptr=x, y_ptr=x, out_ptr=out, n=4096)
    torch.testing.assert_close(out, x + x)


def bf16_signature(label):
    signature = example_spec(label)["signature"]
    return {arg: ("*bf16" if ty.startswith("*") else ty) for arg, ty in signature.items()}


def test_bf16_kernels(sched):
    n = 10_000
    x, y = (torch.rand(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(x)
    add = compile_example(sched, "add_fp32", signature=bf16_signature("add_fp32"))
    add[(triton_cdiv(n, 1024),)](x, y, out, n)
    torch.testing.assert_close(out, x + y)

    rows = torch.randn(300, 781, device="cuda", dtype=torch.bfloat16)
    soft = torch.empty_like(rows)
    softmax = compile_example(sched, "softmax_1024", signature=bf16_signature("softmax_1024"))
    softmax[(rows.shape[0],)](soft, rows, rows.stride(0), soft.stride(0), rows.shape[1])
    torch.testing.assert_close(soft, torch.softmax(rows.float(), dim=1).to(torch.bfloat16), rtol=2e-2, atol=1e-2)

    w, b = (torch.rand(781, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    normed = torch.empty_like(rows)
    norm = compile_example(sched, "layer_norm_1024", signature=bf16_signature("layer_norm_1024"))
    norm[(rows.shape[0],)](rows, normed, w, b, rows.stride(0), rows.shape[1], 1e-5)
    expected = torch.nn.functional.layer_norm(rows.float(), (781,), w.float(), b.float(), 1e-5)
    torch.testing.assert_close(normed, expected.to(torch.bfloat16), rtol=2e-2, atol=2e-2)

    M, N, K = 256, 192, 128
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    bt = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    matmul = compile_example(sched, "matmul_fp16_64x64x32", signature=bf16_signature("matmul_fp16_64x64x32"))
    grid = (triton_cdiv(M, 64) * triton_cdiv(N, 64),)
    matmul[grid](a, bt, c, M, N, K, a.stride(0), a.stride(1), bt.stride(0), bt.stride(1), c.stride(0), c.stride(1))
    torch.testing.assert_close(c, (a.float() @ bt.float()).to(torch.bfloat16), rtol=2e-2, atol=2e-2 * K ** 0.5)


def test_warmup_primes_the_jit_so_the_ordinary_launch_compiles_nothing(sched):
    from triton import knobs
    from triton_kernels import axpy_kernel

    axpy_kernel.device_caches.clear()  # as in a process that has not launched it yet
    n = 98_304
    x, y = (torch.rand(n, device="cuda") for _ in range(2))
    out = torch.empty_like(x)
    grid = lambda meta: (triton_cdiv(n, meta["BLOCK"]),)  # noqa: E731
    kernel = asyncio.run(sched.warmup(axpy_kernel, x, y, out, 2.0, n, grid=grid, BLOCK=1024))
    assert kernel.target == f"cuda:{torch.cuda.get_device_capability()[0] * 10 + torch.cuda.get_device_capability()[1]}"

    compiles = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: compiles.append(kw["key"]) or False
    try:
        axpy_kernel[grid](x, y, out, 2.0, n, BLOCK=1024)  # the serving code, unchanged
        torch.cuda.synchronize()
        assert compiles == []
        torch.testing.assert_close(out, 2.0 * x + y)
        # A launch the warm-up did not cover does compile: the hook is live.
        axpy_kernel[grid](x, y, out, 2.0, n - 1, BLOCK=1024)
        assert len(compiles) == 1
    finally:
        knobs.runtime.jit_cache_hook = previous


def test_the_loop_keeps_ticking_while_32_kernels_compile_and_load():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_loop_lag

    result = asyncio.run(bench_loop_lag.with_aiocompile(None, load=True))
    assert result["kernels"] == 32 and result["ticks"] > 100
    print(f"\nloop lag while 32 kernels compiled and loaded: p50 {result['p50_ms']:.2f} ms, "
          f"p99 {result['p99_ms']:.2f} ms, max {result['max_ms']:.1f} ms over {result['ticks']} ticks")
    # A compile held in the loop would show as hundreds of milliseconds.
    assert result["max_ms"] < 50


def test_warm_pays_the_one_time_cost_of_loading_before_the_first_load():
    """After ``warm()``, Triton's GPU driver and the device's context are set up, in a
    loading thread, so the first loads in a burst do not pay for them (holding the
    interpreter lock for hundreds of milliseconds: the event loop's thread would wait)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import asyncio, logging, sys, torch\n"
        "import aiocompile\n"
        "logging.getLogger('aiocompile').addHandler(logging.StreamHandler())\n"  # why priming failed, if it did
        "logging.getLogger('aiocompile').setLevel(logging.DEBUG)\n"
        "from aiocompile.backends.triton import _kernel as _triton_kernel\n"
        "assert not torch.cuda.is_initialized()\n"
        "async def main():\n"
        "    async with aiocompile.Scheduler(workers=2) as sched:\n"
        "        await sched.warm('cuda:90')\n"
        "        print(_triton_kernel._primed, torch.cuda.is_initialized())\n"
        "asyncio.run(main())\n"
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["True", "True"], proc.stdout + proc.stderr[-4000:]
