"""torch.compile with Inductor's Halide backend (``cpu_backend="halide"``) with aiocompile
installed: Halide's runtime and each kernel's build (its generator, its C++ glue) in the
pool's workers, the kernel loaded and run here.

Real Halide compiles, real g++, real worker processes and real kills. Each test has empty
Inductor caches, so every kernel is really built. The build tasks of the last tests have
Inductor's own shape (``_worker_task_halide`` over ``subprocess.check_call`` and
``touch``) with a small program in place of a Halide generator, so that a failure, a
hang and a shared build take no Halide compile.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import alive, clear_inductor_caches, wait_until
from test_inductor_cpu import STALL_ONCE, gxx_in_front, kill_the_building_worker, needs_gxx, torch_scheduler

import aiocompile

torch = pytest.importorskip("torch")
pytest.importorskip("torch._inductor.codecache")
needs_halide = pytest.mark.skipif(importlib.util.find_spec("halide") is None,
                                  reason="Inductor's Halide backend needs halide (pip install halide)")
pytestmark = [needs_gxx, pytest.mark.timeout(600)]


@pytest.fixture
def fresh_inductor(tmp_path, monkeypatch):
    """Empty Inductor caches, on disk and in memory (Halide's runtime included), no graph
    cache, and Halide as the CPU backend."""
    from torch._inductor import config
    from torch._inductor.codecache import HalideCodeCache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(HalideCodeCache, "_standalone_runtime_path", None)
    torch._dynamo.reset()
    clear_inductor_caches()
    with config.patch(fx_graph_cache=False, cpu_backend="halide"):
        yield tmp_path / "inductor"
    torch._dynamo.reset()
    clear_inductor_caches()


def small(x, y):
    return (x * 2 + y).relu().sum(dim=1)


def compile_and_compare():
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    torch.testing.assert_close(torch.compile(small)(x, y), small(x, y))


def halide_records(sched):
    return [r for r in sched.records() if r.backend == "inductor-halide"]


@needs_halide
def test_torch_compile_with_halide_equals_eager_with_its_kernels_built_in_workers(fresh_inductor):
    import aiocompile.torch as aiotorch

    halide_here = "halide" in sys.modules
    sched = torch_scheduler()
    try:
        with aiotorch.installed(sched):
            compile_and_compare()
        records = halide_records(sched)
        runtime, *kernels = records
        assert runtime.name == "halide-runtime" and kernels
        for record in records:
            assert (record.outcome, record.target, record.attempts) == ("compiled", "cpu", 1)
            assert record.worker_pid not in (None, os.getpid()) and record.compiler_cache_hit is False
        assert sched.statistics().failed == 0
        # Inductor's files, where Inductor puts them: each kernel's directory built to the end.
        directories = list(fresh_inductor.rglob("*.halide"))
        assert sorted(d.stem for d in directories) == sorted(r.name for r in kernels)
        assert all((d / "done").exists() and (d / "halide_kernel.a").exists() for d in directories)
        assert list(fresh_inductor.glob("halide-runtime-*/libStandaloneHalideRuntime.so"))
        if not halide_here:
            assert "halide" not in sys.modules, "Halide compiled nothing in this process"
    finally:
        sched.close()


@needs_halide
def test_a_worker_killed_in_the_middle_of_a_halide_build_costs_torch_compile_nothing(fresh_inductor, tmp_path,
                                                                                    monkeypatch):
    """SIGKILL to the worker while the kernel's glue is linked with g++ (half written):
    the build runs again on another worker, from scratch, and torch.compile succeeds."""
    import aiocompile.torch as aiotorch

    state = gxx_in_front(tmp_path, monkeypatch, "stalled once, half written", STALL_ONCE)
    sched = torch_scheduler()
    killed, killer = kill_the_building_worker(state, sched)
    try:
        with aiotorch.installed(sched):
            compile_and_compare()
        killer.join(5)
        assert killed["was_a_worker"] and killed["worker"] != os.getpid()
        stats = sched.statistics()
        assert stats.worker_crashes == 1 and stats.retries == 1 and stats.failed == 0
        (victim,) = [r for r in halide_records(sched) if r.attempts == 2]
        assert victim.outcome == "compiled" and victim.name != "halide-runtime"
        assert victim.worker_pid not in (killed["worker"], None)
        assert wait_until(lambda: not alive([killed["compiler"]])), "the killed worker's compiler went with it"
        assert not list(fresh_inductor.rglob("*.aiocompile-*")), "no build is left marked as under way"
    finally:
        sched.close()


# -- tasks of Inductor's shape, with a small program for a generator -------------------------------------------


def halide_task(directory, program):
    """What ``HalideCodeCache.generate_halide_async`` hands its ``submit_fn`` for a kernel
    whose glue is built already: the generator's command, then the done file."""
    from torch._inductor import codecache

    directory.mkdir(parents=True, exist_ok=True)
    generate = [sys.executable, "-c", program, str(directory)]
    jobs = [functools.partial(subprocess.check_call, generate), functools.partial(codecache.touch,
                                                                                 str(directory / "done"))]
    return functools.partial(codecache._worker_task_halide, str(directory / "lock"), jobs)


WRITES = "import pathlib, sys; pathlib.Path(sys.argv[1], 'halide_kernel.a').write_text('kernel')"
FAILS = "import sys; print('Error: Func f has no definition'); sys.exit(1)"
HANGS = "import os, pathlib, sys, time; pathlib.Path(sys.argv[1], 'hung').write_text(str(os.getpid())); time.sleep(300)"


def test_one_halide_build_per_key(fresh_inductor):
    from aiocompile.backends.inductor import _native, _native_worker

    task = halide_task(fresh_inductor / "ab" / "cabc.halide", WRITES)
    first, again = _native.halide_request(task), _native.halide_request(task)
    assert first.fn is _native_worker.build_halide, "built from its parts, without torch"
    assert (first.backend, first.name, first.target) == ("inductor-halide", "cabc", "cpu")
    assert first.key == again.key
    other = _native.halide_request(halide_task(fresh_inductor / "cd" / "ccde.halide", WRITES))
    assert other.key != first.key
    sched = torch_scheduler()
    try:
        answers = [sched.port.execute_sync(request, 120) for request in (first, again)]
        built = [answer.result(timeout=120) for answer in answers]
        assert built[0] is built[1] and not built[0].cached
        assert (fresh_inductor / "ab" / "cabc.halide" / "done").exists()
        assert sched.port.execute_sync(_native.halide_request(task), 120).result(timeout=120) is built[0]
        assert [r.outcome for r in sched.records()] == ["compiled", "joined", "cache_hit"]
    finally:
        sched.close()


def test_a_failing_halide_generator_is_a_compile_error_with_what_it_printed(fresh_inductor):
    from aiocompile.backends.inductor import _native

    directory = fresh_inductor / "ef" / "cef.halide"
    sched = torch_scheduler()
    try:
        answer = sched.port.execute_sync(_native.halide_request(halide_task(directory, FAILS)), 120)
        with pytest.raises(aiocompile.CompileError) as failed:
            answer.result(timeout=120)
        assert "Func f has no definition" in str(failed.value) and "exited with status 1" in str(failed.value)
        assert failed.value.kernel_name == "cef" and sys.executable in failed.value.command
        assert not (directory / "done").exists(), "Inductor asks for the build again"
        (record,) = sched.records()
        assert (record.outcome, record.backend) == ("error", "inductor-halide")
    finally:
        sched.close()


def test_a_halide_build_past_its_timeout_fails_as_job_timeout_and_leaves_no_generator(fresh_inductor):
    from aiocompile.backends.inductor import _native

    directory = fresh_inductor / "gh" / "cgh.halide"
    sched = torch_scheduler()
    try:
        answer = sched.port.execute_sync(_native.halide_request(halide_task(directory, HANGS)), 3)
        with pytest.raises(aiocompile.JobTimeout):
            answer.result(timeout=120)
        generator = int((directory / "hung").read_text())
        assert wait_until(lambda: not alive([generator])), "the generator went with its worker"
        assert not (directory / "done").exists()
        (record,) = sched.records()
        assert record.outcome == "timeout"
    finally:
        sched.close()
