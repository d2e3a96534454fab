"""Inductor's CPU vector-ISA check made ahead (``aiocompile._torch.isa``): by a process of
its own, whose builds are Inductor's own, found by the check in another process, which then
builds nothing; by a background scheduler's fork server, whose workers then build and load
no test program at all; and by the serving process, for a CPU model's Python-form load, its
builds nicer than the serving process and under ``SCHED_IDLE``, its scheduler's fork server
then leaving the check to it."""

from __future__ import annotations

import json
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
    # Each noted build starts with the build's niceness and scheduling policy (fields 19
    # and 41 of /proc/PID/stat; the wrapper's name holds no space), then the pid of the
    # process that started it.
    note = f'echo "$(cut -d" " -f19,41 /proc/$$/stat) $PPID $*" >> {notes}'
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) {note} ;; esac\nexec {real} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return bin_dir, notes


@pytest.fixture
def check_env(tmp_path, noted_gxx):
    """The environment of a process that makes the check: that ``g++`` first on PATH, a
    fresh Inductor cache, the check on (not answered by ``TORCHINDUCTOR_VEC_ISA_OK``); and
    the notes file."""
    bin_dir, notes = noted_gxx
    env = subprocess_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                         TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
    return env, notes


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(sys.platform != "linux", reason="Inductor's x86 check reads Linux's CPU flags")
def test_the_programs_built_ahead_are_those_inductors_check_loads(check_env):
    env, notes = check_env
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


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(sys.platform != "linux", reason="Inductor's x86 check reads Linux's CPU flags")
def test_the_workers_of_a_background_scheduler_build_and_load_no_test_program(check_env):
    # The fork server of a background scheduler for the CPU makes the check in its
    # preload (its programs built then), before it forks: a worker starts with the answer
    # in memory, so its compile's check builds no test program and loads none (each load
    # is a fresh interpreter), and it picks the instruction set a fresh check picks.
    env, _ = check_env
    run = subprocess.run([sys.executable, "-c", WORKER_CHECK], env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    claimed, built_before, known_in_worker, picked_in_worker, built_by_worker = run.stdout.strip().splitlines()[-5:]
    if claimed == "0":
        pytest.skip("this CPU claims no vector instruction set Inductor builds a test program for")
    assert int(built_before) > 0  # by the fork server, before any job
    assert known_in_worker == "1"  # the answer, there before the worker's first check: nothing to load
    assert built_by_worker == "0"  # and the check in the worker built nothing

    fresh = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert picked_in_worker == fresh.stdout.strip() != "INVALID_VEC_ISA"


WORKER_CHECK = """
import asyncio, os
import aiocompile
from aiocompile.torch import PRELOAD
from aiocompile._torch import export

def builds():
    notes = os.path.join(os.path.dirname(os.environ["PATH"].split(os.pathsep)[0]), "builds.txt")
    return len(open(notes).read().splitlines()) if os.path.exists(notes) else 0

def pick_in_worker():
    before = builds()
    from torch._inductor import cpu_vec_isa
    known = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize
    return known, str(cpu_vec_isa.pick_vec_isa()), builds() - before

config = aiocompile.SchedulerConfig(workers=1, preload=(PRELOAD, export.PRELOAD), repro_dir=None)
sched = aiocompile.Scheduler(config=config)
try:
    asyncio.run(sched.warm())
    built = builds()
    from torch._inductor import cpu_vec_isa
    claimed = cpu_vec_isa.x86_isa_checker()
    print(sum(all(flag in claimed for flag in str(isa).split()) for isa in cpu_vec_isa.supported_vec_isa_list))
    print(built)
    known, picked, built = asyncio.run(sched.run(pick_in_worker))
    print(known)
    print(picked)
    print(built)
finally:
    sched.close(grace=0)
"""


AHEAD_CHECK = """
import torch
from aiocompile._torch import ahead

ahead.start("python", "cpu")
ahead.GRAPH_LOAD.wait(240)
from torch._inductor import cpu_vec_isa
print(cpu_vec_isa.valid_vec_isa_list.cache_info().currsize)
"""


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(sys.platform != "linux", reason="Inductor's x86 check reads Linux's CPU flags")
def test_a_cpu_models_python_form_load_makes_the_check_ahead_its_builds_nicer_and_idle(check_env):
    env, notes = check_env
    run = subprocess.run([sys.executable, "-c", AHEAD_CHECK], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "1"  # the answer, kept for the load
    builds = notes.read_text().splitlines() if notes.exists() else []
    if not builds:
        pytest.skip("this CPU claims no vector instruction set Inductor builds a test program for")
    nicer = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    for build in builds:
        nice, policy = build.split()[:2]
        assert int(nice) >= nicer and int(policy) == os.SCHED_IDLE, build

    notes.unlink()
    check = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.strip() not in ("", "INVALID_VEC_ISA")
    assert not notes.exists(), notes.read_text()  # Inductor's own programs: found, none built again


# A server's background compile of a CPU model in the Python form, from its start: the load
# makes the check in this process (at once where the installation has the load's bytecode;
# else after a warm-up), and the scheduler's fork server either leaves it to this process
# or makes it before it forks.
SERVED = """
import asyncio, json, os, sys
import torch
import background_models
import aiocompile.torch as aiotorch
from aiocompile._torch import export, warming

warming._load_bytecode_installed = lambda: sys.argv[1] == "installed"
model, x = background_models.make_mlp()


async def main():
    compiled = aiotorch.compile_in_background(model, artifact="python")
    with torch.no_grad():
        expected = model(x)
        compiled(x)
        shape = await compiled.ready(x)
        out = compiled(x)
    scheduler = compiled.scheduler
    fork_server = await scheduler.run(os.getppid)
    preload = list(scheduler.config.preload)
    await compiled.aclose()
    print(json.dumps({"state": shape.state, "error": shape.error, "here": os.getpid(), "fork_server": fork_server,
                      "equal": bool(torch.allclose(out, expected, rtol=1e-4, atol=1e-5)),
                      "leaves_it": export.PRELOAD_IMPORTS in preload, "makes_it": export.PRELOAD in preload}))


asyncio.run(main())
"""


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(sys.platform != "linux", reason="Inductor's x86 check reads Linux's CPU flags")
@pytest.mark.parametrize("bytecode", ["installed", "missing"])
def test_a_fork_server_leaves_the_check_to_a_serving_process_that_makes_it_from_the_start(check_env, bytecode):
    env, notes = check_env
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(env, PYTHONPATH=f"{env['PYTHONPATH']}{os.pathsep}{tests}")
    run = subprocess.run([sys.executable, "-c", SERVED, bytecode], env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    answer = json.loads(run.stdout.strip().splitlines()[-1])
    assert answer["state"] == "compiled" and answer["equal"] is True, answer["error"]
    assert (answer["leaves_it"], answer["makes_it"]) == ((True, False) if bytecode == "installed" else (False, True))
    started_by = [int(build.split()[2]) for build in notes.read_text().splitlines()] if notes.exists() else []
    by_fork_server = started_by.count(answer["fork_server"])
    if bytecode == "installed":
        # The check's programs were built here; the worker's compile found them.
        assert by_fork_server == 0
    else:
        fresh = subprocess.run([sys.executable, "-c", "from torch._inductor import cpu_vec_isa as c; "
                                "print(len([i for i in c.supported_vec_isa_list if all(f in c.x86_isa_checker() "
                                "for f in str(i).split())]))"], env=env, capture_output=True, text=True,
                               timeout=TIMEOUT)
        if fresh.stdout.strip() == "0":
            pytest.skip("this CPU claims no vector instruction set Inductor builds a test program for")
        assert by_fork_server > 0  # made before it forked


LOADS = """
import json, subprocess, sys
loads = []
real = subprocess.run

def run(command, *args, **kwargs):
    # Inductor's load of a test program: a fresh interpreter given the program to dlopen.
    if isinstance(command, list) and command[:2] == [sys.executable, "-c"] and "LoadLibrary" in command[2]:
        loads.append(command[2])
    return real(command, *args, **kwargs)

subprocess.run = run
if sys.argv[1] == "remember":
    from aiocompile._torch import isa
    assert isa.remember_loads() and isa.remember_loads()  # once, however often asked
from torch._inductor import cpu_vec_isa
print(json.dumps({"valid": [str(one) for one in cpu_vec_isa.valid_vec_isa_list()], "loads": len(loads)}))
"""


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(sys.platform != "linux", reason="Inductor's x86 check reads Linux's CPU flags")
def test_a_test_program_that_loaded_is_not_loaded_again_until_it_changes(check_env, tmp_path):
    from aiocompile._torch import isa

    env, _ = check_env

    def check(how: str) -> dict:
        run = subprocess.run([sys.executable, "-c", LOADS, how], env=env, capture_output=True, text=True,
                             timeout=TIMEOUT)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    first = check("remember")  # builds each program and loads it once
    if not first["valid"]:
        pytest.skip("this CPU claims no vector instruction set Inductor builds a test program for")
    assert first["loads"] == len(first["valid"])
    markers = sorted((tmp_path / "inductor").rglob(f"*{isa.LOADED_SUFFIX}"))
    assert len(markers) == len(first["valid"])
    programs = [str(marker)[:-len(isa.LOADED_SUFFIX)] for marker in markers]

    # Another of aiocompile's processes: the same answer, no program loaded.
    assert check("remember") == {"valid": first["valid"], "loads": 0}
    # Inductor's own check, where nothing is remembered, loads each as before.
    assert check("stock") == {"valid": first["valid"], "loads": len(first["valid"])}

    # A program built again (another time) is loaded again, and remembered anew.
    for program in programs:
        os.utime(program, ns=(os.stat(program).st_atime_ns, os.stat(program).st_mtime_ns + 10**9))
    assert check("remember") == {"valid": first["valid"], "loads": len(first["valid"])}
    assert check("remember")["loads"] == 0

    # One that no longer loads fails the check, and nothing says it loaded.
    remembered = {marker: marker.read_text() for marker in markers}
    for program in programs:
        with open(program, "wb") as broken:
            broken.write(b"not a shared library")
    broken_check = check("remember")
    assert broken_check["valid"] == [] and broken_check["loads"] == len(first["valid"])
    assert {marker: marker.read_text() for marker in markers} == remembered
    assert check("remember")["loads"] == len(first["valid"])  # tried again each time
