"""Cold start and worker memory: aiocompile's pool beside the stdlib's and anyio's.

Each pool in a fresh interpreter (with an empty Triton cache), W workers, the same steps:

- import: the pool's library (``import aiocompile`` and its scheduler; ``concurrent.futures``
  and ``multiprocessing``; ``anyio.to_process``); then the kernels (Triton), the same for all;
- pool ready: from creating the pool until each of its W workers has run one tiny compile
  (aiocompile: ``await sched.warm(target)``; the others: warm-up jobs until W distinct
  workers have run one);
- first compile: one matmul, on the ready pool;
- then 15 more kernels (matmuls and row-wise kernels) across the pool, after which the
  memory of each pool process is read from ``/proc``: VmRSS (``status``), and PSS and USS
  (``smaps_rollup``; PSS shares each page among the processes that map it, so forked
  workers are not charged for what they share with their fork server).

aiocompile's workers are forked from its fork server, which is counted with the pool; so
is the stdlib's forkserver process; anyio starts each worker as a fresh interpreter.

    python benchmarks/bench_memory.py [--workers N] [--repeat 3] [--target cuda:90] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WAYS = ("aiocompile", "ProcessPoolExecutor", "anyio to_process")
SET = "heavy"  # the first 16 of _kernel_set's matmul-heavy set: 8 matmuls and 8 row-wise kernels


def memory_of(pid: int) -> dict[str, float]:
    """RSS, PSS and USS of one process in MiB (PSS and USS absent where unreadable)."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_mib"] = int(line.split()[1]) / 1024
            elif line.startswith("PPid:"):
                out["ppid"] = int(line.split()[1])
    try:
        fields: dict[str, int] = {}
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    fields[parts[0].rstrip(":")] = int(parts[1])
        out["pss_mib"] = fields["Pss"] / 1024
        out["uss_mib"] = (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024
    except (OSError, KeyError):
        pass
    return out


def pool_memory(worker_pids: list[int]) -> dict[str, Any]:
    """The workers' memory, and their common parent's when it is not this process (a fork
    server)."""
    workers = [memory_of(pid) for pid in worker_pids]
    parents = {int(w["ppid"]) for w in workers} - {os.getpid()}
    servers = [memory_of(pid) for pid in parents]
    everything = workers + servers

    def total(field: str) -> float | None:
        values = [m.get(field) for m in everything]
        return None if None in values else sum(values)  # type: ignore[arg-type]

    return {
        "workers": len(workers),
        "worker_rss_mib": statistics.median(w["rss_mib"] for w in workers),
        "worker_rss_max_mib": max(w["rss_mib"] for w in workers),
        "worker_pss_mib": statistics.median(w["pss_mib"] for w in workers) if "pss_mib" in workers[0] else None,
        "worker_uss_mib": statistics.median(w["uss_mib"] for w in workers) if "uss_mib" in workers[0] else None,
        "server_rss_mib": sum(s["rss_mib"] for s in servers) if servers else 0.0,
        "pool_rss_mib": total("rss_mib"),
        "pool_pss_mib": total("pss_mib"),
        "parent_rss_mib": memory_of(os.getpid())["rss_mib"],
    }


# -- one pool, in a fresh interpreter -------------------------------------------------------

async def child_aiocompile(workers: int, target: str, specs: list[dict], marks: dict[str, Any]) -> None:
    import aiocompile

    async with aiocompile.Scheduler(workers=workers) as sched:
        await sched.warm(target)
        marks["pool_ready"] = time.perf_counter()
        await sched.compile_triton(**{k: v for k, v in specs[0].items() if k != "label"})
        marks["first_compile"] = time.perf_counter()
        await sched.compile_many(specs[1:])
        marks["more"] = time.perf_counter()
        marks["memory"] = pool_memory(sched.worker_pids())


async def _warm_distinct(start_one: Any, workers: int) -> set[int]:
    """Warm-up jobs, ``workers`` at a time, until ``workers`` distinct processes ran one."""
    import asyncio

    pids: set[int] = set()
    for _ in range(10):
        pids |= set(await asyncio.gather(*(start_one() for _ in range(workers))))
        if len(pids) >= workers:
            break
    return pids


async def child_stdlib(workers: int, target: str, specs: list[dict], marks: dict[str, Any]) -> None:
    import asyncio
    import concurrent.futures as cf
    import multiprocessing

    import _kernel_set as kernel_set

    loop = asyncio.get_running_loop()
    cache_dir = os.environ["TRITON_CACHE_DIR"]
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver")) as pool:
        pids = await _warm_distinct(lambda: loop.run_in_executor(pool, kernel_set.warm_worker, target, 0.0), workers)
        marks["pool_ready"] = time.perf_counter()
        await loop.run_in_executor(pool, kernel_set.compile_in_worker, 0, target, cache_dir, SET)
        marks["first_compile"] = time.perf_counter()
        done = await asyncio.gather(*(loop.run_in_executor(pool, kernel_set.compile_in_worker, i, target,
                                                                     cache_dir, SET)
                                      for i in range(1, len(specs))))
        marks["more"] = time.perf_counter()
        marks["memory"] = pool_memory(sorted(pids | {pid for pid, _ in done}))


async def child_anyio(workers: int, target: str, specs: list[dict], marks: dict[str, Any]) -> None:
    import asyncio

    import _kernel_set as kernel_set
    import anyio
    import anyio.to_process

    limiter = anyio.CapacityLimiter(workers)
    cache_dir = os.environ["TRITON_CACHE_DIR"]

    def call(fn: Any, *args: Any) -> Any:
        return anyio.to_process.run_sync(fn, *args, limiter=limiter)

    pids = await _warm_distinct(lambda: call(kernel_set.warm_worker, target, 0.0), workers)
    marks["pool_ready"] = time.perf_counter()
    await call(kernel_set.compile_in_worker, 0, target, cache_dir, SET)
    marks["first_compile"] = time.perf_counter()
    done = await asyncio.gather(*(call(kernel_set.compile_in_worker, i, target, cache_dir, SET)
                                  for i in range(1, len(specs))))
    marks["more"] = time.perf_counter()
    marks["memory"] = pool_memory(sorted(pids | {pid for pid, _ in done}))


def child(way: str, workers: int, target: str) -> None:
    marks: dict[str, Any] = {"start": time.perf_counter()}
    if way == "aiocompile":
        import aiocompile

        aiocompile.Scheduler  # noqa: B018  (the public names load on first use)
        run = child_aiocompile
    elif way == "ProcessPoolExecutor":
        import concurrent.futures  # noqa: F401
        import multiprocessing  # noqa: F401

        run = child_stdlib
    else:
        import anyio.to_process  # noqa: F401

        run = child_anyio
    marks["imported"] = time.perf_counter()
    sys.path[:0] = [HERE, ROOT]
    import _kernel_set as kernel_set

    specs = kernel_set.specs(target, SET)[:16]
    marks["kernels_imported"] = time.perf_counter()
    import asyncio

    marks["pool_start"] = time.perf_counter()
    asyncio.run(run(workers, target, specs, marks))
    result = {
        "import_s": marks["imported"] - marks["start"],
        "import_kernels_s": marks["kernels_imported"] - marks["imported"],
        "pool_ready_s": marks["pool_ready"] - marks["pool_start"],
        "first_compile_s": marks["first_compile"] - marks["pool_ready"],
        "next_15_s": marks["more"] - marks["first_compile"],
        **marks["memory"],
    }
    print(json.dumps(result), flush=True)


# -- the benchmark ----------------------------------------------------------------------------

def measure(way: str, workers: int, target: str, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "TRITON_DEFAULT_FP_FUSION": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH", "")]))}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", way, "--workers", str(workers),
                               "--target", target], capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{way} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--target", default="cuda:90")
    parser.add_argument("--repeat", type=int, default=3, help="fresh interpreters per pool (medians are reported)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per interpreter")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.workers, args.target)
        return
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    for round_ in range(args.repeat):
        for way in WAYS[round_ % len(WAYS):] + WAYS[:round_ % len(WAYS)]:
            runs[way].append(measure(way, args.workers, args.target, args.timeout))
    results = {}
    for way, rows in runs.items():
        results[way] = {key: statistics.median(r[key] for r in rows) if all(r[key] is not None for r in rows)
                        else None for key in rows[0]}
    base = results["aiocompile"]
    print(f"cold start and memory, {args.workers} workers, {os.cpu_count()} CPUs, median of {args.repeat} "
          f"fresh interpreters")
    print(f"{'':20}{'import s':>9}{'+kernels':>9}{'pool ready s':>13}{'1st compile s':>14}{'next 15 s':>10}"
          f"{'worker RSS':>11}{'PSS':>7}{'USS':>7}{'pool PSS MiB':>13}")
    for way, row in results.items():
        def mib(value: float | None) -> str:
            return "-" if value is None else f"{value:.0f}"

        print(f"{way:20}{row['import_s']:9.3f}{row['import_kernels_s']:9.3f}{row['pool_ready_s']:13.3f}"
              f"{row['first_compile_s']:14.3f}{row['next_15_s']:10.3f}{mib(row['worker_rss_mib']):>11}"
              f"{mib(row['worker_pss_mib']):>7}{mib(row['worker_uss_mib']):>7}{mib(row['pool_pss_mib']):>13}")
    print("(memory in MiB, per worker (median) after compiling; pool PSS: workers and fork server together)")
    for way, row in results.items():
        if way != "aiocompile" and row["pool_pss_mib"] and base["pool_pss_mib"]:
            print(f"{way}: pool ready {row['pool_ready_s'] / base['pool_ready_s']:.2f}x aiocompile's, "
                  f"pool PSS {row['pool_pss_mib'] / base['pool_pss_mib']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "workers": args.workers, "target": args.target,
                       "repeat": args.repeat, "results": results, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
