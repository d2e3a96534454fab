"""Dispatch: the round trip of a trivial job through each process pool, from a coroutine.

``abs(-1)`` sent to a warm worker and answered, awaited one call after another, so that
what is measured is the pool's own cost per job (pickling, the hop to the worker and back,
waking the coroutine), not the job's. One worker each, in one event loop:

- ``aiocompile``: ``await sched.run(abs, -1)`` on ``Scheduler(workers=1)``, metrics on
  (the default: a timing record per request);
- ``ProcessPoolExecutor``: ``await loop.run_in_executor(pool, abs, -1)`` on a stdlib
  pool of one worker (forkserver);
- ``anyio to_process``: ``await anyio.to_process.run_sync(abs, -1)`` with a limiter of 1;
- ``... __main__``: the same two with ``negate``, a function defined in this script (run as
  ``python benchmarks/bench_dispatch.py``, it lives in ``__main__``, as a script's or a
  notebook's functions do). anyio's workers run the main script once; aiocompile's never do,
  so it sends such a function by value.

They take turns in rounds, so that drift of the machine hits them all alike (each round's
order rotated, and reversed every other round, so that each way follows more than one
other); after a
warm-up of 200 calls each. Each round's medians are reported too, with aiocompile's ratio
to anyio's in that round: on a shared machine a round's neighbours matter more than the
whole run's. ``benchmarks/bench_metrics.py`` measures, the same way, what
aiocompile's metrics and sinks add to this.

    python benchmarks/bench_dispatch.py [--calls 500] [--rounds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import concurrent.futures as cf
import json
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def negate(x: int) -> int:
    return -x


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda p: ordered[min(len(ordered) - 1, int(p * len(ordered)))]  # noqa: E731
    return {"p50_us": pick(0.50) * 1e6, "p99_us": pick(0.99) * 1e6, "mean_us": statistics.fmean(ordered) * 1e6,
            "max_us": ordered[-1] * 1e6, "n": len(ordered)}


async def measure(calls: int, rounds: int, config: dict[str, Any]) -> dict[str, Any]:
    import anyio
    import anyio.to_process

    import aiocompile

    loop = asyncio.get_running_loop()
    sched = aiocompile.Scheduler(workers=1, config=aiocompile.SchedulerConfig(**config) if config else None)
    stdlib = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"))
    limiter = anyio.CapacityLimiter(1)
    ways = {
        "aiocompile": lambda: sched.run(abs, -1),
        "ProcessPoolExecutor": lambda: loop.run_in_executor(stdlib, abs, -1),
        "anyio to_process": lambda: anyio.to_process.run_sync(abs, -1, limiter=limiter),
        "aiocompile __main__": lambda: sched.run(negate, -1),
        "anyio __main__": lambda: anyio.to_process.run_sync(negate, -1, limiter=limiter),
    }
    samples: dict[str, list[float]] = {name: [] for name in ways}
    rounds_p50: list[dict[str, float]] = []
    try:
        for call in ways.values():  # start every worker, warm every code path
            for _ in range(200):
                assert await call() == 1
        for round_ in range(rounds):
            names = list(ways)
            names = names[round_ % len(names):] + names[:round_ % len(names)]
            if round_ % 2:
                # Each way follows another in turn: a way's predecessor (what the machine
                # was doing the moment before) is not always the same one.
                names.reverse()
            this_round: dict[str, float] = {}
            for name in names:
                call = ways[name]
                taken = []
                for _ in range(calls):
                    started = time.perf_counter()
                    await call()
                    taken.append(time.perf_counter() - started)
                samples[name].extend(taken)
                this_round[name] = statistics.median(taken) * 1e6
            rounds_p50.append(this_round)
    finally:
        await sched.aclose()
        stdlib.shutdown()
    results = {name: summary(values) for name, values in samples.items()}
    fastest = min(row["p50_us"] for row in results.values())
    for row in results.values():
        row["p50_vs_fastest"] = row["p50_us"] / fastest
        row["p50_vs_aiocompile"] = row["p50_us"] / results["aiocompile"]["p50_us"]
    return {"cpus": os.cpu_count(), "calls_per_way": calls * rounds, "results": results, "rounds_p50_us": rounds_p50,
            "python": sys.version.split()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500, help="calls per way and round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--config", default="", metavar="NAME=VALUE,...",
                        help="aiocompile's SchedulerConfig fields, e.g. worker_nice=0,metrics=False")
    args = parser.parse_args()
    config = {}
    for item in filter(None, args.config.split(",")):
        name, _, value = item.partition("=")
        config[name.strip()] = ast.literal_eval(value.strip())
    report = asyncio.run(measure(args.calls, args.rounds, config))
    print(f"round trip of a trivial job, {report['calls_per_way']} calls each, one worker, {report['cpus']} CPUs, "
          f"Python {report['python']}")
    print(f"{'':22}{'p50 µs':>9}{'p99 µs':>9}{'mean µs':>9}{'p50 / fastest':>15}{'p50 / aiocompile':>18}")
    for name, row in report["results"].items():
        print(f"{name:22}{row['p50_us']:9.1f}{row['p99_us']:9.1f}{row['mean_us']:9.1f}{row['p50_vs_fastest']:15.2f}"
              f"{row['p50_vs_aiocompile']:18.2f}")
    for mine, theirs in (("aiocompile", "anyio to_process"), ("aiocompile __main__", "anyio __main__")):
        print(f"p50 µs by round, {mine} / {theirs}:", "  ".join(
            f"{row[mine]:.1f}/{row[theirs]:.1f}={row[mine] / row[theirs]:.2f}x" for row in report["rounds_p50_us"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
