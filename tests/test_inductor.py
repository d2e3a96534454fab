"""PyTorch Inductor: its kernel sources, ``inductor_triton``, the synchronous request path
and the ``torch.compile`` drop-in (``aiocompile.torch``).

Without a GPU (CI): reading Inductor's real kernel sources (captured on an H200 with
``tests/fixtures/capture_inductor_sources.py``), keys and what changes them, installing
and uninstalling, the synchronous path's records, cancellation and crash retries, a real
Inductor kernel sent through the installed path to a worker (which, with no GPU driver,
fails as Inductor's own worker would), and ``wait()`` on Inductor's futures.

With a GPU (``pytest -m gpu``): three models under ``torch.compile`` equal to eager, a
worker killed in the middle of their compilation, and ``inductor_triton`` returning a
kernel Inductor runs.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json
import os
import pickle
import signal
import subprocess
import sys
import threading

import anyio
import jobs
import pytest
from conftest import ROOT, wait_until

import aiocompile
from aiocompile._torch import install as torch_install
from aiocompile.backends import Request
from aiocompile.backends.inductor import InductorSource, parse_source

torch = pytest.importorskip("torch")

FIXTURES = json.loads((ROOT / "tests" / "fixtures" / "inductor_kernels.json").read_text())
KERNELS = FIXTURES["kernels"]
NO_PRELOAD = aiocompile.SchedulerConfig(workers=2, preload=())
HAS_CUDA = torch.cuda.is_available()


def gpu(test):
    """A test that compiles and runs Inductor's kernels: skipped without a CUDA GPU."""
    test = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (Inductor generates Triton for it)")(test)
    return pytest.mark.gpu(test)


def kernel_ids(kernel):
    return kernel["kernel_name"]


def one_kernel(kind="pointwise"):
    return next(k for k in KERNELS if parse_source(k["kernel_name"], k["source_code"]).heuristic == kind)


# -- reading Inductor's sources ------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS, ids=kernel_ids)
def test_real_inductor_sources_are_read_without_running_them(kernel):
    before = set(sys.modules)
    parsed = parse_source(kernel["kernel_name"], kernel["source_code"])
    assert "torch._inductor.runtime.triton_heuristics" not in set(sys.modules) - before
    assert parsed.kernel_name == kernel["kernel_name"]
    assert parsed.heuristic in {"pointwise", "reduction", "persistent_reduction", "template", "foreach",
                                "cooperative_reduction", "split_scan"}
    assert parsed.device_type == kernel["device_str"] == "cuda"
    assert parsed.target == "cuda:90" and parsed.warp_size == 32 and parsed.device_index == 0
    # The signature names the kernel's arguments, in order; the block sizes are constexprs.
    assert tuple(parsed.signature) == parsed.arg_names
    assert parsed.constexprs and all(name.endswith("BLOCK") for name in parsed.constexprs)
    assert parsed.size_hints
    assert parsed.inductor_meta["kernel_name"] == kernel["kernel_name"]


@pytest.mark.parametrize("kernel", KERNELS, ids=kernel_ids)
def test_specialisation_is_read_per_argument(kernel):
    parsed = parse_source(kernel["kernel_name"], kernel["source_code"])
    for name, attrs in parsed.specialization.items():
        assert name in parsed.signature and parsed.signature[name] != "constexpr"
        assert attrs and all(isinstance(attr, tuple) and len(attr) == 2 for attr in attrs)
    # Inductor's buffers come from its allocator, 16-byte aligned: every pointer is
    # specialised as divisible by 16.
    pointers = [name for name, kind in parsed.signature.items() if kind.startswith("*")]
    assert pointers
    for name in pointers:
        assert ("tt.divisibility", 16) in parsed.specialization.get(name, ()), name


def test_the_specialisation_of_a_source_is_what_its_configs_say():
    source = one_kernel()["source_code"]
    parsed = parse_source(one_kernel()["kernel_name"], source)
    first = parsed.arg_names[0]
    # Drop the first argument's entry from the configs: it is no longer specialised.
    edited = source.replace("(0,): [['tt.divisibility', 16]], ", "")
    assert edited != source
    again = parse_source(parsed.kernel_name, edited)
    assert first in parsed.specialization and first not in again.specialization
    assert {k: v for k, v in parsed.specialization.items() if k != first} == dict(again.specialization)


@pytest.mark.parametrize(
    ("name", "source", "error", "match"),
    [
        (123, "x = 1", TypeError, "kernel_name must be a str"),
        ("k", b"def k(): pass", TypeError, "source_code must be a str"),
        ("k", None, TypeError, "source_code must be a str"),
        ("not a name", "def f(): pass", ValueError, "identifier"),
        ("k", "def k(:\n", ValueError, "does not parse"),
        ("missing", "import triton\n@triton.jit\ndef other(x):\n    pass\n", ValueError,
         "defines no kernel named 'missing'.*other"),
        ("inner", "def outer():\n    def inner():\n        pass\n", ValueError, "no kernel named 'inner'"),
    ],
)
def test_bad_input_is_a_clear_error(name, source, error, match):
    with pytest.raises(error, match=match):
        parse_source(name, source)


def test_names_bound_other_ways_count_as_defined():
    source = "try:\n    import triton\nexcept ImportError:\n    pass\nif True:\n    k = lambda: None\n"
    assert parse_source("k", source).heuristic is None
    assert parse_source("triton", source).arg_names == ()


async def test_inductor_triton_checks_its_input_before_any_worker():
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    kernel = one_kernel()
    try:
        with pytest.raises(TypeError, match="source_code must be a str"):
            await sched.inductor_triton(kernel["kernel_name"], kernel["source_code"].encode())
        with pytest.raises(TypeError, match="device_str"):
            await sched.inductor_triton(kernel["kernel_name"], kernel["source_code"], device_str=None)
        with pytest.raises(ValueError, match="generated for 'cuda'"):
            await sched.inductor_triton(kernel["kernel_name"], kernel["source_code"], device_str="xpu")
        with pytest.raises(ValueError, match="no kernel named 'nope'"):
            await sched.inductor_triton("nope", kernel["source_code"])
        assert sched.worker_pids() == [] and sched.statistics().submitted == 0
    finally:
        await sched.aclose()


# -- keys and requests -------------------------------------------------------------------------------


def test_the_key_is_inductors_own_with_the_environment_and_settings_folded_in(monkeypatch):
    from torch._inductor.async_compile import CompiledTritonKernels

    from aiocompile.backends.inductor import _backend as inductor

    kernel = one_kernel()
    source = kernel["source_code"]
    assert inductor.inductor_key(source) == CompiledTritonKernels.key(source)
    request = inductor.build_request(kernel["kernel_name"], source)
    assert request.key == inductor.build_request(kernel["kernel_name"], source).key
    assert request.key != inductor.build_request(kernel["kernel_name"], source + "\n# another\n").key
    # What Triton builds depends on these; the key must too.
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert inductor.build_request(kernel["kernel_name"], source).key != request.key
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    assert inductor.build_request(kernel["kernel_name"], source).key == request.key
    base = inductor.inductor_key(source)
    assert inductor.request_key(base, {"use_static_triton_launcher": True}) != \
        inductor.request_key(base, {"use_static_triton_launcher": False})


def test_a_request_names_the_kernel_and_travels_by_reference(monkeypatch, tmp_path):
    from aiocompile.backends.inductor import _backend as inductor
    from aiocompile.backends.inductor import _worker as _inductor_worker

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_LIBDEVICE_PATH", raising=False)
    kernel = one_kernel()
    request = inductor.build_request(kernel["kernel_name"], kernel["source_code"])
    assert (request.backend, request.name, request.target) == ("inductor", kernel["kernel_name"], "cuda:90")
    assert request.encode is None and request.decode is None  # a live autotuner: never on disk
    assert request.fn is _inductor_worker.compile_triton
    assert pickle.loads(pickle.dumps(request.fn)) is request.fn
    name, source, env, unset, extra_config, key, target = pickle.loads(pickle.dumps(request.args))
    assert (name, source, key, target) == (kernel["kernel_name"], kernel["source_code"], request.key, "cuda:90")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path) and "TRITON_LIBDEVICE_PATH" in unset
    assert "use_static_triton_launcher" in extra_config


def test_the_worker_calls_inductors_own_worker_function_as_the_installed_torch_wants():
    from aiocompile.backends.inductor._worker import _torch_arguments

    values = {"load_kernel": "L", "extra_env": "E", "extra_config": "C"}

    def old(load_kernel, extra_env):
        pass

    def current(load_kernel, extra_env, extra_config):
        pass

    def streaming(load_kernel, extra_env, extra_config, streaming_address, streaming_authkey=None):
        pass

    assert _torch_arguments(old, values) == ["L", "E"]
    assert _torch_arguments(current, values) == ["L", "E", "C"]
    assert _torch_arguments(streaming, values) == ["L", "E", "C", None]
    from torch._inductor.runtime.compile_tasks import _worker_compile_triton

    assert _torch_arguments(_worker_compile_triton, values)[:2] == ["L", "E"]


# -- the synchronous request path ---------------------------------------------------------------------


def python_request(fn, *args, key=None):
    return Request(backend="python", key=key, name=fn.__name__, target=None, fn=fn, args=args, finish=lambda x: x)


def outcomes(sched):
    stats = sched.statistics()
    assert sum(stats.outcomes.values()) + stats.in_flight == stats.submitted
    return {name: count for name, count in stats.outcomes.items() if count}


def test_sync_requests_share_the_cache_and_are_recorded_once_each(tmp_path):
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    marker = tmp_path / "ran"
    try:
        first = sched.port.execute_sync(python_request(jobs.mark_then_sleep, str(marker), 0.5, "v", key="k"), None)
        second = sched.port.execute_sync(python_request(jobs.mark_then_sleep, str(marker), 0.5, "v", key="k"), None)
        assert first.result(timeout=60) == second.result(timeout=60) == "v"
        third = sched.port.execute_sync(python_request(jobs.mark_then_sleep, str(marker), 0.5, "v", key="k"), None)
        assert third.done() and third.result() == "v"
        assert len(marker.read_text().split()) == 1, "one job for three requests"
        assert wait_until(lambda: sched.statistics().in_flight == 0)
        assert outcomes(sched) == {"compiled": 1, "joined": 1, "cache_hit": 1}
        assert [r.outcome for r in sched.records()] == ["compiled", "joined", "cache_hit"]
    finally:
        sched.close()


def test_sync_requests_survive_crashes_and_time_out():
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(max_crashes=3))
    try:
        crashed = sched.port.execute_sync(python_request(jobs.exit_now, 3), None)
        hung = sched.port.execute_sync(python_request(jobs.hang), 0.5)
        innocent = sched.port.execute_sync(python_request(jobs.echo, "fine"), None)
        with pytest.raises(aiocompile.WorkerCrashed) as crash:
            crashed.result(timeout=60)
        assert crash.value.attempts == 3
        with pytest.raises(aiocompile.JobTimeout):
            hung.result(timeout=60)
        assert innocent.result(timeout=60) == "fine"
        assert wait_until(lambda: sched.statistics().in_flight == 0)
        stats = sched.statistics()
        assert (stats.worker_crashes, stats.retries, stats.timeouts) == (3, 2, 1)
        assert outcomes(sched) == {"crashed": 1, "timeout": 1, "compiled": 1}
    finally:
        sched.close()


def test_cancelling_a_sync_request_drops_its_queued_job(tmp_path):
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(workers=1))
    marker = tmp_path / "ran"
    try:
        busy = sched.port.execute_sync(python_request(jobs.sleep_then, 0.5, "busy"), None)
        queued = sched.port.execute_sync(python_request(jobs.mark_then_sleep, str(marker), 0), None)
        assert queued.cancel()
        assert busy.result(timeout=60) == "busy"
        assert sched.port.execute_sync(python_request(jobs.echo, "after"), None).result(timeout=60) == "after"
        assert not marker.exists(), "a cancelled queued job must never run"
        assert wait_until(lambda: sched.statistics().in_flight == 0)
        assert outcomes(sched) == {"compiled": 2, "cancelled": 1}
    finally:
        sched.close()


def test_a_sync_request_that_cannot_be_sent_fails_at_once_and_is_recorded():
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    try:
        with pytest.raises(TypeError):
            sched.port.execute_sync(python_request(jobs.echo, threading.Lock()), None)
        assert outcomes(sched) == {"error": 1}
    finally:
        sched.close()
    with pytest.raises(aiocompile.SchedulerClosed):
        sched.port.execute_sync(python_request(jobs.echo, 1), None)


# -- install / uninstall --------------------------------------------------------------------------------


@pytest.fixture
def async_compile():
    from torch._inductor.async_compile import AsyncCompile

    import aiocompile.torch as aiotorch

    before = {name: AsyncCompile.__dict__.get(name) for name in torch_install.PATCHED}
    yield AsyncCompile
    aiotorch.uninstall()
    assert {name: AsyncCompile.__dict__.get(name) for name in torch_install.PATCHED} == before


def test_importing_the_drop_in_imports_no_torch():
    code = "import sys, aiocompile.torch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert out.split() == ["False"]


def test_install_replaces_and_uninstall_restores_exactly(async_compile):
    import aiocompile.torch as aiotorch

    originals = {name: async_compile.__dict__[name] for name in torch_install.PATCHED}
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    try:
        assert not aiotorch.is_installed()
        assert aiotorch.install(sched) is sched and aiotorch.is_installed()
        for name in torch_install.PATCHED:
            assert async_compile.__dict__[name] is not originals[name], name
        with pytest.raises(RuntimeError, match="already installed"):
            aiotorch.install(sched)
        assert aiotorch.uninstall() is True
        for name in torch_install.PATCHED:
            assert async_compile.__dict__[name] is originals[name], name
        assert aiotorch.uninstall() is False
        # The context manager restores on the way out, exception or not.
        with pytest.raises(KeyError), aiotorch.installed(sched) as got:
            assert got is sched and aiotorch.is_installed()
            raise KeyError("boom")
        assert not aiotorch.is_installed()
        for name in torch_install.PATCHED:
            assert async_compile.__dict__[name] is originals[name], name
    finally:
        sched.close()


def test_install_checks_its_arguments(async_compile):
    import aiocompile.torch as aiotorch

    with pytest.raises(TypeError, match="Scheduler"):
        aiotorch.install("not a scheduler")
    with pytest.raises(ValueError, match="timeout"):
        aiotorch.install(timeout=-1)
    with pytest.raises(TypeError, match="timeout"):
        aiotorch.install(timeout="5")
    closed = aiocompile.Scheduler(config=NO_PRELOAD)
    closed.close()
    with pytest.raises(aiocompile.SchedulerClosed, match="closed"):  # as for any call after aclose()
        aiotorch.install(closed)
    assert not aiotorch.is_installed()


def test_install_without_a_scheduler_makes_one_whose_workers_start_with_torch(async_compile, monkeypatch):
    """Where Inductor may compile Triton kernels (a torch built for a GPU), the fork
    server imports torch before forking, single-threaded, and every worker starts with
    Inductor's runtime loaded; uninstall() closes that scheduler."""
    import aiocompile.torch as aiotorch

    monkeypatch.setattr(torch_install, "_triton_kernels_possible", lambda: True)
    sched = aiotorch.install(warm=False)
    try:
        assert isinstance(sched, aiocompile.Scheduler) and sched is not aiocompile.default_scheduler()
        assert sched.config.preload[-1] == aiotorch.PRELOAD
        request = python_request(jobs.loaded_modules, ["torch", "torch._inductor.codecache"])
        loaded, blas_threads = sched.port.execute_sync(request, None).result(timeout=120)
        assert loaded == [True, True], "the worker was forked with torch imported"
        assert blas_threads == "1"
        launcher = sched.port._pool._supervisor._launcher
        assert launcher.problems == [], "importing torch started no thread in the fork server"
    finally:
        aiotorch.uninstall()
    assert sched.closed


def test_install_gives_this_process_the_ptxas_inductor_s_workers_use(async_compile, monkeypatch, tmp_path):
    """Inductor's compile workers run torch's own ptxas, and Triton's cache key holds the
    ptxas version, which Triton asks once per process. ``install()`` gives this process
    that ptxas too (as Inductor does when it compiles here), forgetting a version Triton
    asked already, so that the kernels Inductor compiles here itself find the workers'
    binaries. A ``TRITON_PTXAS_PATH`` of the program's own is left as it is."""
    from torch._inductor.runtime import compile_tasks

    import aiocompile.torch as aiotorch

    compiler = pytest.importorskip("triton.backends.nvidia.compiler")
    ptxas = tmp_path / "ptxas"  # torch's, as far as this test goes: a real executable with its own version
    ptxas.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 99.9, V99.9.1'\n")
    ptxas.chmod(0o755)

    def as_inductor_does() -> None:
        if os.environ.get("TRITON_PTXAS_PATH") is None:
            os.environ["TRITON_PTXAS_PATH"] = str(ptxas)

    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", as_inductor_does)
    # Set first, so that the variable's absence is what the test's end puts back (deleting
    # an absent variable would record nothing to restore).
    monkeypatch.setenv("TRITON_PTXAS_PATH", "")
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    def install_and_uninstall() -> None:
        sched = aiocompile.Scheduler(config=NO_PRELOAD)
        try:
            aiotorch.install(sched, warm=False)
            aiotorch.uninstall()
        finally:
            sched.close()

    compiler.get_ptxas_version.cache_clear()
    try:
        assert "release 99.9" not in compiler.get_ptxas_version(80)  # Triton's own, asked and kept
        install_and_uninstall()
        assert os.environ["TRITON_PTXAS_PATH"] == str(ptxas)
        assert "release 99.9" in compiler.get_ptxas_version(80)

        own = tmp_path / "own-ptxas"
        monkeypatch.setenv("TRITON_PTXAS_PATH", str(own))
        install_and_uninstall()
        assert os.environ["TRITON_PTXAS_PATH"] == str(own)
    finally:
        compiler.get_ptxas_version.cache_clear()


def test_install_for_a_cpu_build_of_torch_preloads_nothing(async_compile, monkeypatch):
    """Where only C++ kernels can come, which workers build without torch, the fork
    server imports neither torch nor Triton."""
    import aiocompile.torch as aiotorch

    monkeypatch.setattr(torch_install, "_triton_kernels_possible", lambda: False)
    sched = aiotorch.install(warm=False)
    try:
        assert sched.config.preload == ()
        request = python_request(jobs.loaded_modules, ["torch", "triton"])
        loaded, _ = sched.port.execute_sync(request, None).result(timeout=120)
        assert loaded == [False, False]
    finally:
        aiotorch.uninstall()


FORK = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import aiocompile.torch as aiotorch, jobs
from aiocompile._torch import install as torch_install
from aiocompile.backends import Request

def echo(sched, value):
    request = Request(backend="python", key=None, name="echo", target=None, fn=jobs.echo, args=(value,),
                      finish=lambda x: x)
    return sched.port.execute_sync(request, None).result(timeout=120)

parent = aiotorch.install(warm=False)
assert echo(parent, "parent") == "parent"
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    child = torch_install.STATE.current.current_scheduler()
    report = {"fresh": child is not parent and not child.closed, "echo": echo(child, "child"),
              "own_workers": not set(child.worker_pids()) & set(parent.worker_pids())}
    aiotorch.uninstall()
    report["closed"] = child.closed
    os.write(write, json.dumps(report).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps({"child": json.loads(os.read(read, 65536)), "parent": echo(parent, "again")}))
aiotorch.uninstall()
"""


def test_a_forked_child_of_an_installed_program_gets_a_scheduler_of_its_own():
    proc = subprocess.run([sys.executable, "-c", FORK, str(ROOT / "tests")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "AIOCOMPILE_WORKERS": "1"}, timeout=240)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"child": {"fresh": True, "echo": "child", "own_workers": True, "closed": True},
                      "parent": "again"}


def test_the_torch_preload_refuses_to_leave_threads_in_the_fork_server(monkeypatch):
    from aiocompile.backends.inductor import _worker as _inductor_worker

    for name in _inductor_worker._THREAD_POOL_SIZES:
        monkeypatch.setenv(name, "4")
    monkeypatch.setattr(_inductor_worker, "_TORCH_MODULES", ("jobs", "thread_at_import"))
    monkeypatch.delitem(sys.modules, "thread_at_import", raising=False)
    try:
        with pytest.raises(RuntimeError, match="importing thread_at_import started 1 thread"):
            _inductor_worker.prepare_process()
    finally:
        sys.modules["thread_at_import"].stop.set()
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"


def test_uninstall_leaves_what_someone_else_put_there(async_compile):
    import aiocompile.torch as aiotorch

    original = async_compile.__dict__["wakeup"]
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    try:
        aiotorch.install(sched)
        theirs = classmethod(lambda cls: "theirs")
        async_compile.wakeup = theirs
        with pytest.warns(RuntimeWarning, match="wakeup"):
            aiotorch.uninstall()
        assert async_compile.__dict__["wakeup"] is theirs
        assert async_compile.__dict__["triton"] is not torch_install._REPLACEMENTS["triton"]
    finally:
        async_compile.wakeup = original
        sched.close()


def test_installed_inductor_hears_its_pool_is_ready_once_a_worker_has_warmed_up(async_compile, tmp_path):
    """Until one of the warm-ups ``warm_pool()`` started has finished, Inductor is told its
    pool is not ready, as its own pool says while it starts: template choices are then
    precompiled in its threads rather than queued for workers not there yet."""
    from torch._inductor import config

    import aiocompile.torch as aiotorch
    from aiocompile._torch.installation import STATE

    gate = tmp_path / "open"
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    try:
        with aiotorch.installed(sched, warm=False), config.patch(compile_threads=4):
            assert async_compile.use_process_pool() is True  # nothing started here: as before
            installation = STATE.current
            # The warm-up a worker runs, held until the test lets it finish.
            installation.warming = sched.port.warm_workers(jobs.wait_for_path, (str(gate),))
            assert installation.warming and async_compile.use_process_pool() is False
            gate.touch()
            cf.wait(installation.warming, timeout=60)
            assert async_compile.use_process_pool() is True
            with config.patch(compile_threads=1):
                assert async_compile.use_process_pool() is False
    finally:
        sched.close()


def test_install_reads_aiocompiles_bytecode_for_inductors_packages_until_uninstalled(async_compile, monkeypatch):
    import aiocompile.torch as aiotorch
    from aiocompile._base.bytecode import PackageImports

    def ours() -> list:
        return [finder for finder in sys.meta_path if isinstance(finder, PackageImports)]

    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    try:
        with aiotorch.installed(sched, warm=False):
            (finder,) = ours()
            assert "torch._inductor" in finder.names and sys.meta_path[0] is finder
        assert ours() == []
        monkeypatch.setenv("AIOCOMPILE_BYTECODE_DIR", "off")
        with aiotorch.installed(sched, warm=False):
            assert ours() == []
    finally:
        sched.close()


def test_installed_inductor_never_starts_its_own_pool(async_compile):
    from torch._inductor import config

    import aiocompile.torch as aiotorch

    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    try:
        async_compile.process_pool.cache_clear()
        with aiotorch.installed(sched, warm=False), config.patch(compile_threads=4):
            assert async_compile.use_process_pool() is True
            async_compile.warm_pool()
            async_compile.wakeup()
            async_compile.wait_pool_ready()
            with config.patch(compile_threads=1):
                assert async_compile.use_process_pool() is False
        assert async_compile.process_pool.cache_info().currsize == 0
        assert sched.worker_pids() == []
    finally:
        sched.close()


@pytest.mark.parametrize("hook", ["wakeup", "warm_pool"])
def test_inductors_warm_up_hooks_start_every_worker_once_installed_warm(async_compile, monkeypatch, hook):
    """torch.compile calls wakeup() for a graph with GPU inputs (warm_pool() only where
    dynamo looks its backend up by name): either starts the workers, where Triton kernels
    may come (install() itself starts them otherwise)."""
    from torch._inductor import config

    import aiocompile.torch as aiotorch

    monkeypatch.setattr(torch_install, "_triton_kernels_possible", lambda: True)
    from aiocompile.backends.inductor import _native_worker

    monkeypatch.setattr(torch_install, "_warm_up_function", lambda: _native_worker.ready)  # no torch to import
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    try:
        with aiotorch.installed(sched), config.patch(compile_threads=4):
            assert sched.worker_pids() == []
            getattr(async_compile, hook)()
            assert wait_until(lambda: len(sched.worker_pids()) == 2, timeout=60)
    finally:
        sched.close()


@pytest.mark.skipif(HAS_CUDA, reason="with a GPU the kernel compiles: the gpu tests cover that")
def test_a_real_inductor_kernel_goes_through_the_installed_path_to_a_worker(async_compile, tmp_path, monkeypatch):
    """The whole synchronous path on a real kernel: Inductor's ``triton()`` call, the
    request, a worker that imports torch and runs Inductor's own worker function, the
    record. Without a GPU driver the worker fails where Inductor's own would (loading
    the module), which shows that it really ran there."""
    from torch._inductor import config
    from torch._inductor.codecache import LambdaFuture

    import aiocompile.torch as aiotorch

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    kernel = one_kernel()
    events = []
    sched = aiocompile.Scheduler(config=NO_PRELOAD, on_event=events.append)
    try:
        with aiotorch.installed(sched, timeout=300, warm=False), config.patch(compile_threads=4):
            future = async_compile().triton(kernel["kernel_name"], kernel["source_code"], device_str="cuda")
            assert isinstance(future, LambdaFuture) and isinstance(future.future, cf.Future)
            with pytest.raises(aiocompile.CompileError) as failed:
                future.result(timeout=300)
        assert failed.value.kernel_name == kernel["kernel_name"] and failed.value.target == "cuda:90"
        assert "GPU" in str(failed.value)  # triton_helpers.set_driver_to_gpu(), as the module loads
        assert wait_until(lambda: sched.statistics().in_flight == 0)
        (record,) = sched.records()
        assert (record.backend, record.name, record.outcome, record.target) == \
            ("inductor", kernel["kernel_name"], "error", "cuda:90")
        started = [e for e in events if getattr(e, "event", None) == "job_started"]
        assert [e.name for e in started] == [kernel["kernel_name"]]
    finally:
        sched.close()


# -- wait() and Inductor's futures ---------------------------------------------------------------------


async def test_wait_resolves_inductor_futures_off_the_loop_and_leaves_kernels_alone(scheduler):
    from torch._inductor.codecache import LambdaFuture

    release = threading.Event()
    inner: cf.Future = cf.Future()
    threads = []

    def result_fn():
        threads.append(threading.get_ident())
        return "the kernel"

    pending = LambdaFuture(result_fn, future=inner)
    blocking = LambdaFuture(lambda: release.wait(30) and "slow kernel")
    already = object()
    scope = {"k0": pending, "k1": blocking, "k2": already, "n": 3}

    async def finish_later():
        await anyio.sleep(0.2)
        inner.set_result((None, 1))
        release.set()

    loop_thread = threading.get_ident()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(finish_later)
            assert await scheduler.wait(scope) is scope
    assert scope == {"k0": "the kernel", "k1": "slow kernel", "k2": already, "n": 3}
    assert threads and threads[0] != loop_thread


async def test_wait_raises_an_inductor_futures_error(scheduler):
    from torch._inductor.codecache import LambdaFuture

    def fail():
        raise RuntimeError("did not compile")

    with anyio.fail_after(30), pytest.raises(RuntimeError, match="did not compile"):
        await scheduler.wait([LambdaFuture(fail)])


# -- on a GPU ------------------------------------------------------------------------------------------------


def load_models():
    spec = importlib.util.spec_from_file_location("aiocompile_torch_models", ROOT / "examples" / "torch_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module



TOLERANCES = {"mlp": 1e-4, "attention": 1e-4, "convnet": 1e-4}


def torch_scheduler(**kwargs):
    """A scheduler whose workers start with torch imported (as ``install()`` makes one)."""
    from aiocompile._base.config import TRITON_PRELOAD
    from aiocompile.torch import PRELOAD

    return aiocompile.Scheduler(config=aiocompile.SchedulerConfig(preload=(TRITON_PRELOAD, PRELOAD)), **kwargs)


@gpu
@pytest.mark.parametrize("name", ["mlp", "attention", "convnet"])
@pytest.mark.usefixtures("fresh_inductor")
def test_torch_compile_under_aiocompile_equals_eager(name):
    from torch._inductor.async_compile import AsyncCompile

    import aiocompile.torch as aiotorch

    model, inputs = load_models().make(name)
    sched = torch_scheduler(workers=4)
    try:
        with torch.no_grad():
            expected = model(*inputs)
            with aiotorch.installed(sched):
                got = torch.compile(model)(*inputs)
        torch.testing.assert_close(got, expected, rtol=TOLERANCES[name], atol=TOLERANCES[name])
        stats = sched.statistics()
        records = [r for r in sched.records() if r.backend == "inductor"]
        assert stats.compiled >= 1 and records and stats.failed == 0
        assert all(r.target and r.target.startswith("cuda:") for r in records)
        assert AsyncCompile.process_pool.cache_info().currsize == 0, "Inductor's own pool must not start"
    finally:
        sched.close()


@gpu
@pytest.mark.usefixtures("fresh_inductor")
def test_a_worker_killed_mid_compile_costs_torch_compile_nothing():
    import aiocompile.torch as aiotorch

    killed = []
    lock = threading.Lock()

    def kill_first_compile(event):
        # In the supervisor thread, just after the job was sent: the worker dies inside it.
        if getattr(event, "event", None) == "job_started" and not event.warm_up and event.attempt == 1:
            with lock:
                if killed:
                    return
                killed.append((event.name, event.pid))
            os.kill(event.pid, signal.SIGKILL)

    model, inputs = load_models().make("convnet")
    sched = torch_scheduler(workers=4, on_event=kill_first_compile)
    try:
        with torch.no_grad():
            expected = model(*inputs)
            with aiotorch.installed(sched):
                got = torch.compile(model)(*inputs)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        stats = sched.statistics()
        assert killed and stats.worker_crashes >= 1 and stats.retries >= 1 and stats.failed == 0
        victim = next(r for r in sched.records() if r.name == killed[0][0] and r.attempts >= 2)
        assert victim.outcome in ("compiled", "joined") and victim.backend == "inductor"
    finally:
        sched.close()


def capture_sources(fn, *inputs):
    """The (kernel_name, source_code) pairs Inductor generates for ``fn``."""
    from torch._inductor.async_compile import AsyncCompile

    captured = []
    original = AsyncCompile.triton

    def triton_(self, kernel_name, source_code, device_str="cuda"):
        captured.append((kernel_name, source_code))
        return original(self, kernel_name, source_code, device_str)

    AsyncCompile.triton = triton_
    try:
        torch.compile(fn)(*inputs)
    finally:
        AsyncCompile.triton = original
    return captured


@gpu
@pytest.mark.usefixtures("fresh_inductor")
async def test_inductor_triton_returns_a_kernel_inductor_runs(tmp_path, monkeypatch):
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    x = torch.randn(4096, device="cuda")
    y = torch.randn(4096, device="cuda")
    # A constant of its own: Inductor writes it into the source, so this test's kernel is
    # new to every cache in this process.
    offset = 1.0 + int.from_bytes(os.urandom(2), "little") / 65536
    captured = set(capture_sources(lambda a, b: a * b + offset, x, y))
    assert len(captured) == 1, captured
    ((name, source),) = captured
    # Capturing compiled the kernel here, into Triton's cache: let the worker start afresh.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-for-the-worker"))
    sched = torch_scheduler(workers=2)
    try:
        with anyio.fail_after(300):
            kernel = await sched.inductor_triton(name, source)
            again = await sched.inductor_triton(name, source)
        assert isinstance(kernel, CachingAutotuner) and again is kernel
        assert kernel.launchers, "the launchers are built in this process"
        out = torch.empty_like(x)
        parsed: InductorSource = parse_source(name, source)
        args = {"in_ptr0": x, "in_ptr1": y, "out_ptr0": out, "xnumel": x.numel()}
        kernel.run(*(args[a] for a in parsed.arg_names if a not in parsed.constexprs),
                   stream=torch.cuda.current_stream().cuda_stream)
        torch.testing.assert_close(out, x * y + offset)
        assert [r.outcome for r in sched.records()] == ["compiled", "cache_hit"]
        assert sched.records()[0].stages, "Triton's stage times, summed over the configurations"
    finally:
        await sched.aclose()
