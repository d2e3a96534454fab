"""Crash recovery: one worker dies while innocent jobs run beside it.

The same fault for both contenders, in one run: a warm pool of N workers gets 2N innocent
jobs (each sleeps) and one poison job that kills its worker with ``os._exit`` every time it
runs. The poison is sent after N-1 innocents, so that it runs while every other worker is
busy: the next job can only start on a new worker. Measured:

- death -> work again: from the worker's death to the first job starting on a new worker
  (aiocompile: the replacement it starts at once; stdlib ``ProcessPoolExecutor``: the
  executor is broken for good, so the caller catches ``BrokenProcessPool``, builds a new
  executor and resubmits what failed, the usual recovery);
- innocent jobs re-run (started twice) and innocent jobs failed;
- wall time until every innocent job is done.

    python benchmarks/bench_crash.py [--workers 4] [--seconds 1.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures as cf
import json
import multiprocessing
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _crash_jobs as crash_jobs  # noqa: E402


def _read_events(path: str) -> list[tuple[str, str, float, int]]:
    events = []
    with open(path) as f:
        for line in f:
            kind, name, stamp, pid = line.split()
            events.append((kind, name, float(stamp), int(pid)))
    return events


def _summarise(log: str, wall: float, results: dict[str, object], innocents: int) -> dict[str, float]:
    events = _read_events(log)
    first_death = min(stamp for kind, _, stamp, _ in events if kind == "death")
    # A job starting on a process that was not there before the death: the new worker.
    old = {pid for _, _, stamp, pid in events if stamp <= first_death} | set(crash_jobs.POOL_PIDS)
    after = [stamp for kind, _, stamp, pid in events if kind == "start" and stamp > first_death and pid not in old]
    starts = collections.Counter(name for kind, name, _, _ in events if kind == "start" and name != "poison")
    return {
        "death_to_work_again_ms": (min(after) - first_death) * 1000 if after else float("nan"),
        "innocent_reruns": sum(count - 1 for count in starts.values()),
        "innocent_failures": sum(1 for name, value in results.items() if name != "poison"
                                 and isinstance(value, BaseException)),
        "innocents": innocents,
        "wall_s": wall,
        "poison": type(results["poison"]).__name__,
    }


async def run_aiocompile(workers: int, seconds: float, log: str) -> dict[str, float]:
    import aiocompile

    config = aiocompile.SchedulerConfig(workers=workers, preload=(), max_crashes=2)
    async with aiocompile.Scheduler(config=config) as sched:
        # All workers up (one warm-up job each), so that no worker starts for the queue later.
        warmed = sched.port.warm_workers(crash_jobs.noop)
        pids = await asyncio.gather(*[asyncio.wrap_future(future) for future in warmed])
        crash_jobs.POOL_PIDS[:] = pids
        names = [f"job{i}" for i in range(2 * workers)]
        started = time.perf_counter()
        calls = {name: sched.run(crash_jobs.innocent, name, seconds, log) for name in names[:workers - 1]}
        calls["poison"] = sched.run(crash_jobs.poison, log)
        calls.update({name: sched.run(crash_jobs.innocent, name, seconds, log) for name in names[workers - 1:]})
        outcomes = await asyncio.gather(*calls.values(), return_exceptions=True)
        wall = time.perf_counter() - started
    return _summarise(log, wall, dict(zip(calls, outcomes)), len(names))


async def run_stdlib(workers: int, seconds: float, log: str) -> dict[str, float]:
    context = multiprocessing.get_context("forkserver")
    loop = asyncio.get_running_loop()
    executor = cf.ProcessPoolExecutor(workers, mp_context=context)
    crash_jobs.POOL_PIDS[:] = await asyncio.gather(*[loop.run_in_executor(executor, crash_jobs.noop)
                                                     for _ in range(workers)])
    names = [f"job{i}" for i in range(2 * workers)]
    todo = [(name, crash_jobs.innocent, (name, seconds, log)) for name in names[:workers - 1]]
    todo.append(("poison", crash_jobs.poison, (log,)))
    todo += [(name, crash_jobs.innocent, (name, seconds, log)) for name in names[workers - 1:]]
    results: dict[str, object] = {}
    crashes: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    while todo:
        futures = [loop.run_in_executor(executor, fn, *args) for _, fn, args in todo]
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        retry = []
        for (name, fn, args), outcome in zip(todo, outcomes):
            if isinstance(outcome, cf.process.BrokenProcessPool):
                crashes[name] += 1
                if crashes[name] < 2:  # the same crash budget as aiocompile's
                    retry.append((name, fn, args))
                    continue
            results[name] = outcome
        if retry:
            executor.shutdown(wait=False, cancel_futures=True)
            executor = cf.ProcessPoolExecutor(workers, mp_context=context)
        todo = retry
    wall = time.perf_counter() - started
    executor.shutdown()
    return _summarise(log, wall, results, len(names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=1.0, help="how long each innocent job runs")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, runner in (("aiocompile", run_aiocompile), ("ProcessPoolExecutor", run_stdlib)):
            log = os.path.join(tmp, f"{name}.log")
            open(log, "w").close()
            rows[name] = asyncio.run(runner(args.workers, args.seconds, log))
    ours, theirs = rows["aiocompile"], rows["ProcessPoolExecutor"]
    print(f"one poison job among {2 * args.workers} innocent {args.seconds:g} s jobs, {args.workers} workers, "
          f"{os.cpu_count()} CPUs")
    print(f"{'':22} {'death->work again':>18} {'innocents re-run':>17} {'innocents failed':>17} {'wall':>8}")
    for name, row in rows.items():
        print(f"{name:22} {row['death_to_work_again_ms']:15.1f} ms {row['innocent_reruns']:17d} "
              f"{row['innocent_failures']:17d} {row['wall_s']:6.2f} s")
    print(f"ratio (aiocompile / stdlib): death->work again "
          f"{ours['death_to_work_again_ms'] / theirs['death_to_work_again_ms']:.2f}")
    if theirs["innocent_failures"]:
        print("(the stdlib's wall time is short because innocent jobs failed instead of completing)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "workers": args.workers, "seconds": args.seconds, "results": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()
