"""How long the event loop is held while kernels compile and load, and during bursts.

A ticker wakes every 1 ms and notes how late it woke. Meanwhile 32 distinct kernels (the
example set in three ``num_warps`` variants) compile through aiocompile and, on a GPU, are
loaded with ``await kernel.load()`` (binary loaded, launcher built, in a thread). For
contrast, the same number of compiles straight from the coroutine (``triton.compile`` in
the event loop's thread), as code that does not hand them off would do.

Then two bursts, each through aiocompile and beside it a stdlib ``ProcessPoolExecutor``
(``loop.run_in_executor``), with the same number of warm workers, ``--rounds`` rounds
each, alternating: 2,000 concurrent calls of a trivial function, gathered at once; and one
call returning 200 MB. The ticker's lateness is reported per round, with the longest pause
of Python's garbage collector during the round (``gc.callbacks``): a full collection in a
process holding Triton takes tens of milliseconds whoever triggers it.

    python benchmarks/bench_loop_lag.py [--json out.json] [--rounds 3] [--bursts-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")]

BURST_CALLS = 2000
LARGE_RESULT = 200 * 1024 * 1024


def specs(target):
    from kernels import KERNELS

    out = []
    for warps in (None, 2, 8):
        for entry in KERNELS:
            spec = {k: v for k, v in entry.items() if k != "label"}
            if warps is not None:
                spec["num_warps"] = warps
            spec["target"] = target
            out.append(spec)
    return out[:32]


class Ticker:
    def __init__(self, period=0.001):
        self.period = period
        self.lags: list[float] = []
        self._stop = False

    async def run(self):
        loop = asyncio.get_running_loop()
        while not self._stop:
            due = loop.time() + self.period
            await asyncio.sleep(self.period)
            self.lags.append(max(0.0, loop.time() - due))

    def summary(self):
        ordered = sorted(self.lags)
        pick = lambda p: ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000  # noqa: E731
        return {"ticks": len(ordered), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": ordered[-1] * 1000,
                "mean_ms": statistics.fmean(ordered) * 1000, "over_10ms": sum(1 for lag in ordered if lag > 0.010)}


async def with_aiocompile(target, load):
    import aiocompile

    ticker = Ticker()
    todo = specs(target)  # imports the kernels: not part of what is measured
    async with aiocompile.Scheduler() as sched:
        await sched.warm("cuda:90")
        tick = asyncio.create_task(ticker.run())
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        kernels = await sched.compile_many(todo)
        if load:
            await asyncio.gather(*(kernel.load() for kernel in kernels))
        wall = time.perf_counter() - started
        ticker._stop = True
        await tick
    return {"wall_s": wall, "kernels": len(kernels), "loaded": load, **ticker.summary()}


async def in_the_loop(target):
    import triton
    from triton.compiler import ASTSource

    from aiocompile._base.target import parse_target

    gpu_target = parse_target(target).to_gpu_target() if target else None
    ticker = Ticker()
    todo = specs(target)
    tick = asyncio.create_task(ticker.run())
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    for spec in todo:
        fn = spec["kernel"]
        signature = dict(spec["signature"])
        signature.update({name: "constexpr" for name in spec["constexprs"]})
        options = {k: v for k, v in spec.items() if k in ("num_warps", "num_stages")}
        triton.compile(ASTSource(fn, signature, spec["constexprs"]), target=gpu_target, options=options)
        await asyncio.sleep(0)  # a coroutine that compiles between awaits
    wall = time.perf_counter() - started
    ticker._stop = True
    await tick
    return {"wall_s": wall, "kernels": 32, **ticker.summary()}


class GcPauses:
    """The garbage collector's pauses while it is attached (``gc.callbacks``), as
    ``(generation, started, ended)`` on ``time.perf_counter()``'s clock."""

    def __init__(self):
        self.pauses: list[tuple[int, float, float]] = []
        self._started = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], self._started, time.perf_counter()))

    def within(self, start, end):
        """Seconds of collection between ``start`` and ``end``."""
        return sum(max(0.0, min(end, e) - max(start, s)) for _, s, e in self.pauses)

    def __enter__(self):
        import gc

        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        import gc

        gc.callbacks.remove(self)

    def longest_ms(self):
        return max((e - s for _, s, e in self.pauses), default=0.0) * 1000


class WindowTicker(Ticker):
    """A ``Ticker`` that also keeps each tick's window (when it was due, when it woke) on
    ``time.perf_counter()``'s clock, to tell the collector's share of each."""

    def __init__(self, period=0.001):
        super().__init__(period)
        self.windows: list[tuple[float, float]] = []

    async def run(self):
        while not self._stop:
            due = time.perf_counter() + self.period
            await asyncio.sleep(self.period)
            woke = time.perf_counter()
            self.lags.append(max(0.0, woke - due))
            self.windows.append((due, woke))


async def measure_burst(burst):
    """Run ``burst()`` (a coroutine function) under the ticker: wall time and lateness,
    also with the garbage collector's pauses taken out of each tick."""
    ticker = WindowTicker()
    tick = asyncio.create_task(ticker.run())
    await asyncio.sleep(0.05)
    with GcPauses() as gc_pauses:
        started = time.perf_counter()
        await burst()
        wall = time.perf_counter() - started
        ticker._stop = True
        await tick
    summary = ticker.summary()
    without_gc = [max(0.0, (woke - due) - gc_pauses.within(due, woke)) for due, woke in ticker.windows]
    return {"wall_s": wall, **summary, "over_20ms": sum(1 for lag in ticker.lags if lag > 0.020),
            "max_without_gc_ms": max(without_gc, default=0.0) * 1000,
            "gc_collections": len(gc_pauses.pauses), "gc_longest_ms": gc_pauses.longest_ms()}


async def bursts(rounds, workers):
    """Both bursts through both pools, alternating, ``rounds`` times."""
    import concurrent.futures as cf
    import gc

    import _burst_jobs

    import aiocompile

    results: dict[str, dict[str, list]] = {"many_calls": {}, "large_result": {}}
    loop = asyncio.get_running_loop()
    # Results are kept until the round is measured: freeing 200 MB in the loop's thread is
    # the caller's cost, whichever pool made it.
    kept: list = []
    async with aiocompile.Scheduler(workers=workers) as sched:
        await sched.warm("cuda:90")
        with cf.ProcessPoolExecutor(workers) as pool:
            # Every stdlib worker started and warm too.
            await asyncio.gather(*(loop.run_in_executor(pool, _burst_jobs.identity, i) for i in range(workers * 4)))

            async def ours_many():
                out = await asyncio.gather(*(sched.run(_burst_jobs.identity, i) for i in range(BURST_CALLS)))
                assert out == list(range(BURST_CALLS))

            async def stdlib_many():
                out = await asyncio.gather(*(loop.run_in_executor(pool, _burst_jobs.identity, i)
                                             for i in range(BURST_CALLS)))
                assert out == list(range(BURST_CALLS))

            async def ours_large():
                kept.append(await sched.run(_burst_jobs.big_bytes, LARGE_RESULT))
                assert len(kept[-1]) == LARGE_RESULT

            async def stdlib_large():
                kept.append(await loop.run_in_executor(pool, _burst_jobs.big_bytes, LARGE_RESULT))
                assert len(kept[-1]) == LARGE_RESULT

            for index in range(2 * rounds):
                # The second half after gc.freeze(), as a server does after start-up: what
                # was loaded (Triton, torch) is no longer walked by each full collection.
                if index == rounds:
                    gc.collect()
                    gc.freeze()
                suffix = ", gc.freeze()" if index >= rounds else ""
                for burst, way, run in (("many_calls", "aiocompile", ours_many),
                                        ("many_calls", "ProcessPoolExecutor", stdlib_many),
                                        ("large_result", "aiocompile", ours_large),
                                        ("large_result", "ProcessPoolExecutor", stdlib_large)):
                    results[burst].setdefault(way + suffix, []).append(await measure_burst(run))
                    kept.clear()
            gc.unfreeze()
    return {"workers": workers, "calls": BURST_CALLS, "large_result_bytes": LARGE_RESULT, "rounds": rounds,
            **results}


def print_bursts(report):
    print(f"\nBursts ({report['workers']} workers each; {report['rounds']} rounds): "
          f"{report['calls']} concurrent calls, and one {report['large_result_bytes'] >> 20} MB result")
    print(f"{'':<48}{'round':>6}{'wall s':>8}{'p99 ms':>8}{'max ms':>8}{'>20 ms':>8}{'max w/o gc':>11}"
          f"{'gc max ms':>10}")
    for burst in ("many_calls", "large_result"):
        for way, rows in report[burst].items():
            for index, r in enumerate(rows, 1):
                print(f"{burst + ' ' + way:<48}{index:>6}{r['wall_s']:8.2f}{r['p99_ms']:8.2f}{r['max_ms']:8.1f}"
                      f"{r['over_20ms']:8d}{r['max_without_gc_ms']:11.1f}{r['gc_longest_ms']:10.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each burst (default 3)")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                        help="workers in each pool for the bursts (default: 4, or fewer CPUs)")
    parser.add_argument("--bursts-only", action="store_true", help="skip the 32-kernel compile")
    options = parser.parse_args()
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    target = None if gpu else "cuda:90"
    report = {"cpus": os.cpu_count(), "gpu": gpu}
    if not options.bursts_only:
        # Fresh Triton caches for each, so that both really compile.
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="aiocompile-lag-")
        report["aiocompile"] = asyncio.run(with_aiocompile(target, load=gpu))
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="aiocompile-lag-")
        report["triton.compile in the loop"] = asyncio.run(in_the_loop(target))
        print(f"1 ms ticker while 32 kernels compile{' and load' if gpu else ''} ({report['cpus']} CPUs)")
        print(f"{'':<28}{'wall s':>8}{'ticks':>7}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'>10 ms':>8}")
        for name in ("aiocompile", "triton.compile in the loop"):
            r = report[name]
            print(f"{name:<28}{r['wall_s']:8.2f}{r['ticks']:7d}{r['p50_ms']:8.2f}{r['p99_ms']:8.2f}"
                  f"{r['max_ms']:8.1f}{r['over_10ms']:8d}")
    report["bursts"] = asyncio.run(bursts(options.rounds, options.workers))
    print_bursts(report["bursts"])
    if options.json:
        with open(options.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
