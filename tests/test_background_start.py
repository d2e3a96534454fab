"""``compile_in_background`` from a cold start: the constructor and the first call hold
neither the caller's thread nor its event loop for the compile's start-up, and a start-up
that fails leaves the model served eagerly, the reason in ``status()``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import subprocess_env

torch = pytest.importorskip("torch")

import background_models  # noqa: E402  (needs torch)

import aiocompile  # noqa: E402
import aiocompile.torch as aiotorch  # noqa: E402

TIMEOUT = 300

# A fresh interpreter (a server's start): every import of Inductor or Dynamo is noted with
# the thread that made it, and the constructor's scheduler is asked how far its workers got.
SCRIPT = textwrap.dedent('''
    import json
    import sys
    import threading

    import anyio
    import torch

    import background_models
    import aiocompile.torch as aiotorch

    HEAVY = ("torch._inductor", "torch._dynamo", "aiocompile._core", "aiocompile._pool")
    seen = []


    class Noting:
        def find_spec(self, name, path=None, target=None):
            if name.startswith(HEAVY):
                seen.append((name, threading.current_thread().name))
            return None


    sys.meta_path.insert(0, Noting())
    model, x = background_models.make_mlp()


    async def serve():
        with torch.no_grad():
            expected = model(x)
            compiled = aiotorch.compile_in_background(model, artifact=sys.argv[3])
            in_constructor = [name for name, thread in seen if thread == "MainThread"]
            first = compiled(x)
            state = compiled.state(x)
            on_the_caller = [name for name, thread in seen if thread == "MainThread"]
            workers = compiled.scheduler.statistics().workers_started
            final = None
            if sys.argv[2] == "to-the-end":
                final = (await compiled.ready(x)).state
                assert torch.allclose(compiled(x), expected, rtol=1e-4, atol=1e-5)
        compiled.close()  # in the loop: returns at once
        await compiled.aclose()
        print(json.dumps({"in_constructor": in_constructor, "workers_at_first_call": workers,
                          "first_equal": bool(torch.equal(first, expected)), "state": state,
                          "on_the_caller": on_the_caller, "closed": compiled.scheduler.closed, "final": final,
                          "inductor_here": sorted({name for name, _ in seen if name.startswith(HEAVY[:2])})}))


    anyio.run(serve, backend=sys.argv[1])
''')

def _serve(tmp_path, script_text: str, backend: str, *args: str) -> dict:
    """Run ``script_text`` as a program under ``backend`` (a fresh interpreter, an empty
    Inductor cache) and return the JSON its last line prints."""
    pytest.importorskip(backend)
    script = tmp_path / "serve.py"
    script.write_text(script_text)
    tests = str(__import__("pathlib").Path(__file__).parent)
    run = subprocess.run([sys.executable, str(script), backend, *args], capture_output=True, text=True, timeout=TIMEOUT,
                         env=subprocess_env(PYTHONPATH=f"{subprocess_env()['PYTHONPATH']}:{tests}",
                                            TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_constructor_and_first_call_import_no_compiler_and_wait_for_no_worker(tmp_path, backend):
    # Under asyncio the compile of a package is also followed to its end; under trio the
    # default form's first call.
    answer = _serve(tmp_path, SCRIPT, backend, *(("to-the-end", "package") if backend == "asyncio"
                                                  else ("first-call", "auto")))
    # The scheduler's stack is imported in a thread of aiocompile's, Inductor and Dynamo
    # only by workers: the caller's thread imports none of them.
    assert answer["in_constructor"] == [] and answer["on_the_caller"] == []
    # The constructor and the first call returned without waiting for a worker.
    assert answer["workers_at_first_call"] == 0
    assert answer["first_equal"] is True and answer["state"] == "compiling"
    assert answer["closed"] is True
    if backend == "asyncio":
        # The package is loaded with torch's C++ loader: the serving process never imports
        # Inductor (nor makes its CPU check), in any thread.
        assert answer["final"] == "compiled" and answer["inductor_here"] == []


# A program that ends while its compile is still starting: the wrapper closed (which returns
# at once), then the interpreter exits, and its scheduler's close ends the compile there.
EXIT_SCRIPT = textwrap.dedent('''
    import sys

    import anyio
    import torch

    import background_models
    import aiocompile.torch as aiotorch

    model, x = background_models.make_mlp()


    async def serve():
        compiled = aiotorch.compile_in_background(model)
        with torch.no_grad():
            for _ in range(100):  # its job submitted meanwhile, its workers still starting
                compiled(x)
                await anyio.sleep(0.01)
        print("state", compiled.state(x))
        compiled.close()


    anyio.run(serve, backend=sys.argv[1])
''')


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_program_that_ends_while_compiling_exits_quietly(tmp_path, backend):
    pytest.importorskip(backend)
    script = tmp_path / "serve.py"
    script.write_text(EXIT_SCRIPT)
    tests = str(__import__("pathlib").Path(__file__).parent)
    run = subprocess.run([sys.executable, str(script), backend], capture_output=True, text=True, timeout=TIMEOUT,
                         env=subprocess_env(PYTHONPATH=f"{subprocess_env()['PYTHONPATH']}:{tests}",
                                            TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "state compiling"
    assert "Traceback" not in run.stderr and "exception calling callback" not in run.stderr, run.stderr[-3000:]


@pytest.fixture
def unstartable(tmp_path, monkeypatch):
    """A scheduler whose fork server dies while it starts (a preload that exits)."""
    (tmp_path / "exits_at_import.py").write_text(
        "import os, sys\nsys.stderr.write('this machine cannot start a compiler\\n')\nos._exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{subprocess_env()['PYTHONPATH']}")
    config = aiocompile.SchedulerConfig(workers=1, preload=("exits_at_import",))
    scheduler = aiocompile.Scheduler(config=config)
    yield scheduler
    scheduler.close(grace=0)


@pytest.mark.timeout(TIMEOUT)
async def test_a_start_up_that_fails_leaves_eager_serving_with_the_reason_in_status(unstartable):
    model, x = background_models.make_mlp()
    compiled = aiotorch.compile_in_background(model, scheduler=unstartable)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
        shape = await compiled.ready(x)
        assert shape.state == "failed"
        assert "could not start worker processes" in shape.error and "cannot start a compiler" in shape.error
        for _ in range(3):
            torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    (status,) = compiled.status().shapes
    assert (status.state, status.eager_calls, status.compiled_calls) == ("failed", 4, 0)
    assert status.error == shape.error


# A server that pays the start-up ahead: warm(), then the model wrapped and compiled. It
# has loaded model classes of an installed library (one module of it imports only once: a
# worker's import fails) and of its own files.
WARM_SCRIPT = textwrap.dedent('''
    import json
    import os
    import sys

    import anyio
    import torch

    import background_models
    import aiocompile.torch as aiotorch

    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "site-packages"))
    import fancy_models.layers
    import fancy_models.once
    import own_models

    model, x = background_models.make_mlp()


    async def serve():
        scheduler = await aiotorch.warm()
        pids = sorted(scheduler.worker_pids())
        started = scheduler.statistics().workers_started
        paid = [await scheduler.run(background_models.first_compile_paid) for _ in pids]
        policies = [os.sched_getscheduler(pid) == os.SCHED_IDLE for pid in pids]
        names = ["fancy_models.layers", "fancy_models.once", "own_models"]
        imported = [await scheduler.run(background_models.modules_loaded, names) for _ in pids]
        again = await aiotorch.warm()  # idempotent: the same scheduler, nothing started
        compiled = aiotorch.compile_in_background(model)
        with torch.no_grad():
            expected = model(x)
            shape = await compiled.ready(x)
            out = compiled(x)
        compiled.close()  # not its scheduler to close
        print(json.dumps({
            "same": again is scheduler and compiled.scheduler is scheduler, "pids": pids, "started": started,
            "paid": paid, "imported": imported, "idle": policies,
            "pids_after": sorted(scheduler.worker_pids()), "started_after": scheduler.statistics().workers_started,
            "state": shape.state, "error": shape.error, "compiled_calls": compiled.status().shapes[0].compiled_calls,
            "equal": bool(torch.allclose(out, expected, rtol=1e-4, atol=1e-4)), "open": not scheduler.closed}))
        await scheduler.aclose()


    anyio.run(serve, backend=sys.argv[1])
''')


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_after_warm_a_background_compile_starts_no_process_and_compiles(tmp_path, backend):
    library = tmp_path / "site-packages" / "fancy_models"
    library.mkdir(parents=True)
    (library / "__init__.py").write_text("")
    (library / "layers.py").write_text("import torch\n\nclass Scale(torch.nn.Module):\n    pass\n")
    (library / "once.py").write_text(textwrap.dedent('''
        import pathlib
        import torch

        mark = pathlib.Path(__file__).with_suffix(".imported")
        if mark.exists():
            raise RuntimeError("imported once already")
        mark.write_text("")

        class Once(torch.nn.Module):
            pass
    '''))
    (tmp_path / "own_models.py").write_text("import torch\n\nclass Own(torch.nn.Module):\n    pass\n")
    answer = _serve(tmp_path, WARM_SCRIPT, backend)
    # warm() returned with every worker started; the compile ran in one of them.
    assert answer["pids"] and answer["started"] == len(answer["pids"])
    # ... and had paid what a first compile for the CPU sets up once per process (each
    # worker asked answered so).
    assert answer["paid"] == [{"vec_isa": 1, "patterns": 1}] * len(answer["pids"])
    # ... and imported the library's model modules, not the program's own files; the module
    # that failed to import there left warm() to succeed.
    assert answer["imported"] == [["fancy_models.layers"]] * len(answer["pids"])
    # Nobody waits on its compiles: its workers take only the CPU time the program leaves.
    assert answer["idle"] == [True] * len(answer["pids"])
    assert answer["same"] is True
    assert answer["pids_after"] == answer["pids"] and answer["started_after"] == answer["started"]
    assert answer["state"] == "compiled", answer["error"]
    assert answer["compiled_calls"] == 1 and answer["equal"] is True
    assert answer["open"] is True


async def test_warm_refuses_a_device_it_does_not_know():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        await aiotorch.warm("tpu")
    with pytest.raises(TypeError, match="'cpu' or 'cuda'"):
        await aiotorch.warm(0)


# The Python form's load is prepared in this process (``_torch/ahead.py``), not at the
# constructor: for a model on the CPU whose installation has the bytecode of what it
# imports, as soon as the scheduler the wrapper made exists (beside its fork server's start,
# rather than beside the worker's compile); else once a worker of that scheduler has ended
# its warm-up (whose imports wrote the bytecode that modules installed without any then
# read here). For a model on the CPU it makes Inductor's vector-ISA check too, which the
# load's kernels need, and imports past what the check needs only once a worker has warmed
# up.
AHEAD_SCRIPT = textwrap.dedent('''
    import json
    import sys
    import time

    import torch

    import background_models
    import aiocompile.torch as aiotorch
    from aiocompile._torch import ahead, warming

    installed = sys.argv[2] == "installed"
    warming._load_bytecode_installed = lambda: installed
    started = []
    real_start = ahead.Ahead.start

    def noting_start(self):
        started.append(time.time())
        real_start(self)

    ahead.Ahead.start = noting_start
    rest = []
    real_rest = ahead._await_rest

    def noting_rest():
        went_on = real_rest()
        rest.append(time.time())
        return went_on

    ahead._await_rest = noting_rest
    ended = []

    def note(event):
        if getattr(event, "event", None) == "job_ended" and getattr(event, "warm_up", False):
            ended.append(event.time)

    model, x = background_models.make_mlp()
    compiled = aiotorch.compile_in_background(model, artifact="python")
    at_constructor = bool(started)
    with torch.no_grad():
        compiled(x)  # the compile is submitted as soon as the scheduler is made
    scheduler = compiled.scheduler  # made in a thread: this waits for it
    scheduler.subscribe(note)
    at_scheduler = bool(started)
    deadline = time.time() + 240
    while not ahead.GRAPH_LOAD.started and time.time() < deadline:
        time.sleep(0.01)
    ahead.GRAPH_LOAD.wait(240)
    while not ended and time.time() < deadline:
        time.sleep(0.01)
    from torch._inductor import cpu_vec_isa

    isa_known = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize
    compiled.close()
    print(json.dumps({"at_constructor": at_constructor, "at_scheduler": at_scheduler, "started": started,
                      "first_warm_up_ended": min(ended) if ended else None,
                      "made": ahead.GRAPH_LOAD.seconds is not None, "isa_known": isa_known, "rest": rest}))
''')


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("bytecode", ["installed", "missing"])
def test_the_python_forms_load_is_prepared_with_the_fork_server_or_once_a_worker_has_warmed_up(tmp_path, bytecode):
    answer = _serve(tmp_path, AHEAD_SCRIPT, "asyncio", bytecode)
    assert answer["at_constructor"] is False
    assert answer["started"] and answer["first_warm_up_ended"] is not None
    if bytecode == "installed":
        assert answer["at_scheduler"] is True
        # The warm-up ends once the fork server has imported torch and Inductor: seconds.
        assert answer["started"][0] < answer["first_warm_up_ended"]
    else:
        assert answer["at_scheduler"] is False
        # The event's time is taken as the warm-up's answer is settled, a moment after the
        # future whose end starts the preparation; the warm-up itself took seconds.
        assert answer["started"][0] >= answer["first_warm_up_ended"] - 0.05
    assert answer["made"] is True
    assert answer["isa_known"] == 1  # the check made, its answer kept for the load
    # Past what the check needs, the imports wait for the fork server's start (a worker's
    # warm-up ended): the first compile waits for that, the load's imports only later.
    assert len(answer["rest"]) == 1 and answer["rest"][0] >= answer["first_warm_up_ended"] - 0.05


# A wrapper closed right after its first call, while its fork server starts: its warm-ups
# are cancelled, no compile will come, and the load's imports stop after the ISA check.
CLOSED_SCRIPT = textwrap.dedent('''
    import json
    import sys

    import torch

    import background_models
    import aiocompile.torch as aiotorch
    from aiocompile._torch import ahead

    went_on = []
    real_rest = ahead._await_rest

    def noting_rest():
        went_on.append(real_rest())
        return went_on[-1]

    ahead._await_rest = noting_rest
    model, x = background_models.make_mlp()
    compiled = aiotorch.compile_in_background(model, artifact="python")
    with torch.no_grad():
        compiled(x)
    compiled.scheduler  # made in a thread: this waits for it, the workers still starting
    compiled.close()
    ahead.GRAPH_LOAD.wait(240)
    print(json.dumps({"went_on": went_on, "lowering": "torch._inductor.lowering" in sys.modules,
                      "codecache": "torch._inductor.codecache" in sys.modules, "state": compiled.state(x)}))
''')


@pytest.mark.timeout(TIMEOUT)
def test_a_wrapper_closed_before_its_workers_start_leaves_the_rest_of_the_loads_imports_undone(tmp_path):
    answer = _serve(tmp_path, CLOSED_SCRIPT, "asyncio")
    assert answer["went_on"] == [False]
    assert answer["codecache"] is True  # what the ISA check needs, imported before
    assert answer["lowering"] is False


def test_whether_the_loads_bytecode_is_installed_is_read_where_python_reads_it(tmp_path, monkeypatch):
    import importlib.util
    import os

    from aiocompile._torch import warming

    source = os.path.join(os.path.dirname(torch.__file__), "_inductor", "compile_fx.py")
    assert warming._load_bytecode_installed() is os.path.exists(importlib.util.cache_from_source(source))
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pycache"))  # where Python would look then
    assert warming._load_bytecode_installed() is False
    target = importlib.util.cache_from_source(source)
    os.makedirs(os.path.dirname(target))
    open(target, "wb").close()
    assert warming._load_bytecode_installed() is True
