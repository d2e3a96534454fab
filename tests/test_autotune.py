"""autotune() end to end on the CPU: real compiles in the pool, real benchmark processes
(started, replaced, killed), Triton really primed; only the device is a stand-in (see
``tuning_stand_in``): its timer answers from each configuration's constexprs, and really
raises, poisons itself, segfaults or hangs where a configuration asks it to."""

import functools
import os
import subprocess
import sys
import textwrap

import anyio
import pytest
import tuning_kernels as tk
import tuning_stand_in as si
from conftest import ROOT, alive, subprocess_env, wait_until

import aiocompile
from aiocompile._tuning.plan import describe
from aiocompile._tuning.tuner import Tuner

torch = pytest.importorskip("torch", reason="launch arguments are torch tensors")

x = torch.arange(4096, dtype=torch.float32)
out = torch.empty(4096)


@pytest.fixture(autouse=True)
def stand_in_driver():
    from triton.runtime import driver

    previous = driver._active
    driver.set_active(si.StandInDriver())
    try:
        yield
    finally:
        driver._active = previous
        for kernel in (tk.scale_base, tk.masked_base, tk.accumulate_base):
            kernel.device_caches.clear()


def tuning_scheduler(devices=1, **kwargs):
    sched = aiocompile.Scheduler(workers=2, **kwargs)
    sched.port._tuner = Tuner(sched.port, si.StandInTiming(devices))
    return sched


def by_config(sched):
    return {record.config: record for record in sched.port.benchmark_records()}


def cost(label):
    return int(label.split("COST=")[1].split(",")[0])


class TritonWatch:
    """Triton's own hooks: every JIT compile (``jit_cache_hook``) and every benchmark the
    autotuner starts (its ``do_bench``)."""

    def __init__(self, tuner):
        from triton import knobs

        self.compiles, self.benchmarks = [], []
        self._knobs, self._previous = knobs, knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = lambda **kw: self.compiles.append(kw["key"]) or False
        tuner.__dict__["do_bench"] = lambda kernel_call, quantiles: self.benchmarks.append(1) or [1.0, 1.0, 1.0]

    def close(self):
        self._knobs.runtime.jit_cache_hook = self._previous


async def test_tunes_in_benchmark_processes_and_primes_triton():
    kernel = tk.tuned([tk.config(64, cost=50), tk.config(128, cost=20, num_warps=2), tk.config(256, cost=35),
                       tk.config(512, mode=si.SUM)])
    async with tuning_scheduler(devices=2) as sched:
        best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        stats = sched.statistics()
        pids = sched.port._tuner.pool().processes()

    assert best.config.kwargs["BLOCK"] == 128 and best.source == "tuned"
    assert best.key == (4096, "torch.float32", "torch.float32") and best.device == 0
    assert [t.time_ms for t in best.timings] == [0.05, 0.02, 0.035, float(x.sum())]  # the tensors travelled
    assert best.kernel.name == "scale_base" and best.kernel.metadata["num_warps"] == 2
    assert (stats.tunings, stats.tuned, stats.tuning_hits, stats.benchmarks) == (1, 1, 0, 4)
    assert stats.benchmark_outcomes["ok"] == 4 and stats.compiled == 4  # every configuration compiled once
    assert stats.benchmark_processes_started == 2 and set(pids) == {0, 1}
    records = sched.port.benchmark_records()
    assert {r.pid for r in records} <= set(pids.values()) and all(r.attempt == 1 for r in records)
    assert all(r.pid != os.getpid() for r in records)  # never timed in the caller's process
    assert not alive(pids.values())  # closing the scheduler ended them

    # Triton is primed: its own launch path, with its own hooks watching, finds the choice
    # in the autotuner's cache and the binary in the JIT's: nothing compiles, nothing is
    # benchmarked.
    assert kernel.cache[best.key] is best.config
    watch = TritonWatch(kernel)
    try:
        launched = kernel.run(x, out, 4096, 2.0, grid=tk.grid, warmup=True)
    finally:
        watch.close()
    assert watch.compiles == [] and watch.benchmarks == []
    assert launched.hash == best.kernel.key and kernel.best_config is best.config


async def test_without_the_short_round_configurations_are_timed_in_full_in_the_autotuners_order():
    # Compiles end in any order (two workers, kernels of different sizes); the timings
    # start in the order of the autotuner's list, as Triton's do.
    blocks = [1024, 64, 512, 128, 256]
    kernel = tk.tuned([tk.config(b, cost=b, num_warps=8 if b >= 512 else 2) for b in blocks])
    async with tuning_scheduler(devices=1, config=aiocompile.SchedulerConfig(tuning_screen=None)) as sched:
        best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        records = sorted(sched.port.benchmark_records(), key=lambda r: r.started_at)
        stats = sched.statistics()
    assert [int(r.config.split(",")[0].split("=")[1]) for r in records] == blocks
    assert {r.round for r in records} == {"full"} and stats.benchmarks_left_out == 0
    assert best.config.kwargs["BLOCK"] == 64 and all(t.reason is None for t in best.timings)


def block(record):
    return int(record.config.split(",")[0].split("=")[1])


async def test_a_short_timing_leaves_out_the_far_slower_and_the_rest_are_timed_in_full_in_order():
    blocks, costs = [1024, 64, 512, 128, 256, 32], [400, 110, 1000, 100, 200, 120]
    kernel = tk.tuned([tk.config(b, cost=c, num_warps=8 if b >= 512 else 2) for b, c in zip(blocks, costs)])
    async with tuning_scheduler(devices=1) as sched:
        best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        records = sorted(sched.port.benchmark_records(), key=lambda r: r.started_at)
        stats = sched.statistics()
    short = [r for r in records if r.round == "short"]
    full = [r for r in records if r.round == "full"]
    # Every configuration timed briefly; those within 1.25x of the fastest (100, 110, 120)
    # timed in full after every short timing, in the autotuner's order.
    assert sorted(block(r) for r in short) == sorted(blocks)
    assert [block(r) for r in full] == [64, 128, 32]
    assert min(r.started_at for r in full) >= max(r.finished_at for r in short)
    assert best.config.kwargs["BLOCK"] == 128 and best.source == "tuned"
    timings = {int(t.label.split(",")[0].split("=")[1]): t for t in best.timings}
    assert [timings[b].time_ms for b in blocks] == [c / 1000 for c in costs]
    assert [timings[b].reason is None for b in blocks] == [False, True, False, True, False, True]
    assert "at 4.000x the fastest's (beyond 1.25x" in timings[1024].reason
    assert stats.benchmarks == 9 and stats.benchmarks_left_out == 3 and stats.benchmark_outcomes["ok"] == 9
    # Triton's autotuner sees what was measured, the short timings of those left out
    # among them, and chooses the same from them.
    assert min(kernel.configs_timings, key=kernel.configs_timings.get) is best.config


async def test_only_the_four_fastest_near_the_fastest_are_timed_in_full():
    blocks, costs = [32, 64, 128, 256, 512, 1024, 2048], [104, 300, 101, 103, 100, 105, 102]
    kernel = tk.tuned([tk.config(b, cost=c) for b, c in zip(blocks, costs)])
    async with tuning_scheduler(devices=1) as sched:
        best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        records = sorted(sched.port.benchmark_records(), key=lambda r: r.started_at)
        stats = sched.statistics()
    assert [block(r) for r in records if r.round == "full"] == [128, 256, 512, 2048]  # the autotuner's order
    assert best.config.kwargs["BLOCK"] == 512 and stats.benchmarks_left_out == 3
    why = {int(t.label.split(",")[0].split("=")[1]): t.reason for t in best.timings}
    assert "at 1.040x the fastest's (the 5th fastest: only the 4 fastest are timed in full)" in why[32]
    assert "(the 6th fastest" in why[1024]
    assert "at 3.000x the fastest's (beyond 1.25x: only those within it are timed in full)" in why[64]


async def test_one_configuration_near_the_fastest_is_chosen_from_its_short_timing():
    kernel = tk.tuned([tk.config(64, cost=300), tk.config(128, cost=100), tk.config(256, cost=200),
                       tk.config(512, cost=900)])
    async with tuning_scheduler(devices=1) as sched:
        best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        records = sched.port.benchmark_records()
    assert best.config.kwargs["BLOCK"] == 128 and [r.round for r in records] == ["short"] * 4


async def test_when_every_configuration_timed_in_full_fails_those_left_out_are_ranked_by_their_short_timing():
    kernel = tk.tuned([tk.config(64, cost=100, mode=si.FULL_FAILS), tk.config(128, cost=110, mode=si.FULL_FAILS),
                       tk.config(256, cost=400), tk.config(512, cost=300)])
    async with tuning_scheduler(devices=1) as sched:
        best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        stats = sched.statistics()
    assert best.config.kwargs["BLOCK"] == 512
    timings = {int(t.label.split(",")[0].split("=")[1]): t for t in best.timings}
    assert timings[64].time_ms is None and "only when timed in full" in timings[64].reason
    assert (timings[512].time_ms, timings[512].reason) == (0.3, None)
    assert stats.benchmark_outcomes["error"] == 2 and stats.benchmarks == 6


async def test_a_decision_is_kept_in_memory_and_shared_by_concurrent_calls():
    kernel = tk.tuned([tk.config(64, cost=30, mode=si.SLOW), tk.config(128, cost=10, mode=si.SLOW)])
    results = []
    async with tuning_scheduler() as sched:

        async def tune():
            results.append(await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid))

        async with anyio.create_task_group() as group:
            for _ in range(3):
                group.start_soon(tune)
        again = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        stats = sched.statistics()
    assert sorted(r.source for r in results) == ["joined", "joined", "tuned"]
    assert again.source == "memory" and again.config is results[0].config
    assert stats.benchmarks == 2 and stats.tuned == 1 and stats.tunings == 4 and stats.tuning_hits == 1


async def test_a_failing_configuration_costs_only_its_own_inf():
    kernel = tk.tuned([tk.config(64, cost=30), tk.config(128, mode=si.ERROR), tk.config(256, mode=si.FAULT),
                       tk.config(512, mode=si.CRASH), tk.config(1024, mode=si.HANG), tk.config(32, cost=10),
                       tk.config(3)])  # BLOCK=3: tl.arange needs a power of two, so it does not compile
    async with tuning_scheduler(devices=1, config=aiocompile.SchedulerConfig(benchmark_timeout=3)) as sched:
        best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        stats = sched.statistics()
    assert best.config.kwargs["BLOCK"] == 32
    records = by_config(sched)
    outcome = {label.split(",")[0]: (r.outcome, r.reason) for label, r in records.items()}
    assert outcome["BLOCK=64"] == ("ok", None) and outcome["BLOCK=32"] == ("ok", None)
    assert outcome["BLOCK=128"][0] == "error" and "out of resource" in outcome["BLOCK=128"][1]
    assert outcome["BLOCK=256"][0] == "fault" and "illegal memory access" in outcome["BLOCK=256"][1]
    assert outcome["BLOCK=512"][0] == "crashed" and "SIGSEGV" in outcome["BLOCK=512"][1]
    assert outcome["BLOCK=1024"][0] == "timeout" and "3 s" in outcome["BLOCK=1024"][1]
    assert outcome["BLOCK=3"][0] == "compile_error" and "power of 2" in outcome["BLOCK=3"][1]
    rounds = {label.split(",")[0]: r.round for label, r in records.items()}
    assert rounds["BLOCK=3"] is None and rounds["BLOCK=256"] == "short"  # never timed; failed in the short round
    timings = {t.label.split(",")[0]: t for t in best.timings}
    assert timings["BLOCK=256"].time_ms is None and "illegal" in timings["BLOCK=256"].reason
    # The fault, the crash and the hang each cost their process; each was replaced (the
    # last replacement may still have been starting when the scheduler closed).
    assert stats.benchmark_processes_lost == 3 and stats.benchmark_processes_started >= 3
    assert stats.benchmark_outcomes == {**stats.benchmark_outcomes, "ok": 2, "error": 1, "fault": 1, "crashed": 1,
                                        "timeout": 1, "compile_error": 1}


async def test_when_every_configuration_fails_one_error_lists_each():
    kernel = tk.tuned([tk.config(64, mode=si.ERROR), tk.config(128, mode=si.CRASH), tk.config(3)])
    async with tuning_scheduler() as sched:
        with pytest.raises(aiocompile.AutotuneError) as info:
            await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        stats = sched.statistics()
    error = info.value
    assert isinstance(error, aiocompile.CompileError) and error.kernel_name == "scale_base"
    assert [label.split(",")[0] for label, _ in error.failures] == ["BLOCK=64", "BLOCK=128", "BLOCK=3"]
    text = str(error)
    assert "no configuration of scale_base could be used (3 tried)" in text
    assert "out of resource" in text and "SIGSEGV" in text and "power of 2" in text
    assert kernel.cache == {}  # nothing primed
    assert stats.tuning_failures == 1 and stats.tunings == 0


async def test_configurations_fan_out_over_every_device(tmp_path, monkeypatch):
    # Each BARRIER configuration waits until three benchmark processes are timing at once:
    # it can only succeed if the configurations really run side by side, one per device.
    monkeypatch.setenv("STAND_IN_BARRIER", str(tmp_path))
    kernel = tk.tuned([tk.config(b, mode=si.BARRIER, cost=3) for b in (64, 128, 256)] + [tk.config(512, cost=1)])
    async with tuning_scheduler(devices=3) as sched:
        best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        records = list(sched.port.benchmark_records())
    assert all(r.outcome == "ok" for r in records), [r.reason for r in records]
    assert best.config.kwargs["BLOCK"] == 512
    assert len(os.listdir(tmp_path)) == 3 and len({r.device for r in records[:3]} | {r.device for r in records}) == 3


async def test_a_batch_of_tunings_spreads_over_the_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_BARRIER", str(tmp_path))
    kernel = tk.tuned([tk.config(64, mode=si.BARRIER, cost=2), tk.config(128, cost=5)])
    async with tuning_scheduler(devices=2) as sched:
        results = {}

        async def tune(n):
            results[n] = await sched.autotune(kernel, x, out, n, 2.0, grid=tk.grid)

        async with anyio.create_task_group() as group:
            for n in (4096, 2048):
                group.start_soon(tune, n)
        devices = {r.device for r in sched.port.benchmark_records()}
    assert {r.config.kwargs["BLOCK"] for r in results.values()} == {64}
    assert devices == {0, 1} and len(kernel.cache) == 2


async def test_an_explicit_device_is_tuned_for_and_timed_on():
    kernel = tk.tuned([tk.config(64, cost=3), tk.config(128, cost=2)])
    async with tuning_scheduler(devices=3) as sched:
        best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid, device=2)
        processes = sched.port._tuner.pool().processes()
    assert best.device == 2 and {r.device for r in sched.port.benchmark_records()} == {2}
    assert set(processes) == {2}
    assert tk.scale_base.device_caches[2][0]  # the JIT's cache for device 2 holds the choice


async def test_cancelling_the_caller_leaves_the_tuning_to_finish():
    kernel = tk.tuned([tk.config(64, cost=3, mode=si.SLOW), tk.config(128, cost=2, mode=si.SLOW)])
    async with tuning_scheduler() as sched:
        first_timing = anyio.Event()
        token = anyio.lowlevel.current_token()
        sched.subscribe(lambda e: e.event == "benchmark" and anyio.from_thread.run_sync(first_timing.set, token=token))
        async with anyio.create_task_group() as group:
            group.start_soon(functools.partial(sched.autotune, kernel, x, out, 4096, 2.0, grid=tk.grid))
            await first_timing.wait()
            group.cancel_scope.cancel()
        assert kernel.cache == {}  # the cancelled caller primed nothing
        again = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        stats = sched.statistics()
    assert again.source in ("joined", "memory") and again.config.kwargs["BLOCK"] == 128
    assert stats.tuned == 1 and stats.benchmarks == 2


async def test_closing_the_scheduler_ends_a_tuning_without_a_decision(tmp_path):
    kernel = tk.tuned([tk.config(64, cost=3), tk.config(128, mode=si.HANG)])
    sched = tuning_scheduler(cache_dir=tmp_path)
    errors = []
    async with anyio.create_task_group() as group:
        first_timing = anyio.Event()
        token = anyio.lowlevel.current_token()
        sched.subscribe(lambda e: e.event == "benchmark" and anyio.from_thread.run_sync(first_timing.set, token=token))

        async def tune():
            try:
                await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
            except aiocompile.SchedulerClosed as exc:
                errors.append(exc)

        group.start_soon(tune)
        await first_timing.wait()  # the good configuration is timed; the hang is under way
        pids = sched.port._tuner.pool().processes()
        await sched.aclose(grace=0)
    assert len(errors) == 1
    assert not list((tmp_path / "tuning").rglob("*.aiok")) and kernel.cache == {}
    assert not alive(pids.values())


async def test_no_benchmark_process_that_starts_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("STAND_IN_FAIL_START", "1")
    kernel = tk.tuned([tk.config(64), tk.config(128)])
    async with tuning_scheduler() as sched:
        with pytest.raises(aiocompile.AutotuneError, match="could not start: RuntimeError: no device answers here"):
            await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        outcomes = sched.statistics().benchmark_outcomes
    assert outcomes["start_failed"] == 2


# -- bad input -----------------------------------------------------------------------------------


async def test_what_is_not_an_autotuned_kernel_is_refused_naming_warmup():
    async with tuning_scheduler() as sched:
        with pytest.raises(TypeError, match=r"warmup\(\)"):
            await sched.autotune(tk.scale_base, x, out, 4096, 2.0, grid=tk.grid, BLOCK=64, MODE=0, COST=1)
        with pytest.raises(TypeError, match=r"warmup\(\)"):
            await sched.autotune(len, x, grid=(1,))
        import triton

        only_heuristics = triton.heuristics({"EVEN": lambda a: True})(tk.masked_base)
        with pytest.raises(TypeError, match=r"only @triton.heuristics.*warmup\(\)"):
            await sched.autotune(only_heuristics, x, out, 4096, grid=(1,), BLOCK=64, WIDE=0)
        with pytest.raises(TypeError, match="grid"):
            await sched.autotune(tk.tuned([tk.config(64), tk.config(128)]), x, out, 4096, 2.0)
        assert sched.statistics().submitted == 0


async def test_arguments_that_do_not_bind_raise_what_warmup_raises():
    kernel = tk.tuned([tk.config(64), tk.config(128)])
    async with tuning_scheduler() as sched:
        with pytest.raises(TypeError, match="scale_base") as tuned:
            await sched.autotune(kernel, x, out, grid=tk.grid)  # too few arguments
        with pytest.raises(TypeError, match="scale_base") as warmed:
            await sched.warmup(tk.scale_base, x, out, grid=(1,), target="cuda:90", BLOCK=64, MODE=0, COST=1)
        assert str(tuned.value) == str(warmed.value)
        assert sched.statistics().submitted == 0


async def test_no_gpu_for_the_device_is_a_runtime_error_before_anything_compiles():
    kernel = tk.tuned([tk.config(64), tk.config(128)])
    async with aiocompile.Scheduler(workers=1) as sched:  # the real timing: this machine has no GPU
        with pytest.raises(RuntimeError, match="shows none"):
            await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        assert sched.statistics().submitted == 0 and sched.port._tuner._pool is None
    async with tuning_scheduler(devices=2) as sched:
        with pytest.raises(RuntimeError, match="no such GPU"):
            await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid, device=5)
        with pytest.raises(ValueError):
            await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid, device=-1)
        assert sched.statistics().submitted == 0


# -- decisions across processes --------------------------------------------------------------------

TUNE_IN_A_CHILD = textwrap.dedent('''
    import asyncio, sys
    sys.path.insert(0, sys.argv[2])
    import torch
    from triton.runtime import driver
    import aiocompile, tuning_kernels as tk, tuning_stand_in as si
    from aiocompile._tuning.tuner import Tuner

    driver.set_active(si.StandInDriver())
    kernel = tk.tuned([tk.config(64, cost=9), tk.config(128, cost=4), tk.config(256, cost=7)])

    async def main():
        async with aiocompile.Scheduler(workers=2, cache_dir=sys.argv[1]) as sched:
            sched.port._tuner = Tuner(sched.port, si.StandInTiming(1))
            best = await sched.autotune(kernel, torch.ones(4096), torch.empty(4096), 4096, 2.0, grid=tk.grid)
            print(best.source, best.config.kwargs["BLOCK"])

    asyncio.run(main())
''')


async def test_a_restarted_process_finds_the_decision_and_tunes_nothing(tmp_path):
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-c", TUNE_IN_A_CHILD, str(cache), str(ROOT / "tests")],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["tuned", "128"]
    files = list((cache / "tuning").rglob("*.aiok"))
    assert len(files) == 1

    kernel = tk.tuned([tk.config(64, cost=9), tk.config(128, cost=4), tk.config(256, cost=7)])
    async with tuning_scheduler(cache_dir=cache) as sched:
        best = await sched.autotune(kernel, torch.ones(4096), torch.empty(4096), 4096, 2.0, grid=tk.grid)
        stats = sched.statistics()
    assert best.source == "disk" and best.config.kwargs["BLOCK"] == 128
    assert [t.time_ms for t in best.timings] == [0.009, 0.004, 0.007]
    assert (stats.benchmarks, stats.benchmark_processes_started, stats.tuning_hits) == (0, 0, 1)
    assert sched.port._tuner._pool is None  # not a single benchmark process
    assert stats.disk_hits == 1  # and the chosen binary came from the disk cache too

    # Carried to another machine's directory with the command line: found there too.
    exported, fleet = tmp_path / "decisions.json", tmp_path / "fleet"
    for command in (["export", str(cache), "-o", str(exported)], ["import", str(fleet), str(exported)]):
        done = subprocess.run([sys.executable, "-m", "aiocompile", "decisions", *command], capture_output=True,
                              text=True, env=subprocess_env(), timeout=120)
        assert done.returncode == 0, done.stderr
    kernel.cache.clear()
    async with tuning_scheduler(cache_dir=fleet) as sched:
        carried = await sched.autotune(kernel, torch.ones(4096), torch.empty(4096), 4096, 2.0, grid=tk.grid)
        assert sched.statistics().benchmarks == 0 and sched.port._tuner._pool is None
    assert carried.source == "disk" and carried.config is best.config

    # A decision file that does not decode is a miss: tuned again, and written anew.
    files[0].write_bytes(files[0].read_bytes()[:-5])
    kernel.cache.clear()
    async with tuning_scheduler(cache_dir=cache) as sched:
        again = await sched.autotune(kernel, torch.ones(4096), torch.empty(4096), 4096, 2.0, grid=tk.grid)
    assert again.source == "tuned"
    from aiocompile._tuning.decisions import Decision

    assert Decision.from_bytes(files[0].read_bytes()).label == again.label


async def test_sealed_decisions_need_the_key(tmp_path):
    cache = tmp_path / "cache"
    kernel = tk.tuned([tk.config(64, cost=9), tk.config(128, cost=4)])
    async with tuning_scheduler(cache_dir=cache, config=aiocompile.SchedulerConfig(cache_key="secret")) as sched:
        await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
    assert (next((cache / "tuning").rglob("*.aiok")).read_bytes()).startswith(b"AIOCOMPILE-SEALED")
    for key, source in (("secret", "disk"), ("another", "tuned")):
        kernel.cache.clear()
        config = aiocompile.SchedulerConfig(cache_key=key)
        async with tuning_scheduler(cache_dir=cache, config=config) as sched:
            best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        assert best.source == source


ABANDONED = textwrap.dedent('''
    import asyncio, os, sys, time
    sys.path.insert(0, sys.argv[1])
    import aiocompile, tuning_stand_in as si
    from aiocompile._tuning.tuner import Tuner

    async def main():
        sched = aiocompile.Scheduler(workers=1)
        sched.port._tuner = Tuner(sched.port, si.StandInTiming(2))
        await sched.warm("cuda:90", benchmark=True)
        pool = sched.port._tuner.pool()
        while pool.ready() != {0, 1}:
            await asyncio.sleep(0.02)
        print(*pool.processes().values(), flush=True)
        os._exit(0)  # no close: the benchmark processes must notice on their own

    asyncio.run(main())
''')


def test_benchmark_processes_die_with_their_parent():
    done = subprocess.run([sys.executable, "-c", ABANDONED, str(ROOT / "tests")], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    assert wait_until(lambda: not alive(pids), timeout=30)


# -- records ----------------------------------------------------------------------------------------


async def test_each_benchmark_is_a_record_in_every_sink(tmp_path):
    import json

    seen = []
    log = tmp_path / "events.jsonl"
    kernel = tk.tuned([tk.config(64, cost=3), tk.config(128, mode=si.ERROR)])
    async with tuning_scheduler(event_log=log, on_event=seen.append) as sched:
        await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
    benchmarks = [e for e in seen if e.event == "benchmark"]
    assert sorted(b.outcome for b in benchmarks) == ["error", "ok"]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    written = [line for line in lines if line["event"] == "benchmark"]
    assert written == [{"event": "benchmark", **b.to_dict()} for b in benchmarks]
    ok = next(b for b in benchmarks if b.outcome == "ok")
    assert ok.time_ms == 0.003 and ok.device == 0 and ok.device_name == "Stand-in GPU" and ok.key
    assert ok.finished_at >= ok.started_at and ok.attempt == 1
    # The compiles are ordinary requests, recorded as such.
    assert sum(1 for e in seen if e.event == "request" and e.outcome == "compiled") == 2


# -- benchmark processes started with the scheduler -------------------------------------------------


async def test_benchmark_at_start_starts_the_processes_with_the_scheduler():
    kernel = tk.tuned([tk.config(64, cost=6), tk.config(128, cost=2)])
    sched = tuning_scheduler(devices=2, config=aiocompile.SchedulerConfig(benchmark_at_start=True))
    async with sched:
        pool = sched.port._tuner.pool()
        # Up before anything is tuned or compiled.
        assert await anyio.to_thread.run_sync(lambda: wait_until(lambda: pool.ready() == {0, 1}, timeout=120))
        started = pool.processes()
        assert sched.statistics().submitted == 0
        best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        stats = sched.statistics()
        records = sched.port.benchmark_records()
    assert best.config.kwargs["BLOCK"] == 128
    # The tuning used them: none started for it.
    assert stats.benchmark_processes_started == 2 and {r.pid for r in records} <= set(started.values())
    assert not alive(started.values())


IMPORT_AFTER_THE_START = """
import asyncio, sys, time
sys.path.insert(0, sys.argv[1])
import aiocompile
import tuning_stand_in as si
from aiocompile._tuning.tuner import Tuner

async def main():
    sched = aiocompile.Scheduler(workers=1, config=aiocompile.SchedulerConfig(benchmark_at_start=True))
    sched.port._tuner = Tuner(sched.port, si.StandInTiming(1))
    async with sched:
        await asyncio.sleep(1.0)
        # The scheduler's start imported neither: the program may be importing them.
        assert "triton" not in sys.modules and "torch" not in sys.modules, sorted(sys.modules)
        import triton  # the program's own import, while the start waits for it
        from triton.runtime.cache import triton_key
        deadline = time.monotonic() + 60
        while triton_key.cache_info().currsize == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        print("hashed" if triton_key.cache_info().currsize else "not hashed")

asyncio.run(main())
"""


def test_benchmark_at_start_pays_the_first_costs_once_the_program_has_imported_triton():
    # Importing a package from two threads at once can fail with a partially initialised
    # module: the start never imports Triton itself, it waits for the program's import,
    # then hashes Triton for the first compile's key.
    done = subprocess.run([sys.executable, "-c", IMPORT_AFTER_THE_START, str(ROOT / "tests")], capture_output=True,
                          text=True, env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "hashed"


async def test_a_benchmark_process_that_dies_before_use_is_replaced_at_once():
    import signal

    kernel = tk.tuned([tk.config(64, cost=6), tk.config(128, cost=2)])
    sched = tuning_scheduler(config=aiocompile.SchedulerConfig(benchmark_at_start=True))
    async with sched:
        pool = sched.port._tuner.pool()
        assert await anyio.to_thread.run_sync(lambda: wait_until(lambda: pool.ready() == {0}, timeout=120))
        first = pool.processes()[0]
        os.kill(first, signal.SIGKILL)
        # Noticed while idle and replaced without waiting for a configuration to find it gone.
        assert await anyio.to_thread.run_sync(
            lambda: wait_until(lambda: pool.ready() == {0} and pool.processes()[0] != first, timeout=120))
        second = pool.processes()[0]
        stats = sched.statistics()
        assert (stats.benchmark_processes_started, stats.benchmark_processes_lost) == (2, 1)
        best = await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        records = sched.port.benchmark_records()
        stats = sched.statistics()
    assert best.config.kwargs["BLOCK"] == 128
    # No configuration paid for the death: each timed once, in the replacement.
    assert {r.pid for r in records} == {second} and all(r.attempt == 1 for r in records)
    assert stats.benchmark_processes_started == 2


async def test_benchmark_at_start_starts_nothing_without_a_gpu():
    sched = tuning_scheduler(devices=0, config=aiocompile.SchedulerConfig(benchmark_at_start=True))
    async with sched:
        starting = sched.port._tuner.starting
        assert starting is not None
        await anyio.to_thread.run_sync(lambda: starting.result(timeout=60))
        assert sched.port._tuner._pool is None


async def test_a_tuning_leaves_a_profile_of_its_steps():
    kernel = tk.tuned([tk.config(64, cost=6), tk.config(128, cost=2)])
    async with tuning_scheduler() as sched:
        await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        profile = sched.port._tuner.last_profile
        starts = list(sched.port._tuner.pool().starts)
    steps = ["called_at", "resolved_at", "planned_at", "expanded_at", "tune_at", "inputs_read_at", "decided_at",
             "primed_at"]
    assert [profile[step] for step in steps] == sorted(profile[step] for step in steps)
    assert [row["label"] for row in profile["configs"]] == [describe(c) for c in kernel.configs]
    for row in profile["configs"]:
        assert row["compiled_at"] <= row["submitted_at"] <= row["bench_started_at"] <= row["bench_finished_at"]
        assert row["seconds"] >= 0
    assert list(profile["inputs_sent"]) == [0]
    assert len(starts) == 1 and starts[0]["launched_at"] <= starts[0]["opening_at"] <= starts[0]["ready_at"]


async def test_the_tensors_reach_a_process_while_it_starts(tmp_path, monkeypatch):
    import threading

    gate = tmp_path / "started"
    monkeypatch.setenv("STAND_IN_START_GATE", str(gate))
    kernel = tk.tuned([tk.config(64, mode=si.SUM), tk.config(128, cost=2)])
    from aiocompile._tuning.benchproc import BenchProcess
    from aiocompile._tuning.task import LoadInputs

    sent = threading.Event()
    real_send = BenchProcess.send

    def send(process, message):
        real_send(process, message)
        if isinstance(message, LoadInputs):
            sent.set()

    monkeypatch.setattr(BenchProcess, "send", send)
    async with tuning_scheduler() as sched:
        pool = sched.port._tuner.pool()
        async with anyio.create_task_group() as group:
            results = []

            async def tune():
                results.append(await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid))

            group.start_soon(tune)
            # The tuning's tensors are sent while the process is still starting ...
            assert await anyio.to_thread.run_sync(lambda: sent.wait(120))
            assert pool.ready() == set()
            gate.touch()  # ... and only then may it be ready.
        profile = sched.port._tuner.last_profile
        start = pool.starts[0]
        records = by_config(sched)
    sending, _ = profile["inputs_sent"][0]
    assert sending < start["ready_at"]  # sent before it was ready, not after
    best = results[0]
    assert [t.time_ms for t in best.timings] == [float(x.sum()), 0.002]  # they arrived whole
    assert all(r.attempt == 1 for r in records.values())


async def test_large_tensors_travel_through_shared_memory_gone_after_the_tuning():
    from aiocompile._tuning.inputs import SHARE_ABOVE, SharedInputs

    n = 1 << 19  # 2 MiB of float32: above SHARE_ABOVE
    big, big_out = torch.arange(n, dtype=torch.float32), torch.empty(n)
    assert big.numel() * 4 > SHARE_ABOVE
    kernel = tk.tuned([tk.config(64, mode=si.SUM), tk.config(128, cost=2)])
    sessions = []
    async with tuning_scheduler() as sched:
        pool = sched.port._tuner.pool()
        real_offer = pool.offer

        def offer(session, devices):
            sessions.append(session)
            real_offer(session, devices)

        pool.offer = offer
        best = await sched.autotune(kernel, big, big_out, n, 2.0, grid=tk.grid)
    assert [t.time_ms for t in best.timings] == [float(big.sum()), 0.002]  # the values arrived whole
    wire = sessions[0].wire()
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here: the tensors went through the pipe")
    assert isinstance(wire, SharedInputs) and not os.path.exists(wire.path)  # removed when the tuning ended


def test_the_short_round_is_a_fifth_of_the_autotuners_timing_and_only_where_it_can_save():
    from aiocompile._tuning.rounds import Screen, screen_for

    assert screen_for(("default",), 1.25, 8) == Screen(5.0, 20.0, 1.25)  # do_bench's 25 and 100 ms
    assert screen_for(("do_bench", 50, 200), 1.5, 8) == Screen(10.0, 40.0, 1.5)  # warmup=, rep= of the autotuner
    assert screen_for(("default",), None, 8) is None  # tuning_screen=None
    assert screen_for(("default",), 1.25, 3) is None  # too few to save anything
    assert screen_for(("cudagraph", 100), 1.25, 8) is None and screen_for(("custom", b""), 1.25, 8) is None
