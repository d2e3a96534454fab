"""``aiocompile.torch.compile_in_background``: eager calls while a worker compiles, the
switch to the compiled version, and every way a compile can fail leaving eager serving
with the error and a repro bundle whose script fails the same way.

Everything runs on the CPU: Inductor compiles C++ for CPU models, AOTInductor included.
Failures are real and injected through Inductor's own settings: a model ``torch.export``
cannot trace, a C++ compiler (``cpp.cxx``) that fails, one that kills the worker running
it, and one that waits for the test's word (to prove a compile is under way while calls
are answered).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import busy_inside_handing_over, subprocess_env, threads_started, wait_until

import aiocompile

torch = pytest.importorskip("torch")

import background_models  # noqa: E402  (needs torch)

import aiocompile.torch as aiotorch  # noqa: E402
from aiocompile._torch import choices  # noqa: E402
from aiocompile._torch import graph as _graph  # noqa: E402
from aiocompile._torch.states import TRANSITIONS  # noqa: E402

TIMEOUT = 600
# The module's scheduler starts its fork server (torch imported) in whichever test uses it
# first: seconds on a busy 2-CPU machine.
pytestmark = pytest.mark.timeout(TIMEOUT)


@pytest.fixture(scope="module")
def repro_root(tmp_path_factory):
    return tmp_path_factory.mktemp("repro")


@pytest.fixture(scope="module")
def sched(repro_root):
    """Workers that start with torch imported; a job that kills one fails at once."""
    from aiocompile._base.config import TRITON_PRELOAD

    config = aiocompile.SchedulerConfig(workers=2, preload=(TRITON_PRELOAD, aiotorch.PRELOAD), max_crashes=1,
                                        repro_dir=str(repro_root))
    scheduler = aiocompile.Scheduler(config=config)
    yield scheduler
    scheduler.close(grace=0)


@pytest.fixture
def fresh_inductor(tmp_path, monkeypatch):
    """An empty Inductor cache for this test (workers get it with each compile)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


# For a package built by a compiler at a test's temporary path: Inductor keeps the headers
# it precompiles for the wrapper and the kernels outside its cache directory (in
# /tmp/torchinductor_$USER, keyed by the compiler's command line), so each run would add
# a new pair of 140-155 MB and spend seconds building them.
NO_HEADERS = {"aot_inductor.precompile_headers": False, "cpp_cache_precompile_headers": False}


def compiler(tmp_path: Path, name: str, body: str) -> str:
    """A C++ compiler for Inductor's ``cpp.cxx``: a shell script named like g++ (Inductor
    picks its flags by the name)."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def run_repro(bundle: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(bundle, "repro.py")], capture_output=True, text=True,
                          env=subprocess_env(), timeout=TIMEOUT, cwd="/")


def bundle_manifest(bundle: str) -> dict:
    return json.loads(Path(bundle, "bundle.json").read_text())


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(fullgraf=True), TypeError, "fullgraf"),
    (dict(mode="reduce-overhead"), ValueError, "CUDA graphs"),
    (dict(mode=3), TypeError, "mode"),
    (dict(backend="eager"), ValueError, "inductor"),
    (dict(dynamic=True), ValueError, "dynamic"),
    (dict(dynamic="yes"), TypeError, "dynamic"),
    (dict(options={"no_such_setting": 1}), ValueError, "no_such_setting"),
    (dict(options=[("max_autotune", True)]), TypeError, "options"),
    (dict(options={"max_autotune": True}, mode="max-autotune"), ValueError, "not both"),
    (dict(strict="yes"), TypeError, "strict"),
    (dict(timeout=-1), ValueError, "timeout"),
    (dict(scheduler="default"), TypeError, "scheduler"),
    (dict(artifact="so"), ValueError, "'auto', 'package', 'python'"),
    (dict(artifact=None), TypeError, "artifact"),
])
def test_bad_options_are_refused_at_once(kwargs, error, match):
    model, _ = background_models.make_mlp()
    with pytest.raises(error, match=match):
        aiotorch.compile_in_background(model, **kwargs)


def test_a_model_must_be_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        aiotorch.compile_in_background(lambda x: x)


def test_a_closed_scheduler_is_refused_as_every_call_after_aclose_is():
    closed = aiocompile.Scheduler(workers=1)
    closed.close()
    model, _ = background_models.make_mlp()
    with pytest.raises(aiocompile.SchedulerClosed, match="closed"):
        aiotorch.compile_in_background(model, scheduler=closed)


@pytest.mark.timeout(TIMEOUT)
async def test_close_in_an_event_loop_hands_the_workers_exits_to_a_started_thread():
    """``close()`` called in an event loop's thread returns at once, its scheduler's close
    made by one of the background lane's threads, already started (starting one made the
    loop wait for it: 12 ms on 2 busy CPUs); ``aclose()`` waits for it."""
    from aiocompile._torch import background

    model, _ = background_models.make_mlp()
    compiled = aiotorch.compile_in_background(model)  # its own scheduler, made in a thread
    scheduler = compiled.scheduler  # waited for here: a test may hold its loop
    # The thread that made it started the lane's first thread, which now waits for work.
    assert wait_until(lambda: background._LANE._get()._idle_semaphore._value > 0, timeout=30)
    with threads_started() as started:
        compiled.close()
    assert started == []
    await compiled.aclose()
    assert scheduler.closed


def test_mode_becomes_inductors_settings_without_cuda_graphs():
    configs = choices.inductor_configs(torch, "max-autotune", {})
    assert configs["max_autotune"] is True
    assert not any("cudagraph" in name for name in configs)


def test_the_state_machine_allows_only_its_transitions():
    assert TRANSITIONS == {("compiling", "compiled"), ("compiling", "failed"), ("compiled", "failed")}


# -- compiling while serving -------------------------------------------------------------------


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("fresh_inductor")
def test_calls_are_answered_eagerly_while_the_compile_runs_then_compiled(sched, tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    cxx = compiler(tmp_path, "gate-g++", f'''
: > "{gate}/started"
while [ ! -e "{gate}/release" ]; do sleep 0.05; done
exec g++ "$@"
''')
    model, x = background_models.make_mlp()
    with torch.no_grad():
        expected = model(x)
    compiled = aiotorch.compile_in_background(model, options={"cpp.cxx": (None, cxx), **NO_HEADERS}, scheduler=sched)
    try:
        with torch.no_grad():
            first = compiled(x)
        torch.testing.assert_close(first, expected, rtol=0, atol=0)
        (shape,) = compiled.status().shapes
        assert (shape.signature, shape.state, shape.eager_calls) == ("f32[4, 16] cpu", "compiling", 1)

        # The worker is inside Inductor's C++ compile, held there: every call meanwhile is
        # answered at once, eagerly, and the signature is still compiling.
        assert wait_until(lambda: (gate / "started").exists(), timeout=TIMEOUT)
        with torch.no_grad():
            for _ in range(20):
                torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
        status = compiled.status()
        assert status.compiling == ("f32[4, 16] cpu",) and status.compiled == ()
        assert status.shapes[0].eager_calls == 21 and status.shapes[0].compiled_calls == 0
    finally:
        (gate / "release").touch()

    shape = asyncio.run(compiled.ready(x))
    assert shape.state == "compiled" and shape.error is None
    assert [stage for stage, _ in shape.stages] == ["load", "export", "compile", "trial"]
    assert shape.max_abs_difference is not None and shape.max_abs_difference < 1e-4
    assert shape.seconds is not None and shape.seconds > 0
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-5)
    status = compiled.status()
    assert status.compiled == ("f32[4, 16] cpu",) and status.shapes[0].compiled_calls == 3
    # A call that records autograd history is eager: the compiled version is for inference.
    out = compiled(x)
    assert out.requires_grad and compiled.status().shapes[0].eager_calls == 22
    # The compiled version reads the model's own weights: changed in place, it follows.
    with torch.no_grad():
        model.down.bias.add_(1.0)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert compiled.status().shapes[0].compiled_calls == 4

    # Another shape, another dtype, the model in training mode: other signatures, each
    # with a compile of its own.
    keys = {compiled._key((x,), {}), compiled._key((torch.randn(2, 16),), {}),
            compiled._key((x.double(),), {}), compiled._key((x.t().contiguous().t(),), {})}
    model.train()
    keys.add(compiled._key((x,), {}))
    model.eval()
    assert len(keys) == 5

    record = next(r for r in sched.records() if r.name == "MLP(f32[4, 16] cpu)")
    assert (record.backend, record.outcome, record.target) == ("aoti", "compiled", "cpu")
    assert dict(record.stages).keys() == {"load", "export", "compile", "trial"}
    json.dumps(compiled.status().to_dict())


async def test_ready_shares_the_compile_a_call_started_and_the_failure_is_recorded(sched):
    model = background_models.DataDependent()
    x = torch.ones(3)
    compiled = aiotorch.compile_in_background(model, scheduler=sched)
    torch.testing.assert_close(compiled(x), x)  # eager, and the compile starts
    shape = await compiled.ready(x)
    assert shape.state == "failed"
    assert shape.error.startswith("CompileError") and "export failed" in shape.error
    assert shape.repro is not None and Path(shape.repro, "repro.py").is_file()
    torch.testing.assert_close(compiled(x), x)
    torch.testing.assert_close(compiled(-x), x)  # the other branch: -(-x)
    (failed,) = compiled.status().shapes
    assert failed.state == "failed" and failed.eager_calls == 3  # -x is the same signature

    strict = aiotorch.compile_in_background(model, scheduler=sched, strict=True)
    with pytest.raises(aiocompile.CompileError, match="export failed") as info:
        await strict.ready(x)
    assert info.value.repro and Path(info.value.repro).is_dir() and info.value.repro in str(info.value)


async def test_a_model_that_will_not_pickle_stays_eager_and_strict_raises(sched):
    model = background_models.HoldsALock().eval()
    x = torch.randn(2, 16)
    compiled = aiotorch.compile_in_background(model, scheduler=sched)
    shape = await compiled.ready(x)
    assert shape.state == "failed" and "cannot be compiled in a worker" in shape.error and "lock" in shape.error
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    strict = aiotorch.compile_in_background(model, scheduler=sched, strict=True)
    with pytest.raises(aiocompile.CompileError, match="cannot be compiled in a worker"):
        await strict.ready(x)


async def test_inputs_that_cannot_be_keyed_are_answered_eagerly(sched):
    model, x = background_models.make_mlp()
    compiled = aiotorch.compile_in_background(model, scheduler=sched, strict=True)
    parameter = torch.nn.Parameter(x.clone(), requires_grad=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(parameter), model(parameter))
    status = compiled.status()
    assert status.shapes == () and status.eager_calls == 1
    with pytest.raises(aiocompile.CompileError, match="cannot be keyed"):
        await compiled.ready(parameter)


async def test_signatures_beyond_the_bound_are_served_eagerly_and_start_nothing(sched):
    model = background_models.HoldsALock().eval()  # fails before any worker: cheap to try
    compiled = aiotorch.compile_in_background(model, scheduler=sched, max_signatures=1)
    with torch.no_grad():
        compiled(torch.randn(2, 16))
        assert compiled.state(torch.randn(3, 16)) == "eager"
        for rows in (3, 4, 5):
            torch.testing.assert_close(compiled(torch.ones(rows, 16)), model(torch.ones(rows, 16)))
    status = compiled.status()
    assert [shape.signature for shape in status.shapes] == ["f32[2, 16] cpu"] and status.eager_calls == 3
    shape = await compiled.ready(torch.randn(6, 16))
    assert shape.state == "eager" and "max_signatures=1" in shape.error
    with pytest.raises(ValueError, match="max_signatures"):
        aiotorch.compile_in_background(model, scheduler=sched, max_signatures=0)


def test_the_whole_submission_hands_the_lock_over_and_stands_aside_for_calls(sched, monkeypatch):
    """The lane's thread that packs the model and hands the job to the scheduler runs
    beside the calls after the first: all of it at the lowered switch interval and
    standing aside while a call is served, not only the packing."""
    from aiocompile._base import aside, threads
    from aiocompile._torch import background

    seen: list[tuple[float, bool]] = []
    form_for = background.choices.form_for

    def noted(artifact):
        if threading.current_thread().name.startswith("aiocompile-background"):  # not the constructor's
            seen.append((sys.getswitchinterval(), aside.attached()))
        return form_for(artifact)

    monkeypatch.setattr(background.choices, "form_for", noted)
    model, x = background_models.make_mlp()
    compiled = aiotorch.compile_in_background(model, scheduler=sched)
    with torch.no_grad():
        compiled(x)
    asyncio.run(compiled.ready(x))
    assert seen == [(pytest.approx(threads.HANDOVER_INTERVAL), True)]


def test_disable_keeps_every_call_eager(sched):
    model, x = background_models.make_mlp()
    compiled = aiotorch.compile_in_background(model, scheduler=sched, disable=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    shape = asyncio.run(compiled.ready(x))
    assert shape.state == "eager" and "disable=True" in shape.error
    assert not [r for r in sched.records() if r.backend == "aoti" and r.name.startswith("MLP(f32[4, 16]")
                and r.outcome != "compiled"]


# -- failures and their bundles -------------------------------------------------------------------


@pytest.mark.timeout(TIMEOUT)
def test_an_export_failure_bundle_reproduces_it(sched):
    model = background_models.DataDependent()
    x = torch.ones(5)
    compiled = aiotorch.compile_in_background(model, scheduler=sched)
    shape = asyncio.run(compiled.ready(x))
    assert shape.state == "failed"
    bundle = Path(shape.repro)
    manifest = bundle_manifest(str(bundle))
    assert (manifest["kind"], manifest["name"], manifest["stage"]) == ("background", "DataDependent", "export")
    assert manifest["signature"] == "f32[5] cpu" and manifest["versions"]["torch"] == torch.__version__
    assert {"bundle.json", "error.txt", "repro.py", "model.pkl", "weights.bin", "inputs.pt", "inputs.txt",
            "model.txt"} <= \
        set(manifest["files"])
    assert "float32[5] stride (1) cpu" in (bundle / "inputs.txt").read_text()
    error = (bundle / "error.txt").read_text()
    assert "Traceback" in error and manifest["error_type"] in error

    proc = run_repro(str(bundle))
    assert proc.returncode != 0
    assert_same_failure(proc, manifest)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("fresh_inductor")
@pytest.mark.parametrize("artifact", ["package", "python"])
def test_an_inductor_error_leaves_eager_serving_and_its_bundle_fails_the_same_way(sched, tmp_path, artifact):
    """In either form: the bundle's script compiles in the form the worker did."""
    cxx = compiler(tmp_path, "broken-g++", 'echo "broken-g++: this compiler compiles nothing" >&2\nexit 1\n')
    model, x = background_models.make_mlp()
    compiled = aiotorch.compile_in_background(model, options={"cpp.cxx": (None, cxx)}, scheduler=sched,
                                              artifact=artifact)
    shape = asyncio.run(compiled.ready(x))
    assert shape.state == "failed" and "compile failed" in shape.error
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    bundle = Path(shape.repro)
    manifest = bundle_manifest(str(bundle))
    assert manifest["stage"] == "compile" and manifest["error_type"] == "InductorError"
    assert "broken-g++" in manifest["inductor_configs"]["cpp.cxx"]
    graph = (bundle / "graph.py").read_text()
    assert "torch.ops.aten" in graph and "class GraphModule" in graph
    assert "f32[4, 16]" in graph

    proc = run_repro(str(bundle))
    assert proc.returncode != 0
    assert_same_failure(proc, manifest)
    assert "InvalidCxxCompiler" in proc.stderr and "broken-g++" in proc.stderr
    assert "InvalidCxxCompiler" in (bundle / "error.txt").read_text()
    assert f"FORM = {artifact!r}" in (bundle / "repro.py").read_text()
    assert ("standalone_compile" in proc.stderr) == (artifact == "python")


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("fresh_inductor")
def test_a_worker_killed_mid_compile_leaves_eager_serving_with_a_bundle(sched, tmp_path):
    # The compiler kills the process that runs it: the worker, in the middle of Inductor's
    # compile. The scheduler fails the job at once (max_crashes=1).
    cxx = compiler(tmp_path, "killer-g++", "kill -9 $PPID\nexit 1\n")
    model, x = background_models.make_mlp()
    compiled = aiotorch.compile_in_background(model, options={"cpp.cxx": (None, cxx)}, scheduler=sched)
    shape = asyncio.run(compiled.ready(x))
    assert shape.state == "failed" and shape.error.startswith("WorkerCrashed")
    assert "SIGKILL" in shape.error or "-9" in shape.error
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    # Written by the parent, the worker being gone: the model and inputs, and the script.
    manifest = bundle_manifest(shape.repro)
    assert manifest["stage"].startswith("unknown") and manifest["error_type"] == "WorkerCrashed"
    assert {"model.pkl", "weights.bin", "inputs.pt", "repro.py"} <= set(manifest["files"])
    assert wait_until(lambda: sched.statistics().worker_crashes >= 1)

    proc = run_repro(shape.repro)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("fresh_inductor")
def test_a_compile_past_its_timeout_leaves_eager_serving_with_a_bundle(sched, tmp_path):
    # A compiler that never returns: the compile runs past its timeout, its worker (and the
    # compiler with it) is killed.
    cxx = compiler(tmp_path, "stuck-g++", "while :; do sleep 1; done\n")
    model, x = background_models.make_mlp()
    compiled = aiotorch.compile_in_background(model, options={"cpp.cxx": (None, cxx)}, scheduler=sched, timeout=5)
    shape = asyncio.run(compiled.ready(x))
    assert shape.state == "failed" and shape.error.startswith("JobTimeout"), shape.error
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    manifest = bundle_manifest(shape.repro)
    assert manifest["stage"] == "unknown (the worker timed out)" and manifest["error_type"] == "JobTimeout"


@pytest.mark.timeout(TIMEOUT)
def test_workers_of_a_background_scheduler_start_with_the_compile_imported_and_the_cpu_check_made():
    # The fork server imports what a compile needs, once, and makes Inductor's CPU
    # vector-ISA check meanwhile: a worker forked from it has all of it before its first
    # job (each worker importing it in its warm-up, and making the check in its compile,
    # made the first compile queue behind that).
    from torch._inductor import cpu_vec_isa

    from aiocompile._torch import export

    config = aiocompile.SchedulerConfig(workers=1, preload=(aiotorch.PRELOAD, export.PRELOAD), repro_dir=None)
    own = aiocompile.Scheduler(config=config)
    try:
        assert asyncio.run(own.run(background_models.compile_modules_loaded)) == list(export._MODULES)
        assert asyncio.run(own.run(export.warm_up)) < 0.5
        known, picked = asyncio.run(own.run(background_models.vec_isa_known))
        if os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") is not None:
            assert known == 0  # the environment answers the check: nothing made ahead
        else:
            assert known == 1
            assert picked == str(cpu_vec_isa.pick_vec_isa())  # the answer this process's own check gives
    finally:
        own.close(grace=0)


# -- the C++ compiler ------------------------------------------------------------------------


@pytest.fixture
def static_gxx(tmp_path):
    """A g++ whose C++ library is only the static archive, as a GCC built without a shared
    libstdc++ has it (``tests/test_inductor_cxx.py``): what it links carries its own copy of
    the C++ library."""
    from test_inductor_cxx import static_gxx as make

    return make(tmp_path)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("fresh_inductor")
def test_a_package_built_by_a_compiler_without_a_shared_cxx_library_does_not_load(sched, static_gxx):
    # Named by the caller, the compiler is used as given: its package fails the worker's
    # trial load (std::bad_cast in AOTInductor's constructor here; SIGSEGV on the H100
    # host), and eager keeps serving.
    model, x = background_models.make_mlp()
    compiled = aiotorch.compile_in_background(model, options={"cpp.cxx": (None, static_gxx), **NO_HEADERS},
                                              scheduler=sched, artifact="package")
    shape = asyncio.run(compiled.ready(x))
    assert shape.state == "failed", shape
    assert "trial failed" in shape.error or shape.error.startswith("WorkerCrashed"), shape.error
    assert f"built by the C++ compiler {(None, static_gxx)!r}" in shape.error or "trial failed" not in shape.error
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("fresh_inductor")
def test_a_default_compiler_without_a_shared_cxx_library_is_stood_in_for(static_gxx, repro_root, monkeypatch):
    # The environment's compiler (CXX, as the workers start with it) has no shared C++
    # library: the package is built by g++ instead, loads, and serves; the status says so.
    monkeypatch.setenv("CXX", static_gxx)
    config = aiocompile.SchedulerConfig(workers=1, preload=(aiotorch.PRELOAD,), repro_dir=str(repro_root))
    own = aiocompile.Scheduler(config=config)
    try:
        model, x = background_models.make_mlp()
        compiled = aiotorch.compile_in_background(model, scheduler=own, artifact="package")
        shape = asyncio.run(compiled.ready(x))
        assert shape.state == "compiled", shape.error
        assert shape.compiler is not None and f"in place of {static_gxx}" in shape.compiler
        assert "no shared libstdc++" in shape.compiler and shape.to_dict()["compiler"] == shape.compiler
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        assert compiled.status().shapes[0].compiled_calls == 1
    finally:
        own.close(grace=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("fresh_inductor")
@pytest.mark.parametrize(("artifact", "form"), [("auto", "python"), ("package", "package")])
def test_on_a_gpu_a_model_run_eagerly_first_is_served_compiled(sched, artifact, form):
    """The serving process has run the model on the GPU (CUDA initialised, kernels
    loaded) before the compiled version is loaded into it; on a GPU the default form is
    the Python wrapper."""
    model, x = background_models.make_mlp()
    model, x = model.cuda(), x.cuda()
    with torch.no_grad():
        expected = model(x)
    compiled = aiotorch.compile_in_background(model, scheduler=sched, artifact=artifact)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), expected)
    shape = asyncio.run(compiled.ready(x))
    assert shape.state == "compiled", shape.error
    assert shape.form == form
    print(form, "built with", shape.compiler, "stages", dict(shape.stages))
    assert shape.signature == f"f32[4, 16] {x.device}"
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), expected, rtol=1e-3, atol=1e-3)
    assert compiled.status().shapes[0].compiled_calls == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_call_is_over_for_aiocompiles_threads_once_its_kernels_are_done(sched):
    """While a thread of aiocompile's runs Python beside the calls (inside
    ``handing_over``, as a load's imports do), a call on a GPU is over for it only once
    the call's kernels are done: its caller's wait for them then takes the interpreter
    lock back at once. With no such thread, nothing is put off."""
    import time

    from aiocompile._base import aside

    # Kernels that run for milliseconds after the call has returned.
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda().eval()
    x = torch.randn(4096, 4096, device="cuda")
    compiled = aiotorch.compile_in_background(model, scheduler=sched, disable=True)
    with torch.no_grad():
        expected = model(x)
        torch.cuda.synchronize()
        assert wait_until(lambda: not aside.busy(), timeout=120)  # another test's threads
        out = compiled(x)
        assert aside.serving() == 0
        torch.testing.assert_close(out, expected)

        with busy_inside_handing_over() as (turns, _):
            out = compiled(x)
            returned = time.perf_counter()
            assert aside.serving() == 1, "the call's end was not put off for its kernels"
            torch.cuda.synchronize()
            synchronised = time.perf_counter()
            assert wait_until(lambda: aside.serving() == 0, timeout=1)
            torch.testing.assert_close(out, expected)
            # The kernels ran for milliseconds; the helper stood aside throughout (within
            # the bound standing aside has).
            print(f"kernels done {1e3 * (synchronised - returned):.1f} ms after the call returned")
            if synchronised - returned < aside.STAND_ASIDE_MAX - 0.002:
                assert not [at for at in turns if returned + 0.001 < at < synchronised - 0.001]
        assert wait_until(lambda: not aside.busy(), timeout=120)
        compiled.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("fresh_inductor")
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("start", ["own", "warmed"])
def test_on_a_gpu_the_scheduler_aiocompile_makes_compiles(start):
    """Without a scheduler given, as a server uses it: the one the constructor makes (in a
    thread), or the one ``warm("cuda")`` made. Its fork server preloads nothing that makes
    a CUDA context there (a worker forked from a process with one cannot use the GPU)."""
    model, x = background_models.make_mlp()
    model, x = model.cuda(), x.cuda()
    with torch.no_grad():
        expected = model(x)

    async def serve() -> aiotorch.ShapeStatus:
        warmed = await aiotorch.warm("cuda") if start == "warmed" else None
        compiled = aiotorch.compile_in_background(model)
        try:
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), expected)
            shape = await compiled.ready(x)
            assert shape.state == "compiled", shape.error
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), expected, rtol=1e-3, atol=1e-3)
            assert compiled.status().shapes[0].compiled_calls == 1
            assert warmed is None or compiled.scheduler is warmed
            return shape
        finally:
            compiled.close()
            await compiled.aclose()
            if warmed is not None:
                await warmed.aclose()

    print(start, dict(asyncio.run(serve()).stages))


@pytest.mark.timeout(TIMEOUT)
def test_no_bundle_is_written_when_bundles_are_off():
    config = aiocompile.SchedulerConfig(workers=1, preload=(aiotorch.PRELOAD,), repro_dir=None)
    own = aiocompile.Scheduler(config=config)
    try:
        compiled = aiotorch.compile_in_background(background_models.DataDependent(), scheduler=own)
        shape = asyncio.run(compiled.ready(torch.ones(2)))
        assert shape.state == "failed" and "export failed" in shape.error and shape.repro is None
    finally:
        own.close(grace=0)


def assert_same_failure(proc: subprocess.CompletedProcess, manifest: dict) -> None:
    """The repro script died of the error the bundle records: its type, and its
    message's first line."""
    assert f"{manifest['error_type']}: " in proc.stderr, proc.stderr[-3000:]
    assert manifest["error"].strip().splitlines()[0] in proc.stderr, proc.stderr[-3000:]


# -- the Python form ---------------------------------------------------------------------------


def test_the_python_forms_plan_binds_weights_constants_and_argument_leaves_in_the_graphs_order():
    torch.manual_seed(0)
    model = background_models.Keyed().eval()
    args, kwargs = background_models.keyed_inputs()
    program = torch.export.export(model, args, dict(sorted(kwargs.items())))
    plan = _graph.plan_of(program)
    assert plan is not None
    assert plan.inputs == (("weight", "proj.weight"), ("weight", "proj.bias"), ("weight", "shift"),
                           ("constant", "offset"), ("input", 0), ("input", 1), ("input", 2), ("input", 3))
    assert plan.constants == ("offset",)
    # The leaves are the call's (args, kwargs) with keywords in name order, whatever order
    # the call gives them in.
    state = {**dict(program.state_dict), **dict(program.constants)}
    reordered = {"gate": kwargs["gate"], "bias": kwargs["bias"]}
    flat = _graph.flat_inputs(plan, lambda kind, name: state[name], args, reordered)
    assert flat[4] is args[0] and flat[5] == 3 and flat[6] is kwargs["bias"] and flat[7] is kwargs["gate"]
    # The graph run on those inputs gives the model's output in the model's structure.
    out = torch.utils._pytree.tree_unflatten(list(program.graph_module(*flat)),
                                             torch.utils._pytree.treespec_loads(plan.out_spec))
    torch.testing.assert_close(out, model(*args, **kwargs))


def test_a_program_whose_outputs_include_a_buffers_new_value_has_no_python_plan():
    """``torch.export`` keeps an in-place update in the graph (AOTAutograd applies it to the
    bound buffer: the next test); a functionalised program returns the new value instead,
    which the plan would have to copy back, so it has none."""
    program = torch.export.export(background_models.Counts().eval(), (torch.randn(3),))
    assert _graph.plan_of(program) is not None
    assert _graph.plan_of(program.run_decompositions()) is None


@pytest.mark.parametrize(("variable", "names"), [
    ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_FX_GRAPH_CACHE=0"),
    ("TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE=0"),
])
def test_a_process_whose_environment_turns_inductors_caches_off_cannot_make_the_python_form(variable, names):
    """The variables are read when torch is imported: a fresh interpreter, with the
    variable and without it (the two side by side: each spends its time importing torch)."""
    code = "from aiocompile._torch import graph; print(graph.unavailable())"
    env = {**subprocess_env(), variable: "0"}
    without = dict(env)
    without.pop(variable)
    off, on = (subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=e) for e in (env, without))
    off_out, off_err = off.communicate(timeout=TIMEOUT)
    on_out, on_err = on.communicate(timeout=TIMEOUT)
    assert off.returncode == 0, off_err
    assert names in off_out
    assert on_out.strip() == "None", on_err


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("fresh_inductor")
@pytest.mark.parametrize("artifact", ["python", "package"])
def test_either_form_serves_compiled_with_the_models_own_weights(sched, artifact):
    """On the CPU the default is a package (loaded with torch's C++ loader, called by its
    own call spec: keywords in its order, plain values dropped); asked for, the Python
    form compiles there too (Inductor's C++ kernels under a Python wrapper)."""
    torch.manual_seed(0)
    model = background_models.Keyed().eval()
    args, kwargs = background_models.keyed_inputs()
    with torch.no_grad():
        expected = model(*args, **kwargs)
    compiled = aiotorch.compile_in_background(model, scheduler=sched, artifact=artifact)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args, **kwargs), expected, rtol=0, atol=0)
    shape = asyncio.run(compiled.ready(*args, **kwargs))
    assert shape.state == "compiled", shape.error
    assert (shape.form, shape.form_reason) == (artifact, None)
    assert (shape.compiler is None) == (artifact == "python")
    assert shape.max_abs_difference is not None and shape.max_abs_difference < 1e-4
    with torch.no_grad():
        # Keywords in another order are the same signature.
        got = compiled(*args, bias=kwargs["bias"], gate=kwargs["gate"])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert compiled.status().shapes[0].compiled_calls == 1
    # The weights are the model's own, not a copy: changed in place, the compiled version
    # uses them as they are.
    with torch.no_grad():
        model.proj.weight.mul_(2)
        model.shift.add_(1)
        expected = model(*args, **kwargs)
        torch.testing.assert_close(compiled(*args, **kwargs), expected, rtol=1e-4, atol=1e-5)
    assert compiled.status().shapes[0].compiled_calls == 2


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("fresh_inductor")
def test_a_model_that_updates_a_buffer_in_place_updates_its_own_buffer_when_compiled(sched, monkeypatch):
    from aiocompile._torch import loading

    # Nor is it called before the switch: that call would count too.
    monkeypatch.setattr(loading, "first_call", lambda runner, inputs: pytest.fail("called before the switch"))
    model = background_models.Counts().eval()
    x = torch.randn(3)
    compiled = aiotorch.compile_in_background(model, scheduler=sched, artifact="python")
    with torch.no_grad():
        compiled(x)
    shape = asyncio.run(compiled.ready(x))
    assert shape.state == "compiled" and shape.form == "python", shape.error
    assert model.calls.item() == 1  # the eager call; the worker's trial updated its own copy
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), x * 2)
        compiled(x)
    assert compiled.status().shapes[0].compiled_calls == 2
    assert model.calls.item() == 3


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("fresh_inductor")
def test_the_python_form_of_a_model_a_call_leaves_as_it_was_is_called_once_before_the_switch(sched, monkeypatch):
    """Its first call's set-up is made in the load's thread, not by the caller's first
    call (a model that updates a buffer is not called there: the test above)."""
    from torch._inductor import codecache

    from aiocompile._torch import loading

    made: list[str] = []
    real = loading.first_call
    monkeypatch.setattr(loading, "first_call", lambda runner, inputs: (made.append("call"), real(runner, inputs))[1])
    # The wrapper's module is run from the code the worker compiled (``graph_code``):
    # Inductor's own loader, which compiles its source, loads nothing here.
    compiled_here: list[str] = []
    load_module = codecache._reload_python_module
    monkeypatch.setattr(codecache, "_reload_python_module",
                        lambda key, path, *args, **kwargs: (compiled_here.append(path),
                                                            load_module(key, path, *args, **kwargs))[1])
    model = background_models.Keyed().eval()
    args, kwargs = background_models.keyed_inputs()
    compiled = aiotorch.compile_in_background(model, scheduler=sched, artifact="python")
    with torch.no_grad():
        compiled(*args, **kwargs)
    shape = asyncio.run(compiled.ready(*args, **kwargs))
    assert (shape.state, shape.form) == ("compiled", "python"), shape.error
    assert made == ["call"]
    assert compiled.status().shapes[0].compiled_calls == 0  # the call made there is not the caller's
    assert compiled_here == []


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("fresh_inductor")
def test_the_convolutions_of_the_first_call_are_made_one_per_call_in_the_serving_thread_before_the_switch(
        sched, monkeypatch):
    """The load's first call records its convolutions (on a GPU: cuDNN keeps their plans per
    thread; recorded here on the CPU); after the switch each call with these inputs is
    answered eagerly while it makes one of them in its own thread, then compiled."""
    from aiocompile._torch import thread_plans

    real = thread_plans.recording
    monkeypatch.setattr(thread_plans, "recording", lambda device_type="cuda": real("cpu"))
    _served_compiled_after_priming(sched, monkeypatch, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("fresh_inductor")
@pytest.mark.timeout(TIMEOUT)
def test_on_a_gpu_the_serving_thread_makes_the_convolutions_plans_before_the_switch(sched, monkeypatch):
    _served_compiled_after_priming(sched, monkeypatch, "cuda")


def _primes_made(monkeypatch) -> list[int]:
    """The threads that make the primes from now on, one entry per prime made."""
    from aiocompile._torch import thread_plans

    made: list[int] = []
    real_prime = thread_plans.Prime.__call__

    def noted(prime):
        made.append(threading.get_ident())
        real_prime(prime)

    monkeypatch.setattr(thread_plans.Prime, "__call__", noted)
    return made


@pytest.mark.usefixtures("fresh_inductor")
async def test_in_an_event_loop_the_plans_are_made_between_calls_not_inside_them(sched, monkeypatch):
    """Calls made from a loop's task: each call after the switch returns without making a
    plan; the loop makes it, in the same thread, once the task's step is done. Two calls
    in one step (no step between them): the second makes the plan the first asked for."""
    import anyio

    from aiocompile._torch import thread_plans

    real = thread_plans.recording
    monkeypatch.setattr(thread_plans, "recording", lambda device_type="cuda": real("cpu"))
    made = _primes_made(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1),
                                torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, 3, padding=1)).eval()
    x = torch.randn(2, 3, 16, 16)
    compiled = aiotorch.compile_in_background(model, scheduler=sched, artifact="python")
    with torch.no_grad():
        compiled(x)
        shape = await compiled.ready(x)
        assert (shape.state, shape.form) == ("compiled", "python"), shape.error
        here = threading.get_ident()

        async def made_by_the_loop(count: int) -> None:
            for _ in range(2000):
                if len(made) >= count:
                    return
                await anyio.sleep(0.001)
            raise AssertionError(f"the loop made {len(made)} plans, not {count}")

        compiled(x)
        assert made == []  # not inside the call
        await made_by_the_loop(1)
        assert made == [here]
        compiled(x)
        compiled(x)  # the same step: makes the one the call before asked for
        assert made == [here, here]
        await made_by_the_loop(3)
        assert made == [here] * 3
        while compiled.status().shapes[0].compiled_calls == 0:
            compiled(x)
            await anyio.sleep(0.001)
    assert set(made) == {here}
    assert len(made) >= 4  # one per distinct convolution (four here)


def _served_compiled_after_priming(sched, monkeypatch, device: str) -> None:
    from aiocompile._torch import loading

    made = _primes_made(monkeypatch)
    recorded: list[int] = []
    first_call = loading.first_call
    monkeypatch.setattr(loading, "first_call",
                        lambda runner, inputs: (lambda primes: (recorded.append(len(primes)), primes)[1])(
                            first_call(runner, inputs)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1),
                                torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1)).eval().to(device)
    x = torch.randn(2, 3, 16, 16, device=device)
    with torch.no_grad():
        expected = model(x)
    compiled = aiotorch.compile_in_background(model, scheduler=sched, artifact="python")
    with torch.no_grad():
        compiled(x)
    shape = asyncio.run(compiled.ready(x))
    assert (shape.state, shape.form) == ("compiled", "python"), shape.error
    assert recorded and recorded[0] >= 2, recorded  # its distinct convolutions
    eager_before = compiled.status().shapes[0].eager_calls
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if device == "cpu" else {"rtol": 1e-2, "atol": 1e-2}
    with torch.no_grad():
        for _ in range(recorded[0]):
            torch.testing.assert_close(compiled(x), expected, **tolerance)
        status = compiled.status().shapes[0]
        assert (status.eager_calls - eager_before, status.compiled_calls) == (recorded[0], 0)
        assert made == [threading.get_ident()] * recorded[0]
        torch.testing.assert_close(compiled(x), expected, **tolerance)
    assert compiled.status().shapes[0].compiled_calls == 1
