"""On a GPU: CUDA sources compiled through the pool for this very GPU, loaded through
cuda.core and launched, their output compared with torch's.

Run with ``pytest -m gpu``; skipped where torch, a CUDA device, cuda-core or nvcc is
missing. Plain functions around ``asyncio.run``, as in test_gpu.py.
"""

import asyncio
import ctypes

import pytest
from native_sources import VECTOR_ADD, have

import aiocompile

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not have("cuda"), reason="needs nvcc"),
]

SAXPY = """\
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""

# The kernel launched by host code of its own, in a shared library called through ctypes.
HOST_LAUNCH = VECTOR_ADD + """\
extern "C" int launch_vector_add(const float* x, const float* y, float* out, int n) {
    vector_add<<<(n + 255) / 256, 256>>>(x, y, out, n);
    return (int)cudaDeviceSynchronize();
}
"""


@pytest.fixture(scope="module")
def sched():
    pytest.importorskip("cuda.core")
    scheduler = aiocompile.Scheduler(config=aiocompile.SchedulerConfig(workers=4, preload=()))
    yield scheduler
    scheduler.close()


def capability():
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def compile_cuda(sched, source, **kwargs):
    async def main():
        binary = await sched.compile_cuda(source, **kwargs)
        return await binary.load() if kwargs.get("output") != "shared" else binary

    return asyncio.run(main())


def vectors(n=100_003):
    x = torch.rand(n, device="cuda")
    y = torch.rand(n, device="cuda")
    return x, y, torch.empty_like(x), n


def test_a_cubin_for_this_gpu_is_loaded_and_launched(sched):
    binary = compile_cuda(sched, VECTOR_ADD, arch=f"sm_{capability()}", output="cubin")
    assert binary.loaded
    kernel = binary.kernel("vector_add")
    x, y, out, n = vectors()
    kernel[((n + 255) // 256,), (256,)](x, y, out, n)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x + y)
    with pytest.raises(AttributeError, match="no kernel 'not_there'"):
        binary.kernel("not_there")


def test_a_fatbin_whose_only_code_for_this_gpu_is_ptx(sched):
    # sm_80 machine code does not run on a newer major architecture: the driver must pick
    # the PTX and compile it for this GPU.
    arch = ("sm_80", f"compute_{capability()}") if capability() != "80" else ("sm_80",)
    binary = compile_cuda(sched, SAXPY, arch=arch, output="fatbin")
    x, y, _, n = vectors()
    expected = 2.5 * x + y
    binary.kernel("saxpy").launch((n + 127) // 128, 128, 2.5, x, y, n)  # a Python float as the kernel's float
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected)


def test_ptx_is_compiled_by_the_driver(sched):
    binary = compile_cuda(sched, SAXPY, arch=f"compute_{capability()}", output="ptx")
    x, y, _, n = vectors(4096)
    expected = -1.0 * x + y
    binary.kernel("saxpy")[(32,), (128,)](-1.0, x, y, n)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected)


def test_a_binary_from_the_byte_form_launches_as_the_original(sched):
    original = compile_cuda(sched, VECTOR_ADD, arch=f"sm_{capability()}")
    again = aiocompile.CudaBinary.from_bytes(original.to_bytes())
    assert not again.loaded
    x, y, out, n = vectors(1000)
    again.kernel("vector_add")[(4,), (256,)](x, y, out, n)  # loads on first use
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x + y)


def test_a_shared_library_launches_its_kernel_from_its_own_host_code(sched):
    binary = compile_cuda(sched, HOST_LAUNCH, arch=f"sm_{capability()}", output="shared")
    launch = binary.symbol("launch_vector_add", argtypes=(ctypes.c_void_p,) * 3 + (ctypes.c_int,))
    x, y, out, n = vectors()
    torch.cuda.synchronize()
    assert launch(x.data_ptr(), y.data_ptr(), out.data_ptr(), n) == 0  # cudaSuccess
    torch.testing.assert_close(out, x + y)
