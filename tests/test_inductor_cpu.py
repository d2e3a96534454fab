"""torch.compile on the CPU with aiocompile installed: Inductor's C++ kernels built in the
pool's workers.

Real torch.compile, real g++, real worker processes and real kills. Each test has empty
Inductor caches (its own cache directory, and Inductor's in-memory caches cleared), so
every kernel is really built. A ``g++`` of the test's own, first on PATH, stands in front
of the real one where a test needs a build to stall (to kill its worker in the middle) or
to fail (the real compiler, given a header that does not exist): the build commands
Inductor makes name ``g++``, and the workers get this process's PATH with each build.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
from conftest import ROOT, alive, clear_inductor_caches, wait_until

import aiocompile

torch = pytest.importorskip("torch")
pytest.importorskip("torch._inductor.codecache")

REAL_GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(REAL_GXX is None, reason="Inductor builds its C++ kernels with g++")
pytestmark = [needs_gxx, pytest.mark.timeout(600)]


def load_models():
    spec = importlib.util.spec_from_file_location("aiocompile_torch_models", ROOT / "examples" / "torch_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fresh_inductor(tmp_path, monkeypatch):
    """Empty Inductor caches, on disk and in memory, and no graph cache: every kernel is
    generated and built."""
    from torch._inductor import config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    torch._dynamo.reset()
    clear_inductor_caches()
    with config.patch(fx_graph_cache=False):
        yield tmp_path / "inductor"
    torch._dynamo.reset()
    clear_inductor_caches()


def torch_scheduler(**kwargs):
    """A scheduler as ``install()`` makes one for a CPU build of torch: nothing preloaded,
    since the workers build C++ kernels without torch."""
    return aiocompile.Scheduler(config=aiocompile.SchedulerConfig(workers=2, preload=()), **kwargs)


def compile_and_compare(name):
    model, inputs = load_models().make(name, "cpu")
    with torch.no_grad():
        expected = model(*inputs)
        got = torch.compile(model)(*inputs)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def cpp_records(sched):
    return [r for r in sched.records() if r.backend == "inductor-cpp"]


GXX_WRAPPER = """#!/bin/sh
# g++ for one test: kernel libraries (Inductor names them *.main.so) are {what}.
out=""; prev=""
for arg in "$@"; do
    [ "$prev" = "-o" ] && out="$arg"
    prev="$arg"
done
case "$out" in
    *.main.so) {action} ;;
esac
exec {real} "$@"
"""

# The first kernel build writes half a library, says which worker runs it, and hangs
# there until it is killed.
STALL_ONCE = """if mkdir "{state}/taken" 2>/dev/null; then
        printf 'half a library' > "$out"
        echo "$PPID $$" > "{state}/stalled.tmp" && mv "{state}/stalled.tmp" "{state}/stalled"
        exec sleep 300
    fi"""

# Every kernel build hangs where the compiler would run, and says which process it is.
STALL = """echo "$$" > "{state}/stalled.tmp" && mv "{state}/stalled.tmp" "{state}/stalled"
        exec sleep 300"""

# Every kernel build is given a header that does not exist: the real compiler fails.
BREAK = """exec {real} "$@" -include /nonexistent/aiocompile-injected.h"""


def gxx_in_front(tmp_path, monkeypatch, what, action):
    bin_dir = tmp_path / "bin"
    state = tmp_path / "gxx-state"
    bin_dir.mkdir()
    state.mkdir()
    script = bin_dir / "g++"
    script.write_text(GXX_WRAPPER.format(what=what, action=action.format(state=state, real=REAL_GXX),
                                         real=REAL_GXX))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return state


def kill_the_building_worker(state, sched):
    """Start a thread that, once ``gxx_in_front``'s ``STALL_ONCE`` compiler has stalled,
    SIGKILLs the worker it runs in (the worker alone, as the OOM killer would): what it
    killed, noted in the dict returned with the thread. Never this process: a build run
    here rather than in a worker only loses its compiler (``was_a_worker`` says which)."""
    killed = {}

    def kill() -> None:
        if not wait_until(lambda: (state / "stalled").exists(), timeout=300):
            return
        worker, compiler = (int(pid) for pid in (state / "stalled").read_text().split())
        killed.update(worker=worker, compiler=compiler, was_a_worker=worker in sched.worker_pids())
        os.kill(worker if killed["was_a_worker"] else compiler, signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killed, killer


# -- torch.compile ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "attention", "convnet"])
def test_torch_compile_on_the_cpu_equals_eager_with_its_kernels_built_in_workers(name, fresh_inductor):
    from torch._inductor.async_compile import AsyncCompile

    import aiocompile.torch as aiotorch

    AsyncCompile.pool.cache_clear()
    sched = torch_scheduler()
    try:
        with aiotorch.installed(sched):
            compile_and_compare(name)
        stats = sched.statistics()
        records = cpp_records(sched)
        assert records and stats.failed == 0 and stats.compiled >= len(records)
        workers = {r.worker_pid for r in records}
        assert os.getpid() not in workers and None not in workers
        for record in records:
            assert (record.outcome, record.target, record.attempts) == ("compiled", "cpu", 1)
            assert record.compiler_cache_hit is False and record.artifact_size > 0
        # The libraries are Inductor's own, where Inductor puts them.
        libraries = list(fresh_inductor.rglob("*.main.so"))
        assert len(libraries) == len(records)
        # ... built by workers that never loaded torch.
        assert workers <= set(sched.worker_pids())
        assert not [pid for pid in workers if "libtorch" in Path(f"/proc/{pid}/maps").read_text()]
        assert AsyncCompile.pool.cache_info().currsize == 0, "Inductor's compile threads never started"
    finally:
        sched.close()


def test_a_worker_killed_in_the_middle_of_a_cpp_build_costs_torch_compile_nothing(fresh_inductor, tmp_path,
                                                                                 monkeypatch):
    """SIGKILL to the worker while its g++ runs (and has written half the library): the
    build runs again on another worker, from scratch, and torch.compile succeeds."""
    import aiocompile.torch as aiotorch

    state = gxx_in_front(tmp_path, monkeypatch, "stalled once, half written", STALL_ONCE)
    sched = torch_scheduler()
    killed, killer = kill_the_building_worker(state, sched)
    try:
        with aiotorch.installed(sched):
            compile_and_compare("mlp")
        killer.join(5)
        assert killed["was_a_worker"] and killed["worker"] != os.getpid()
        stats = sched.statistics()
        assert stats.worker_crashes == 1 and stats.retries == 1 and stats.failed == 0
        (victim,) = [r for r in cpp_records(sched) if r.attempts == 2]
        assert victim.outcome == "compiled" and victim.worker_pid not in (killed["worker"], None)
        assert wait_until(lambda: not alive([killed["compiler"]])), "the killed worker's compiler went with it"
        assert not list(fresh_inductor.rglob("*.aiocompile-*")), "no build is left marked as under way"
    finally:
        sched.close()


def test_a_cpp_compile_error_fails_torch_compile_as_inductors_own_would(fresh_inductor, tmp_path, monkeypatch):
    from torch._dynamo import config as dynamo_config
    from torch._inductor.exc import CppCompileError

    import aiocompile.torch as aiotorch

    gxx_in_front(tmp_path, monkeypatch, "given a header that does not exist", BREAK)
    model, inputs = load_models().make("mlp", "cpu")
    sched = torch_scheduler()
    try:
        with aiotorch.installed(sched), torch.no_grad():
            expected = model(*inputs)
            with pytest.raises(Exception) as failed:  # noqa: PT011 - dynamo's wrapper, checked below
                torch.compile(model)(*inputs)
            chain, exc = [], failed.value
            while exc is not None:
                chain.append(exc)
                exc = exc.__cause__ or getattr(exc, "inner_exception", None)
            error = next(e for e in chain if isinstance(e, aiocompile.CompileError))
            # Inductor's class too, with the command and the compiler's own words.
            assert isinstance(error, CppCompileError) and error.target == "cpu"
            assert "aiocompile-injected.h: No such file or directory" in error.output
            assert error.cmd[0] == "g++" and any(arg.endswith(".main.so") for arg in error.cmd)
            # Where dynamo is told to fall back to eager on a failed compile, it does.
            torch._dynamo.reset()
            with dynamo_config.patch(suppress_errors=True):
                got = torch.compile(model)(*inputs)
            torch.testing.assert_close(got, expected)
        records = cpp_records(sched)
        assert records and {r.outcome for r in records} <= {"error", "error_hit", "joined"}
        assert all(r.worker_pid != os.getpid() for r in records if r.outcome == "error")
    finally:
        sched.close()


# -- Inductor's entry points, called as its output code calls them --------------------------------------------


ADD_ONE = r"""
#include <cstdint>
extern "C" void kernel(const float* in_ptr0, float* out_ptr0, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) { out_ptr0[i] = in_ptr0[i] + %s; }
}
"""


def test_cpp_and_cpp_pybinding_return_what_inductor_returns_built_in_a_worker(fresh_inductor):
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import LambdaFuture

    import aiocompile.torch as aiotorch

    x = torch.arange(8, dtype=torch.float32)
    AsyncCompile.pool.cache_clear()
    sched = torch_scheduler()
    try:
        with aiotorch.installed(sched, warm=False), config.patch(compile_threads=2):
            # Inductor's output code: a future per kernel, resolved by its wait().
            binding = AsyncCompile().cpp_pybinding(["const float*", "float*", "int64_t"], ADD_ONE % "1.0f")
            library = AsyncCompile().cpp(ADD_ONE % "2.0f")
            assert isinstance(binding, LambdaFuture) and isinstance(library, LambdaFuture)
            scope = {"binding": binding, "library": library}
            AsyncCompile().wait(scope)
            out = torch.empty_like(x)
            scope["binding"](x, out, x.numel())
            torch.testing.assert_close(out, x + 1)
            pointer = ctypes.c_void_p
            scope["library"](pointer(x.data_ptr()), pointer(out.data_ptr()), ctypes.c_int64(x.numel()))
            torch.testing.assert_close(out, x + 2)
            # One compile thread: Inductor wants the kernel itself, built all the same.
            with config.patch(compile_threads=1):
                kernel = AsyncCompile().cpp_pybinding(["const float*", "float*", "int64_t"], ADD_ONE % "3.0f")
            kernel(x, out, x.numel())
            torch.testing.assert_close(out, x + 3)
        records = cpp_records(sched)
        assert [r.outcome for r in records] == ["compiled"] * 3
        assert all(r.worker_pid not in (None, os.getpid()) for r in records)
        assert AsyncCompile.pool.cache_info().currsize == 0
        # Uninstalled: Inductor's own compile thread builds the next one, and the pool
        # sees nothing of it.
        with config.patch(compile_threads=2):
            binding = AsyncCompile().cpp_pybinding(["const float*", "float*", "int64_t"], ADD_ONE % "6.0f")
            scope = {"binding": binding}
            AsyncCompile().wait(scope)
        scope["binding"](x, out, x.numel())
        torch.testing.assert_close(out, x + 6)
        assert len(sched.records()) == 3 and AsyncCompile.pool.cache_info().currsize == 1
    finally:
        sched.close()


def test_install_starts_the_workers_at_once_where_they_have_nothing_to_import():
    """Inductor starts no pool for a model on the CPU, so no hook of its would: warm,
    install() starts every worker itself; not warm, the first build does."""
    import aiocompile.torch as aiotorch

    sched = torch_scheduler()
    try:
        with aiotorch.installed(sched, warm=False):
            assert sched.worker_pids() == []
        with aiotorch.installed(sched):
            assert wait_until(lambda: len(sched.worker_pids()) == sched.config.workers, timeout=120)
    finally:
        sched.close()


def test_installs_own_scheduler_preloads_nothing_here_and_runs_at_the_programs_priority(monkeypatch):
    """A CPU build of torch compiles no Triton kernel and its C++ builds need no torch in
    the worker: nothing to preload. Workers run at the program's priority, as Inductor's
    own compile threads do, unless the environment says otherwise."""
    from aiocompile._torch.install import _own_config, _triton_kernels_possible

    assert not torch.version.cuda and not torch.version.hip, "a CPU build of torch"
    assert not _triton_kernels_possible()
    monkeypatch.delenv("AIOCOMPILE_WORKER_NICE", raising=False)
    config = _own_config()
    assert (config.preload, config.worker_nice) == ((), 0)
    assert aiocompile.SchedulerConfig().worker_nice != 0
    monkeypatch.setenv("AIOCOMPILE_WORKER_NICE", "7")
    assert _own_config().worker_nice == 7


def test_a_build_past_its_timeout_fails_as_compile_timeout_and_leaves_no_compiler(fresh_inductor, tmp_path,
                                                                                  monkeypatch):
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    import aiocompile.torch as aiotorch

    state = gxx_in_front(tmp_path, monkeypatch, "stalled", STALL)
    sched = torch_scheduler()
    try:
        # Long enough for the compiler to start on a loaded machine; it then hangs for good.
        with aiotorch.installed(sched, timeout=5, warm=False), config.patch(compile_threads=2):
            future = AsyncCompile().cpp_pybinding(["const float*", "float*", "int64_t"], ADD_ONE % "8.0f")
            with pytest.raises(aiocompile.JobTimeout) as timed_out:
                future.result()
        compiler = int((state / "stalled").read_text())
        assert wait_until(lambda: not alive([compiler])), "the compiler went with its worker"
        (record,) = cpp_records(sched)
        assert record.outcome == "timeout" and timed_out.value.kernel_name == record.name
    finally:
        sched.close()


def test_one_build_per_key_keyed_as_inductor_keys_it(fresh_inductor, tmp_path, monkeypatch):
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    from aiocompile.backends.inductor._native import cpp_request

    builds = []
    argtypes = ["const float*", "float*", "int64_t"]
    CppPythonBindingsCodeCache.load_pybinding_async(argtypes, ADD_ONE % "4.0f", submit_fn=builds.append)
    (build,) = builds
    first, again = cpp_request(build), cpp_request(build)
    assert first.key == again.key and first.backend == "inductor-cpp" and first.target == "cpu"
    # Named after Inductor's own key: the name of the files it writes for the source.
    lock_path = build.args[0]
    assert first.name == Path(lock_path).stem and list(fresh_inductor.rglob(f"{first.name}.main.cpp"))

    # Another source, another key; the same source in another cache directory, too.
    CppPythonBindingsCodeCache.load_pybinding_async(argtypes, ADD_ONE % "5.0f", submit_fn=builds.append)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    clear_inductor_caches()
    CppPythonBindingsCodeCache.load_pybinding_async(argtypes, ADD_ONE % "4.0f", submit_fn=builds.append)
    other_source, elsewhere = (cpp_request(b) for b in builds[1:])
    assert len({first.key, other_source.key, elsewhere.key}) == 3
    assert elsewhere.name == first.name, "Inductor's key does not depend on where its cache is"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(fresh_inductor))

    sched = torch_scheduler()
    try:
        answers = [sched.port.execute_sync(request, 120) for request in (first, again)]
        built = [answer.result(timeout=120) for answer in answers]
        assert built[0] is built[1] and built[0].outputs[-1].endswith(".main.so")
        assert sched.port.execute_sync(cpp_request(build), 120).result(timeout=120) is built[0]
        assert [r.outcome for r in sched.records()] == ["compiled", "joined", "cache_hit"]
    finally:
        sched.close()


def test_a_build_of_another_shape_runs_as_inductors_own_callable_in_a_worker(fresh_inductor, monkeypatch):
    """Builders the command path does not take (here: made so) are built by Inductor's
    own callable, unpickled in a worker, which imports torch for it."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    from aiocompile.backends.inductor import _native, _native_worker

    builds = []
    argtypes = ["const float*", "float*", "int64_t"]
    load = CppPythonBindingsCodeCache.load_pybinding_async(argtypes, ADD_ONE % "7.0f", submit_fn=builds.append)
    (build,) = builds
    assert _native.cpp_request(build).fn is _native_worker.build_commands
    monkeypatch.setattr(_native, "_steps", lambda builders: None)
    request = _native.cpp_request(build)
    assert request.fn is _native_worker.build_native and request.args[0] is build
    sched = torch_scheduler()
    try:
        built = sched.port.execute_sync(request, 120).result(timeout=120)
        assert not built.cached and all(os.path.exists(path) for path in built.outputs)
        (record,) = sched.records()
        assert record.worker_pid not in (None, os.getpid()) and record.outcome == "compiled"
    finally:
        sched.close()
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    load()(x, out, x.numel())  # Inductor finds the library built and loads it
    torch.testing.assert_close(out, x + 7)


CUDA_PROBE = 'extern "C" __global__ void aiocompile_probe(float* x) { x[threadIdx.x] += 1.0f; }\n'


@pytest.fixture
def stock_cuda_build(fresh_inductor, tmp_path, monkeypatch):
    """What Inductor's own CUDA build of a small kernel does on this machine, in a cache
    directory of its own: ``(library, None)``, or ``(None, the error)`` where it cannot
    build (a CPU build of torch knows no CUDA_HOME)."""
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "stock"))
    try:
        with config.patch(compile_threads=1):
            return AsyncCompile().cuda(CUDA_PROBE, "so"), None
    except Exception as exc:  # noqa: BLE001 - whatever Inductor raises, compared by the tests
        return None, exc
    finally:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(fresh_inductor))
        clear_inductor_caches()


def test_a_cuda_build_runs_in_a_worker_and_loads_as_inductors_own(stock_cuda_build, fresh_inductor):
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    import aiocompile.torch as aiotorch

    stock, error = stock_cuda_build
    if error is not None:
        pytest.skip(f"Inductor's own CUDA build fails here: {type(error).__name__}: {error}")
    sched = torch_scheduler()
    try:
        with aiotorch.installed(sched, warm=False), config.patch(compile_threads=2):
            library = AsyncCompile().cuda(CUDA_PROBE, "so").result()
        assert type(library) is type(stock) and library.lib_path != stock.lib_path
        assert Path(library.lib_path).is_relative_to(fresh_inductor)
        (record,) = sched.records()
        assert (record.backend, record.outcome, record.target) == ("inductor-cuda", "compiled", "cuda")
        assert record.worker_pid not in (None, os.getpid()) and record.compiler_cache_hit is False
        assert hasattr(library.DLL, "aiocompile_probe")
    finally:
        sched.close()


def test_a_cuda_build_runs_in_a_worker_and_fails_there_as_inductors_own(stock_cuda_build):
    """Where Inductor's own CUDA build fails (here: a CPU build of torch), it fails in
    the worker exactly where it fails in Inductor's compile thread, and says so the same
    way."""
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    import aiocompile.torch as aiotorch

    _, stock = stock_cuda_build
    if stock is None:
        pytest.skip("Inductor's own CUDA build succeeds here")
    sched = torch_scheduler()
    try:
        with aiotorch.installed(sched, warm=False), config.patch(compile_threads=2):
            future = AsyncCompile().cuda(CUDA_PROBE, "so")
            with pytest.raises(aiocompile.CompileError) as ours:
                future.result()
        assert str(stock) in str(ours.value) and type(stock).__name__ in str(ours.value)
        (record,) = sched.records()
        assert (record.backend, record.outcome, record.target) == ("inductor-cuda", "error", "cuda")
        assert record.worker_pid not in (None, os.getpid())
    finally:
        sched.close()
