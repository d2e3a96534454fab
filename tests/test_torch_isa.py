"""Inductor's CPU vector-ISA check, its test programs built ahead (``aiocompile._torch.isa``):
the builds are Inductor's own, found by its check in another process, which then builds
nothing."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest
from conftest import subprocess_env

pytest.importorskip("torch")

TIMEOUT = 300

CHECK = "from torch._inductor import cpu_vec_isa; print(cpu_vec_isa.pick_vec_isa())"


@pytest.fixture
def noted_gxx(tmp_path):
    """A ``g++`` first on PATH that notes each build (a call naming an output) in a file
    and runs the real one."""
    real = shutil.which("g++")
    if real is None:
        pytest.skip("g++ is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    notes = tmp_path / "builds.txt"
    wrapper = bin_dir / "g++"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) echo "$*" >> {notes} ;; esac\nexec {real} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return bin_dir, notes


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(sys.platform != "linux", reason="Inductor's x86 check reads Linux's CPU flags")
def test_the_programs_built_ahead_are_those_inductors_check_loads(tmp_path, noted_gxx):
    bin_dir, notes = noted_gxx
    env = subprocess_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                         TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
    built = subprocess.run([sys.executable, "-m", "aiocompile._torch.isa"], env=env, capture_output=True,
                           text=True, timeout=TIMEOUT)
    assert built.returncode == 0, built.stderr[-3000:]
    builds = notes.read_text().splitlines() if notes.exists() else []
    if not builds:
        pytest.skip("this CPU claims no vector instruction set Inductor builds a test program for")

    notes.unlink()
    check = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert check.returncode == 0, check.stderr[-3000:]
    # Inductor's own check in a fresh process picks an instruction set, and builds nothing:
    # it found every program built, and only loaded each.
    assert check.stdout.strip() not in ("", "INVALID_VEC_ISA")
    assert not notes.exists(), notes.read_text()

