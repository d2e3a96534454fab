"""autotune() on a GPU: real tuning in benchmark processes, Triton primed (proved with its
own hooks), a configuration that faults the GPU costing only its own inf, and the chosen
configuration's output equal to torch's.

Run with ``pytest -m gpu``; skipped where torch or a CUDA device is missing. The tests are
plain functions around ``asyncio.run`` so they need no async plugin.
"""

import asyncio

import gpu_tuning_kernels as gk
import pytest

import aiocompile

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class TritonWatch:
    """Triton's own hooks around a launch: every JIT compile (``jit_cache_hook``), every
    benchmark the autotuner starts (its ``do_bench``), and, where Triton has it, every
    tuning its ``autotuning.listener`` reports."""

    def __init__(self, tuner):
        from triton import knobs

        self.compiles, self.benchmarks, self.tunings = [], [], []
        self._knobs = knobs
        self._hook = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = lambda **kw: self.compiles.append(kw["key"]) or False
        real = tuner.do_bench

        def counting(kernel_call, quantiles):
            self.benchmarks.append(1)
            return real(kernel_call, quantiles=quantiles)

        tuner.__dict__["do_bench"] = counting
        self._listener = getattr(getattr(knobs, "autotuning", None), "listener", None)
        if hasattr(getattr(knobs, "autotuning", None), "listener"):
            knobs.autotuning.listener = lambda **kw: self.tunings.append(kw)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._knobs.runtime.jit_cache_hook = self._hook
        if hasattr(getattr(self._knobs, "autotuning", None), "listener"):
            self._knobs.autotuning.listener = self._listener


def matrices(m=512, n=512, k=512):
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16)
    return a, b, torch.empty(m, n, device="cuda", dtype=torch.float16)


def test_tunes_primes_and_the_launch_neither_compiles_nor_benchmarks(tmp_path):
    kernel = gk.tuned()
    a, b, c = matrices()

    async def tune():
        async with aiocompile.Scheduler(workers=4, cache_dir=tmp_path) as sched:
            best = await sched.autotune(kernel, *gk.launch_args(a, b, c), grid=gk.grid)
            return best, sched.statistics(), list(sched.port.benchmark_records())

    best, stats, records = asyncio.run(tune())
    assert best.source == "tuned" and best.device == torch.cuda.current_device()
    assert best.device_name == torch.cuda.get_device_name()
    # Every configuration timed briefly; those near the fastest timed in full, the fastest
    # of them chosen (one left: its short timing decides).
    short = [r for r in records if r.round == "short"]
    full = [r for r in records if r.round == "full"]
    assert len(short) == len(gk.CONFIGS) and stats.benchmarks == len(short) + len(full)
    assert stats.benchmark_outcomes["ok"] == stats.benchmarks
    assert stats.benchmarks_left_out == len(gk.CONFIGS) - max(len(full), 1)
    assert all(r.time_ms > 0 and r.p20_ms <= r.time_ms <= r.p80_ms for r in records)
    fastest = min(full or short, key=lambda r: r.time_ms)
    assert fastest.config == best.label

    with TritonWatch(kernel) as watch:
        launched = kernel[gk.grid](*gk.launch_args(a, b, c))
        torch.cuda.synchronize()
    assert (watch.compiles, watch.benchmarks, watch.tunings) == ([], [], [])
    assert launched.hash == best.kernel.key and kernel.best_config is best.config
    torch.testing.assert_close(c, a @ b, atol=1e-2, rtol=1e-2)

    # A restarted scheduler finds the decision (and the binary) on disk: it tunes nothing.
    kernel.cache.clear()
    gk.matmul_base.device_caches.clear()

    async def again():
        async with aiocompile.Scheduler(workers=2, cache_dir=tmp_path) as sched:
            return await sched.autotune(kernel, *gk.launch_args(a, b, c), grid=gk.grid), sched.statistics()

    best_again, stats = asyncio.run(again())
    assert best_again.source == "disk" and best_again.config is best.config
    assert stats.benchmarks == 0 and stats.benchmark_processes_started == 0
    with TritonWatch(kernel) as watch:
        kernel[gk.grid](*gk.launch_args(a, b, c))
        torch.cuda.synchronize()
    assert (watch.compiles, watch.benchmarks) == ([], [])


def test_a_configuration_that_faults_the_gpu_costs_only_its_own_inf():
    kernel = gk.tuned([*gk.CONFIGS[:3], gk.config(64, 64, 32, 4, 3, offset=1 << 40)])
    a, b, c = matrices()

    async def tune():
        async with aiocompile.Scheduler(workers=4) as sched:
            best = await sched.autotune(kernel, *gk.launch_args(a, b, c), grid=gk.grid)
            return best, sched.statistics(), {r.config: r for r in sched.port.benchmark_records()}

    best, stats, records = asyncio.run(tune())
    faulty = next(r for label, r in records.items() if "OFFSET=1099511627776" in label)
    assert faulty.outcome == "fault" and faulty.time_ms is None
    assert "illegal" in faulty.reason.lower() or "address" in faulty.reason.lower()
    assert all(r.outcome == "ok" for label, r in records.items() if r is not faulty)
    assert stats.benchmark_processes_lost >= 1 and best.config.kwargs["OFFSET"] == 0
    # This process's own CUDA context never saw the fault.
    kernel[gk.grid](*gk.launch_args(a, b, c))
    torch.cuda.synchronize()
    torch.testing.assert_close(c, a @ b, atol=1e-2, rtol=1e-2)


def test_reset_to_zero_kernels_tune_and_launch_correctly():
    x = torch.rand(1 << 20, device="cuda")
    total = torch.zeros(1, device="cuda")

    def grid(meta):
        return ((x.numel() + meta["BLOCK"] - 1) // meta["BLOCK"],)

    async def tune():
        async with aiocompile.Scheduler(workers=2) as sched:
            return await sched.autotune(gk.accumulate, x, total, x.numel(), grid=grid)

    best = asyncio.run(tune())
    assert best.source == "tuned" and torch.count_nonzero(total) == 0  # the caller's tensors untouched
    with TritonWatch(gk.accumulate) as watch:
        gk.accumulate[grid](x, total, x.numel())
        torch.cuda.synchronize()
    assert (watch.compiles, watch.benchmarks) == ([], [])
    torch.testing.assert_close(total, x.sum().reshape(1), rtol=1e-4, atol=1e-2)


def test_benchmark_at_start_has_the_process_up_before_the_first_tuning():
    import time

    kernel = gk.tuned()
    a, b, c = matrices()

    async def tune():
        config = aiocompile.SchedulerConfig(benchmark_at_start=True)
        async with aiocompile.Scheduler(workers=4, config=config) as sched:
            pool = sched.port.tuner().pool()
            deadline = time.monotonic() + 180
            while pool.ready() != set(pool.devices) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            up = pool.processes()
            submitted = sched.statistics().submitted
            best = await sched.autotune(kernel, *gk.launch_args(a, b, c), grid=gk.grid)
            return (up, set(pool.devices), submitted, best, sched.statistics(), list(pool.starts),
                    sched.port.tuner().last_profile)

    up, devices, submitted, best, stats, starts, profile = asyncio.run(tune())
    # One benchmark process per GPU of the current one's model, each up before the first tuning.
    assert devices <= set(range(torch.cuda.device_count())) and torch.cuda.current_device() in devices
    assert set(up) == devices and submitted == 0
    assert stats.benchmark_processes_started == len(devices) and best.source == "tuned"
    # The real timer's start, step by step: torch, the context, Triton's driver beside it.
    start = starts[0]
    assert start["launched_at"] <= start["opening_at"] <= start["ready_at"]
    assert start["import_torch_s"] > 0 and start["context_s"] > 0 and start["triton_driver_s"] > 0
    # Each configuration's short timing, and the full one of those near the fastest.
    assert all(row["short_load_s"] >= 0 and row["short_bench_s"] > 0 for row in profile["configs"])
    full = [row for row in profile["configs"] if "bench_s" in row]
    assert 1 < len(full) <= 4 or (not full and stats.benchmarks_left_out == len(gk.CONFIGS) - 1)
    assert all(row["load_s"] >= 0 and row["bench_s"] > 0 for row in full)
    kernel[gk.grid](*gk.launch_args(a, b, c))
    torch.cuda.synchronize()
    torch.testing.assert_close(c, a @ b, atol=1e-2, rtol=1e-2)
