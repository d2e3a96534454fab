"""compile_cuda: real nvcc compiles in real workers, for GPUs this machine need not have."""

import pickle
import struct
import uuid

import anyio
import pytest
from conftest import wait_until
from native_sources import (
    SLOW_CUDA,
    VECTOR_ADD,
    compiler_running,
    have,
    in_group,
    marked,
    needs_nvcc,
)

import aiocompile
from aiocompile.backends._native import _compiler

pytestmark = needs_nvcc

NATIVE = aiocompile.SchedulerConfig(workers=2, preload=())

# A kernel and a host function in one file, for output="shared": the host side is called
# through ctypes, which needs no GPU as long as it launches nothing.
WITH_HOST_CODE = VECTOR_ADD + 'extern "C" int threads_for(int n) { return (n + 255) / 256 * 256; }\n'


@pytest.fixture(scope="module")
def native():
    sched = aiocompile.Scheduler(config=NATIVE)
    yield sched
    sched.close(grace=0)


def fatbin_entries(data):
    """(kind, architecture) of each image in a fatbin: ("elf", 90) for sm_90 machine
    code, ("ptx", 90) for compute_90 PTX. The container: a 16-byte header (magic, version,
    header size, size of the rest), then entries, each with its own header (kind, version,
    header size, size; the architecture at byte 28)."""
    magic, _, header, size = struct.unpack_from("<IHHQ", data)
    assert magic == 0xBA55ED50, "not a fatbin"
    entries, offset = set(), header
    while offset < header + size:
        kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, offset)
        (arch,) = struct.unpack_from("<I", data, offset + 28)
        entries.add(({1: "ptx", 2: "elf"}[kind], arch))
        offset += entry_header + entry_size
    return entries


async def test_cubins_for_two_architectures_with_nvccs_phase_times(native):
    with anyio.fail_after(120):
        binary = await native.compile_cuda(VECTOR_ADD, arch=("sm_80", "sm_90"), output="cubin")
    assert isinstance(binary, aiocompile.CudaBinary)
    assert binary.name == "vector_add" and binary.target == "cuda:sm_80+sm_90" and binary.arch == ("sm_80", "sm_90")
    assert set(binary.images) == {"sm_80", "sm_90"} and binary.binary_ext == "cubin"
    assert all(image[:4] == b"\x7fELF" for image in binary.images.values())
    assert binary.images["sm_80"] != binary.images["sm_90"]
    with pytest.raises(ValueError, match="one cubin per architecture"):
        binary.binary  # noqa: B018 - the property raises
    # One nvcc run per cubin; the stages are nvcc's own (--time), summed over both.
    lines = binary.command.splitlines()
    assert len(lines) == 2 and "-cubin -arch=sm_80" in lines[0] and "-cubin -arch=sm_90" in lines[1]
    assert lines[0].startswith(binary.compiler) and "-ccbin" in lines[0]
    stages = dict(binary.stages)
    assert {"cicc", "ptxas"} <= set(stages) and all(seconds > 0 for seconds in stages.values())
    assert binary.compiler_version and binary.compiler_version in binary.compiler_identity
    record = next(r for r in native.records() if r.key == binary.key)
    assert record.backend == "cuda" and {"cicc", "ptxas"} <= {stage for stage, _ in record.stages}


async def test_a_fatbin_carries_machine_code_and_ptx_for_several_architectures(native):
    with anyio.fail_after(120):
        binary = await native.compile_cuda(VECTOR_ADD, arch=("sm_80", "sm_90", "compute_90"), output="fatbin")
    assert list(binary.images) == ["fatbin"] and binary.binary_ext == "fatbin"
    assert fatbin_entries(binary.binary) == {("elf", 80), ("elf", 90), ("ptx", 90)}
    assert "-gencode=arch=compute_90,code=compute_90" in binary.command
    assert {"cicc", "ptxas", "fatbinary"} <= {stage for stage, _ in binary.stages}


async def test_ptx_per_architecture(native):
    with anyio.fail_after(120):
        binary = await native.compile_cuda(VECTOR_ADD, arch="compute_80", output="ptx")
    assert list(binary.images) == ["compute_80"]
    assert ".target sm_80" in binary.ptx and ".entry vector_add" in binary.ptx
    assert "ptxas" not in dict(binary.stages)  # PTX is what cicc writes: nothing assembles it


async def test_a_shared_library_with_host_code_is_called_through_ctypes(native):
    with anyio.fail_after(120):
        binary = await native.compile_cuda(WITH_HOST_CODE, arch="sm_80", output="shared", name="with_host")
    assert binary.binary[:4] == b"\x7fELF" and binary.binary_ext == "so" and binary.name == "with_host"
    assert "-shared -Xcompiler -fPIC" in binary.command
    assert {"cicc", "ptxas", "nvlink"} <= {stage for stage, _ in binary.stages}
    assert binary.symbol("threads_for")(1000) == 1024
    with pytest.raises(TypeError, match="shared library"):
        binary.kernel("vector_add")


async def test_the_binary_pickles_and_its_bytes_are_checked(native):
    with anyio.fail_after(120):
        binary = await native.compile_cuda(VECTOR_ADD, arch="sm_90")
    again = pickle.loads(pickle.dumps(binary))
    assert (again.key, again.images, again.command, again.stages) == (binary.key, binary.images, binary.command,
                                                                     binary.stages)
    data = binary.to_bytes()
    corrupted = bytearray(data)
    corrupted[-3] ^= 0x01
    for bad in (bytes(corrupted), data[:100], b""):
        with pytest.raises(ValueError):
            aiocompile.CudaBinary.from_bytes(bad)
    with pytest.raises(ValueError, match="cuda-binary"):
        aiocompile.NativeLibrary.from_bytes(data)


async def test_an_edited_header_compiles_anew(tmp_path):
    (tmp_path / "factor.cuh").write_text("#define FACTOR 3.0f\n")
    source = ('#include "factor.cuh"\n'
              'extern "C" __global__ void scale(float* x) { x[threadIdx.x] *= FACTOR; }\n')
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with anyio.fail_after(120):
            first = await sched.compile_cuda(source, arch="compute_90", output="ptx", include_dirs=(tmp_path,))
            assert await sched.compile_cuda(source, arch="compute_90", output="ptx",
                                            include_dirs=(tmp_path,)) is first
            (tmp_path / "factor.cuh").write_text("#define FACTOR 5.0f\n")
            second = await sched.compile_cuda(source, arch="compute_90", output="ptx", include_dirs=(tmp_path,))
        assert second.key != first.key
        assert "0f40400000" in first.ptx and "0f40A00000" in second.ptx  # 3.0f, then 5.0f
        assert [r.outcome for r in sched.records()] == ["compiled", "cache_hit", "compiled"]
    finally:
        await sched.aclose()


async def test_a_compile_error_carries_nvccs_diagnostics_and_the_command_line():
    source = 'extern "C" __global__ void k(int* x) {\n\n    x[0] = undefined_thing;\n}\n'
    sched = aiocompile.Scheduler(config=NATIVE.with_changes(workers=1))
    try:
        with anyio.fail_after(120):
            with pytest.raises(aiocompile.CompileError) as info:
                await sched.compile_cuda(source, arch="sm_90")
        error = info.value
        assert type(error) is aiocompile.CompileError and error.kernel_name == "k" and error.target == "cuda:sm_90"
        assert 'source.cu(3): error: identifier "undefined_thing" is undefined' in str(error)
        assert error.command.endswith("-cubin -arch=sm_90 -o sm_90.cubin source.cu --time sm_90.time")
        assert f"command: {error.command}" in error.message
        stats = sched.statistics()
        assert (stats.failed, stats.worker_crashes) == (1, 0)
    finally:
        await sched.aclose()


async def test_nvcc_exiting_0_without_the_binary_is_a_compile_error(native):
    with anyio.fail_after(60):
        with pytest.raises(aiocompile.CompileError) as info:
            await native.compile_cuda(VECTOR_ADD, arch="sm_90", flags=("--help",))
    error = info.value
    assert type(error) is aiocompile.CompileError and error.kernel_name == "vector_add"
    assert "nvcc exited with status 0 without writing sm_90.cubin" in error.message
    assert "--help" in error.output  # nvcc's help, which it printed instead


async def test_a_missing_compiler_is_a_clear_error_before_any_worker(tmp_path):
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with pytest.raises(aiocompile.CompilerNotFound, match="no executable file"):
            await sched.compile_cuda(VECTOR_ADD, compiler=tmp_path / "nvcc")
        assert (sched.statistics().submitted, sched.worker_pids()) == (0, [])
    finally:
        await sched.aclose()


@pytest.mark.skipif(have("hip"), reason="hipcc is installed here")
async def test_without_hipcc_an_amd_architecture_says_what_is_missing():
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with pytest.raises(aiocompile.CompilerNotFound, match="no ROCm \\(HIP\\) compiler found.*hipcc.*ROCM_PATH"):
            await sched.compile_cuda(VECTOR_ADD, arch="gfx942")
        assert sched.worker_pids() == []
    finally:
        await sched.aclose()


@pytest.mark.parametrize(("arguments", "error", "words"), [
    ({"source": None}, TypeError, "source must be source text"),
    ({"arch": 90}, TypeError, "arch must be a tuple of GPU architectures"),
    ({"arch": "sm_9"}, ValueError, "arch\\[0\\] must be a GPU architecture"),
    ({"arch": ()}, ValueError, "arch must be a tuple of GPU architectures"),
    ({"arch": ("sm_80", "gfx942")}, ValueError, "mixes NVIDIA and AMD"),
    ({"output": "exe"}, ValueError, "output must be"),
    ({"output": "hsaco"}, ValueError, "AMD's"),
    ({"arch": "gfx942", "output": "ptx"}, ValueError, "NVIDIA's"),
    ({"arch": "compute_90", "output": "cubin"}, ValueError, "machine code for one GPU"),
    ({"flags": "-O3"}, TypeError, "flags must be a tuple of compiler flags"),
    ({"include_dirs": [None]}, TypeError, "include_dirs\\[0\\]"),
    ({"timeout": -1}, ValueError, "timeout"),
])
async def test_bad_arguments_are_refused_at_once(native, arguments, error, words):
    submitted = native.statistics().submitted
    with pytest.raises(error, match=words):
        await native.compile_cuda(**{"source": VECTOR_ADD, **arguments})
    assert native.statistics().submitted == submitted


async def test_identical_requests_share_one_compile_and_a_second_scheduler_reads_it_from_disk(tmp_path):
    first = aiocompile.Scheduler(config=NATIVE, cache_dir=tmp_path)
    try:
        with anyio.fail_after(120):
            results = [None] * 6

            async def request(index):
                results[index] = await first.compile_cuda(VECTOR_ADD, arch="sm_90", flags=("-O3",))

            async with anyio.create_task_group() as group:
                for index in range(len(results)):
                    group.start_soon(request, index)
        assert all(result is results[0] for result in results)
        stats = first.statistics()
        assert (stats.compiled, stats.joined) == (1, 5)
    finally:
        await first.aclose()
    second = aiocompile.Scheduler(config=NATIVE, cache_dir=tmp_path)
    try:
        with anyio.fail_after(120):
            found = await second.compile_cuda(VECTOR_ADD, arch="sm_90", flags=("-O3",))
        assert (found.key, found.images, found.stages) == (results[0].key, results[0].images, results[0].stages)
        stats = second.statistics()
        assert (stats.compiled, stats.disk_hits, stats.workers_started) == (0, 1, 0)
    finally:
        await second.aclose()


@pytest.mark.parametrize("how", ["timeout", "cancel_running=kill"])
async def test_a_killed_compile_takes_cicc_and_ptxas_with_it(how):
    """nvcc runs cicc, then ptxas through a shell: a compile killed for its timeout, or
    because its last waiter went away, leaves none of them running."""
    marker = f"AIOCOMPILE_SLOW_{uuid.uuid4().hex}"  # in nvcc's command line
    flags = (f"-D{marker}",)
    # Not niced: the test's other processes (a busy CI machine's) would leave a worker
    # 10 steps nicer too little CPU to reach ptxas before its timeout.
    sched = aiocompile.Scheduler(config=NATIVE.with_changes(workers=1, cancel_running="kill", worker_nice=0))
    found = {}

    async def watch():
        found["group"], found["seen"] = await compiler_running(marker, {"ptxas"})

    try:
        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                group.start_soon(watch)
                if how == "timeout":
                    # ptxas alone takes minutes on this source; the timeout leaves the worker's
                    # start and cicc (3 s alone, 5 s beside two busy loops) time to reach it.
                    with pytest.raises(aiocompile.JobTimeout):
                        await sched.compile_cuda(SLOW_CUDA, arch="sm_90", flags=flags, timeout=20)
                else:
                    async with anyio.create_task_group() as compiling:
                        compiling.start_soon(lambda: sched.compile_cuda(SLOW_CUDA, arch="sm_90", flags=flags))
                        while "group" not in found:
                            await anyio.sleep(0.02)
                        compiling.cancel_scope.cancel()
                group.cancel_scope.cancel()
            assert "group" in found, "nvcc never reached ptxas before the job ended"
            assert {"nvcc", "cicc", "ptxas"} <= found["seen"]
            assert wait_until(lambda: not in_group(found["group"]), 10), in_group(found["group"])
            assert marked(marker) == []
        stats = sched.statistics()
        assert (stats.timeouts, stats.cancelled) == ((1, 0) if how == "timeout" else (0, 1))
        assert stats.worker_crashes == 0
    finally:
        await sched.aclose()


def test_nvcc_is_found_in_cuda_home_before_path(tmp_path):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    fake = home / "bin" / "nvcc"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    assert _compiler.find("cuda", None, {"CUDA_HOME": str(home), "PATH": ""}) == str(fake)
    # A file there that does not run as a compiler is refused when asked what it is.
    with pytest.raises(aiocompile.CompilerNotFound, match="not a usable compiler"):
        _compiler.identify(str(fake))
