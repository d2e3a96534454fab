"""How long the event loop is held while kernels compile and load.

A ticker wakes every 1 ms and notes how late it woke. Meanwhile 32 distinct kernels (the
example set in three ``num_warps`` variants) compile through aiocompile and, on a GPU, are
loaded with ``await kernel.load()`` (binary loaded, launcher built, in a thread). For
contrast, the same number of compiles straight from the coroutine (``triton.compile`` in
the event loop's thread), as code that does not hand them off would do.

    python benchmarks/bench_loop_lag.py [--json out.json]
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
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]


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

    from aiocompile._target import parse_target

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    options = parser.parse_args()
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    target = None if gpu else "cuda:90"
    report = {"cpus": os.cpu_count(), "gpu": gpu}
    # Fresh Triton caches for each, so that both really compile.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="aiocompile-lag-")
    report["aiocompile"] = asyncio.run(with_aiocompile(target, load=gpu))
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="aiocompile-lag-")
    report["triton.compile in the loop"] = asyncio.run(in_the_loop(target))
    print(f"1 ms ticker while 32 kernels compile{' and load' if gpu else ''} ({report['cpus']} CPUs)")
    print(f"{'':<28}{'wall s':>8}{'ticks':>7}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'>10 ms':>8}")
    for name in ("aiocompile", "triton.compile in the loop"):
        r = report[name]
        print(f"{name:<28}{r['wall_s']:8.2f}{r['ticks']:7d}{r['p50_ms']:8.2f}{r['p99_ms']:8.2f}{r['max_ms']:8.1f}"
              f"{r['over_10ms']:8d}")
    if options.json:
        with open(options.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
