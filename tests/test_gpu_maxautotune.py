"""torch.compile(mode="max-autotune") on a GPU with aiocompile installed: Inductor's Triton
template choices compiled in the pool's workers and timed in aiocompile's benchmark
processes; a choice that exits, faults the GPU, raises or hangs there costs only itself.

Run with ``pytest -m gpu``; skipped where torch or a CUDA device is missing. Each test has
empty Inductor and Triton caches. ``-s`` shows what each choice became.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os

import pytest
from autotune_faults import inject

import aiocompile
from aiocompile._torch import install as torch_install

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(600),
]



def mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    return model.half().cuda().eval(), torch.randn(256, 1024, device="cuda", dtype=torch.float16)


def scheduler(**changes):

    return aiocompile.Scheduler(config=torch_install._own_config().with_changes(**changes))


def compile_mlp(sched):
    """max-autotune of the MLP with ``sched`` installed, checked against eager; returns the
    benchmark records of its choices."""
    import aiocompile.torch as aiotorch

    model, x = mlp()
    records = []
    stop = sched.subscribe(lambda event: records.append(event) if isinstance(event, aiocompile.BenchmarkRecord)
                           else None)
    try:
        with aiotorch.installed(sched), torch.no_grad():
            # The workers ready first, as a server readies them (Inductor's warm_pool(),
            # which install() turns into their start): until one has warmed up, Inductor is
            # told its pool is not ready and precompiles the choices in its threads.
            from torch._inductor.async_compile import AsyncCompile

            from aiocompile._torch.installation import STATE

            AsyncCompile.warm_pool()
            cf.wait(STATE.current.warming, timeout=300)
            expected = model(x)
            got = torch.compile(model, mode="max-autotune")(x)
            torch.cuda.synchronize()
    finally:
        stop()
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    records = [r for r in records if r.config != "warm-up"]
    outcomes = collections.Counter(r.outcome for r in records)
    print(f"\n{len(records)} choices timed in benchmark processes: {dict(outcomes)}; "
          f"{sched.statistics().compiled} kernels compiled in workers")
    for record in records:
        if record.outcome != "ok":
            print(f"  {record.outcome:8} {record.config}: {(record.reason or '').splitlines()[0][:160]}")
    return records


def test_max_autotune_compiles_choices_in_workers_and_times_them_in_benchmark_processes(fresh_inductor):
    sched = scheduler()
    try:
        records = compile_mlp(sched)
        stats = sched.statistics()
        compiles = [r for r in sched.records() if r.backend == "inductor"]
    finally:
        sched.close()
    assert records and sum(r.outcome == "ok" for r in records) >= 2
    # Every Triton choice was compiled in a worker (Inductor's precompile went through
    # AsyncCompile.triton), then timed in a benchmark process.
    assert len(compiles) >= len(records) and stats.failed == 0
    workers = {r.worker_pid for r in compiles}
    benchmark_pids = {r.pid for r in records if r.pid is not None}
    assert os.getpid() not in workers | benchmark_pids and not workers & benchmark_pids
    for record in records:
        assert record.outcome in ("ok", "error"), record
        assert (record.time_ms is not None) == (record.outcome == "ok")
        if record.outcome == "error":
            assert record.reason


def test_a_choice_that_exits_faults_raises_or_hangs_costs_only_itself(fresh_inductor, monkeypatch):
    made = inject(monkeypatch, {0: "exit", 1: "fault", 2: "raise", 3: "hang"})
    sched = scheduler(benchmark_timeout=20.0)
    try:
        records = compile_mlp(sched)  # the compile goes on, and its output is right
    finally:
        sched.close()
    by_label = {}
    for record in records:
        by_label.setdefault(record.config, record)  # the first time a label was timed
    expected = {"exit": "crashed", "fault": "fault", "raise": "error", "hang": "timeout"}
    assert sorted(made.values()) == sorted(expected)
    for label, how in made.items():
        record = by_label[label]
        assert record.outcome == expected[how] and record.time_ms is None and record.reason, record
    others = [r for r in records if r.config not in made]
    assert sum(r.outcome == "ok" for r in others) >= 2
    # The exit, the fault and the hang each cost their process (the raise did not), and
    # the choices after them were timed in the replacements.
    assert len({r.pid for r in records if r.pid is not None}) >= 4
