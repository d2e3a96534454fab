"""compile_cuda for AMD GPUs: real hipcc compiles in real workers, on a machine with no
AMD GPU (and, in CI, with nvcc installed beside it, which hipcc would otherwise pick)."""

import struct

import anyio
import pytest
from native_sources import HIP_VECTOR_ADD, needs_hipcc

import aiocompile
from aiocompile.backends._native import _compiler

pytestmark = needs_hipcc

NATIVE = aiocompile.SchedulerConfig(workers=2, preload=())

EM_AMDGPU = 224
# The processor an AMD code object is built for, in the low byte of its ELF header's
# e_flags (EF_AMDGPU_MACH_AMDGCN_*).
MACHINES = {"gfx90a": 0x3F, "gfx1030": 0x36}


@pytest.fixture(scope="module")
def native():
    sched = aiocompile.Scheduler(config=NATIVE)
    yield sched
    sched.close(grace=0)


def hipcc() -> _compiler.Compiler:
    return _compiler.identify(_compiler.find("hip", None), (("HIP_PLATFORM", "amd"),))


def code_objects(data):
    """{processor: its AMD code object} of a Clang offload bundle, checking that each is
    an ELF for the AMDGPU machine built for that processor. The bundle: a magic string,
    the number of entries, then for each its offset, size, and the target it is for
    (``hipv4-amdgcn-amd-amdhsa--gfx90a``; the host's entry is empty)."""
    magic = b"__CLANG_OFFLOAD_BUNDLE__"
    assert data.startswith(magic), data[:32]
    (count,) = struct.unpack_from("<Q", data, len(magic))
    offset, found = len(magic) + 8, {}
    for _ in range(count):
        start, size, length = struct.unpack_from("<QQQ", data, offset)
        target = data[offset + 24:offset + 24 + length].decode()
        offset += 24 + length
        if not target.startswith(("hip-", "hipv4-")):
            assert target.startswith("host-") and size == 0, target
            continue
        image = data[start:start + size]
        assert image[:4] == b"\x7fELF", target
        (machine,) = struct.unpack_from("<H", image, 18)
        (flags,) = struct.unpack_from("<I", image, 48)
        processor = target.rsplit("-", 1)[1]
        assert machine == EM_AMDGPU and flags & 0xFF == MACHINES[processor], (target, machine, hex(flags))
        found[processor] = image
    return found


@pytest.mark.parametrize("platform", [None, "nvidia"])
async def test_one_bundle_of_code_objects_for_gfx90a_and_gfx1030_whatever_hip_platform_says(
        native, monkeypatch, platform):
    """With nvcc installed, hipcc left to itself picks NVIDIA's platform and hands the AMD
    architectures to nvcc; a gfx architecture runs hipcc on AMD's, whatever the
    environment says."""
    if platform is None:
        monkeypatch.delenv("HIP_PLATFORM", raising=False)
    else:
        monkeypatch.setenv("HIP_PLATFORM", platform)
    with anyio.fail_after(120):
        binary = await native.compile_cuda(HIP_VECTOR_ADD, arch=("gfx90a", "gfx1030"))
    assert binary.output == "hsaco" and binary.target == "hip:gfx90a+gfx1030" and list(binary.images) == ["hsaco"]
    assert set(code_objects(binary.binary)) == {"gfx90a", "gfx1030"}
    assert binary.command.startswith("env HIP_PLATFORM=amd ")
    assert "--genco --offload-arch=gfx90a --offload-arch=gfx1030" in binary.command
    # hipcc's identity is HIP's version and the Clang under it (not nvcc's).
    assert binary.compiler_version and binary.compiler_version in binary.compiler_identity
    assert "HIP version" in binary.compiler_identity and "clang version" in binary.compiler_identity
    assert "Cuda compilation tools" not in binary.compiler_identity
    record = next(r for r in native.records() if r.key == binary.key)
    assert record.backend == "hip" and record.outcome == "compiled"


async def test_one_architecture_is_one_code_object_and_a_shared_library_carries_it(native):
    with anyio.fail_after(120):
        cubin = await native.compile_cuda(HIP_VECTOR_ADD, arch="gfx90a", output="cubin")
        shared = await native.compile_cuda(HIP_VECTOR_ADD, arch="gfx1030", output="shared")
    assert cubin.output == "hsaco" and set(code_objects(cubin.binary)) == {"gfx90a"}
    library = shared.images["shared"]
    assert library[:4] == b"\x7fELF" and struct.unpack_from("<H", library, 16)[0] == 3  # ET_DYN: a host library
    assert b"amdgcn-amd-amdhsa--gfx1030" in library
    assert cubin.key != shared.key


async def test_an_architecture_hipcc_does_not_know_is_refused_before_any_worker_naming_its_versions():
    known = _compiler.amd_processors(hipcc(), (("HIP_PLATFORM", "amd"),))
    if known is None or "gfx942" in known:
        pytest.skip(f"this hipcc ({hipcc().summary}) knows gfx942 or cannot list what it knows")
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with pytest.raises(aiocompile.CompileError) as caught:
            await sched.compile_cuda(HIP_VECTOR_ADD, arch=("gfx90a", "gfx942"))
        message = str(caught.value)
        assert f"hipcc (HIP {hipcc().version}, clang " in message and "does not know gfx942" in message
        assert "gfx90a" in message.split("does not know gfx942", 1)[1]  # what it does know of gfx9
        assert "nvcc" not in message and not isinstance(caught.value, aiocompile.CompilerNotFound)
        assert (sched.statistics().submitted, sched.worker_pids()) == (0, [])
    finally:
        await sched.aclose()


async def test_where_hipcc_cannot_list_its_processors_the_compile_says_which_it_does_not_know(tmp_path):
    """A hipcc that does not answer ``-print-supported-cpus`` (a wrapper here) is not
    judged before the compile; Clang's refusal in the worker still names the compiler,
    its versions and the architecture."""
    if "gfx942" in (_compiler.amd_processors(hipcc(), (("HIP_PLATFORM", "amd"),)) or ()):
        pytest.skip("this hipcc knows gfx942")
    wrapper = tmp_path / "hipcc"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *-print-supported-cpus*) exit 1;; esac\n'
                       f'exec {_compiler.find("hip", None)} "$@"\n')
    wrapper.chmod(0o755)
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with anyio.fail_after(120), pytest.raises(aiocompile.CompileError) as caught:
            await sched.compile_cuda(HIP_VECTOR_ADD, arch="gfx942", compiler=str(wrapper))
        message = str(caught.value)
        assert "hipcc (HIP " in message and ", clang " in message and "does not know gfx942" in message
        assert "invalid target ID 'gfx942'" in message and "nvcc" not in message
        assert caught.value.command.startswith(f"env HIP_PLATFORM=amd {wrapper} --genco")
        assert sched.statistics().failed == 1
    finally:
        await sched.aclose()


async def test_the_key_covers_the_clang_under_hipcc(tmp_path):
    """Two compiles through one hipcc path whose Clang reports another version between
    them: the second is a new key and compiles again."""
    real = _compiler.find("hip", None)
    wrapper = tmp_path / "hipcc"

    def write(clang: str) -> None:
        wrapper.write_text(
            f'#!/bin/sh\nif [ "$1" = --version ]; then {real} --version | sed "s/clang version [0-9.]*/clang version '
            f'{clang}/"; exit 0; fi\nexec {real} "$@"\n')
        wrapper.chmod(0o755)

    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with anyio.fail_after(120):
            write("15.0.6")
            first = await sched.compile_cuda(HIP_VECTOR_ADD, arch="gfx90a", compiler=str(wrapper))
            again = await sched.compile_cuda(HIP_VECTOR_ADD, arch="gfx90a", compiler=str(wrapper))
            write("15.0.77")
            second = await sched.compile_cuda(HIP_VECTOR_ADD, arch="gfx90a", compiler=str(wrapper))
        assert again.key == first.key and "clang version 15.0.6" in first.compiler_identity
        assert second.key != first.key and "clang version 15.0.77" in second.compiler_identity
        assert sched.statistics().compiled == 2
    finally:
        await sched.aclose()
