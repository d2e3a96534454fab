"""Inductor's ROCm builds (``AsyncCompile.rocm``: HIP through ROCm's Clang) in aiocompile's
workers when installed, as its CUDA builds are, here with Debian's HIP (hipcc's Clang, its
HIP runtime and device libraries) standing in for a ROCm installation; no AMD GPU needed
to build, none used."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import clear_inductor_caches
from native_sources import HIP_VECTOR_ADD, needs_hipcc

import aiocompile
from aiocompile.backends._native import _compiler

torch = pytest.importorskip("torch")
pytest.importorskip("torch._inductor.codegen.rocm.compile_command")

pytestmark = needs_hipcc


def rocm_home(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory laid out as Inductor expects ROCm (``llvm/bin/clang``, ``lib``,
    ``include``) over what hipcc runs, and the variables that tell that Clang where the HIP
    runtime and device libraries are; skips where they cannot be found."""
    hipcc = _compiler.identify(_compiler.find("hip", None), (("HIP_PLATFORM", "amd"),))
    found = re.search(r"clang version (\d+)", hipcc.identity)
    installed = re.search(r"InstalledDir: (\S+)", hipcc.identity)
    if not found or not installed:
        pytest.skip(f"hipcc's identity names no Clang: {hipcc.identity!r}")
    clangs = [Path(installed.group(1)) / name for name in (f"clang-{found.group(1)}", "clang")]
    clang = next((c for c in clangs if c.exists()), None)
    roots = [Path(p) for p in (os.environ.get("ROCM_PATH"), "/opt/rocm", "/usr") if p]
    root = next((r for r in roots if (r / "include" / "hip" / "hip_runtime.h").exists()), None)
    runtime = next((p for r in (root,) if r for p in [*(r / "lib").glob("libamdhip64.so"),
                                                       *(r / "lib").glob("*/libamdhip64.so")]), None)
    bitcode = next((p for r in (root,) if r for p in [*(r / "lib").glob("*/amdgcn/bitcode"),
                                                       *(r / "amdgcn").glob("bitcode")]), None)
    if None in (clang, root, runtime, bitcode):
        pytest.skip(f"no Clang, HIP runtime or device libraries beside hipcc: {clang}, {root}, {runtime}, {bitcode}")
    home = tmp_path / "rocm"
    (home / "llvm" / "bin").mkdir(parents=True)
    (home / "lib").mkdir()
    (home / "include").mkdir()
    (home / "llvm" / "bin" / "clang").symlink_to(clang)
    (home / "lib" / "libamdhip64.so").symlink_to(runtime)
    (home / "include" / "hip").symlink_to(root / "include" / "hip")
    return home, {"ROCM_PATH": str(root), "HIP_DEVICE_LIB_PATH": str(bitcode)}


@pytest.fixture
def rocm(tmp_path, monkeypatch):
    from torch._inductor import config

    home, env = rocm_home(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    clear_inductor_caches()
    with config.patch({"rocm.rocm_home": str(home), "rocm.ck_dir": str(tmp_path / "ck"), "rocm.arch": ["gfx90a"],
                       "compile_threads": 2}):
        yield tmp_path / "inductor"
    clear_inductor_caches()


def scheduler():
    return aiocompile.Scheduler(config=aiocompile.SchedulerConfig(workers=2, preload=()))


def test_a_rocm_build_runs_in_a_worker_and_makes_inductors_library_of_amd_code(rocm):
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import ROCmCodeCache

    import aiocompile.torch as aiotorch

    sched = scheduler()
    try:
        with aiotorch.installed(sched, warm=False):
            library = AsyncCompile().rocm(HIP_VECTOR_ADD, "so").result()
        (record,) = sched.records()
        assert (record.backend, record.target) == ("inductor-rocm", "rocm")
        assert record.outcome == "compiled" and record.worker_pid not in (None, os.getpid())
        path = Path(library.lib_path)
        assert path.is_relative_to(rocm) and path.suffix == ".so"
        assert b"amdgcn-amd-amdhsa--gfx90a" in path.read_bytes()  # the AMD code object, inside
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True).stdout
        assert "vector_add" in symbols
        # Inductor's own cache finds what the worker built: nothing compiles again here.
        assert ROCmCodeCache.compile(HIP_VECTOR_ADD, "so")[0] == str(path)
    finally:
        sched.close()


def test_a_rocm_build_that_fails_fails_in_the_worker_with_clangs_words(rocm):
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    import aiocompile.torch as aiotorch

    sched = scheduler()
    try:
        with aiotorch.installed(sched, warm=False), config.patch({"rocm.arch": ["gfx9999"]}):
            future = AsyncCompile().rocm(HIP_VECTOR_ADD, "so")
            with pytest.raises(aiocompile.CompileError, match="gfx9999"):
                future.result()
        (record,) = sched.records()
        assert (record.backend, record.outcome) == ("inductor-rocm", "error")
        assert record.worker_pid not in (None, os.getpid())
    finally:
        sched.close()
