"""torch.compile(mode="max-autotune") on the CPU with aiocompile installed: Inductor's C++
template choices built in the pool's workers and timed in a benchmark process, where a
choice that exits, segfaults, raises or hangs costs only itself.

Real torch.compile with real g++ builds, real benchmark processes and real faults. A
matmul gets a C++ template choice where Inductor may use one: frozen weights
(``freezing``) and the ``CPP`` backend among ``max_autotune_gemm_backends``. Each test has
empty Inductor caches.
"""

from __future__ import annotations

import os
import shutil

import pytest
from autotune_faults import inject
from conftest import alive, clear_inductor_caches

import aiocompile
from aiocompile._torch import install as torch_install

torch = pytest.importorskip("torch")
pytest.importorskip("torch._inductor.autotune_process")
pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor builds C++ with g++"),
              pytest.mark.timeout(600)]


@pytest.fixture
def fresh_inductor(tmp_path, monkeypatch):
    """Empty Inductor caches, no graph cache, and C++ template choices for matmuls."""
    from torch._inductor import config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    clear_inductor_caches()
    with config.patch(fx_graph_cache=False, freezing=True, max_autotune_gemm_backends="CPP,ATEN"):
        yield tmp_path / "inductor"
    torch._dynamo.reset()
    clear_inductor_caches()


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def scheduler(**config):
    return aiocompile.Scheduler(config=aiocompile.SchedulerConfig(workers=2, preload=(), **config))


def compile_and_compare(sched):
    """max-autotune of the model with ``sched`` installed; returns the benchmark records."""
    import aiocompile.torch as aiotorch

    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(16, 64)
    records = []
    stop = sched.subscribe(lambda event: records.append(event) if isinstance(event, aiocompile.BenchmarkRecord)
                           else None)
    try:
        with aiotorch.installed(sched), torch.no_grad():
            expected = model(x)
            got = torch.compile(model, mode="max-autotune")(x)
    finally:
        stop()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    return [r for r in records if r.config != "warm-up"]


def test_max_autotune_builds_cpp_choices_in_workers_and_times_them_in_a_benchmark_process(fresh_inductor):
    from torch._inductor import autotune_process
    from torch._inductor import config as inductor_config

    getter = autotune_process.get_tuning_process_pool
    sched = scheduler()
    try:
        records = compile_and_compare(sched)
        assert len(records) == 2, records  # one C++ template choice per matmul
        benchmark_pids = {r.pid for r in records}
        compile_pids = {r.worker_pid for r in sched.records()}
        for record in records:
            assert record.outcome == "ok" and record.time_ms > 0 and record.reason is None
            assert record.name.startswith("cpp_") and record.device_name
        assert os.getpid() not in benchmark_pids and not benchmark_pids & compile_pids
        builds = [r for r in sched.records() if r.backend == "inductor-cpp"]
        assert all(r.outcome == "compiled" for r in builds)
        # Every kernel library (Inductor names them *.main.so) was built in a worker: the
        # two choices', then the model's kernels; none by this process or the benchmark
        # process.
        assert len(builds) >= 3 and os.getpid() not in compile_pids
        assert len(list(fresh_inductor.rglob("*.main.so"))) == len(builds)
        # uninstall() gave Inductor back its pool and setting, and ended the process.
        assert autotune_process.get_tuning_process_pool is getter
        assert inductor_config.autotune_in_subproc is False
        assert not alive(benchmark_pids)
    finally:
        sched.close()


@pytest.mark.parametrize(("how", "outcome"), [("exit", "crashed"), ("segfault", "crashed"), ("raise", "error"),
                                              ("hang", "timeout")])
def test_a_choice_that_fails_in_its_benchmark_costs_only_itself(how, outcome, fresh_inductor, monkeypatch):
    made = inject(monkeypatch, {0: how})
    sched = scheduler(benchmark_timeout=20.0)
    try:
        records = compile_and_compare(sched)  # the compile goes on, and its output is right
    finally:
        sched.close()
    assert len(made) == 1 and len(records) == 2, (made, records)
    faulty, other = records
    assert faulty.config in made and faulty.outcome == outcome and faulty.time_ms is None
    assert faulty.reason
    if how == "exit":
        assert "exited with status 7" in faulty.reason
    elif how == "segfault":
        assert "SIGSEGV" in faulty.reason
    elif how == "raise":
        assert "injected failure" in faulty.reason
    else:
        assert "timed out" in faulty.reason
    # The next choice is timed, in a fresh process where the first one died.
    assert other.outcome == "ok" and other.time_ms > 0
    if outcome != "error":
        assert other.pid != faulty.pid


def test_a_max_autotune_compile_starts_the_benchmark_process_at_its_start(fresh_inductor):
    # Inductor's wakeup() comes at the start of every compile on a GPU, under the
    # compile's settings: only a max-autotune one starts a benchmark process then (the
    # CPU's here), rather than at its first matmul.
    from torch._inductor import async_compile
    from torch._inductor import config as inductor_config

    import aiocompile.torch as aiotorch

    sched = scheduler()
    try:
        with aiotorch.installed(sched):
            installation = torch_install.STATE.current
            assert installation is not None and installation.tuning is not None
            pool = installation.tuning.pool
            async_compile.AsyncCompile.wakeup()
            assert pool._host is None
            with inductor_config.patch(max_autotune=True):
                async_compile.AsyncCompile.wakeup()
            assert pool._host is not None
    finally:
        sched.close()
