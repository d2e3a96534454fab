"""Compile throughput and event-loop lag: 64 distinct kernels, five ways, in one run.

The kernels (``benchmarks/_kernel_set.py``: the example kernels in 64 tile, dtype, block
and ``num_warps`` configurations) are one of two sets:

- ``mixed`` (the default): 10 matmuls, one of them long, among 54 short row-wise kernels,
  in a shuffled order. The compiles add up to about 7x the longest, so on 16 workers
  the longest compile is the lower bound, as in a batch of a server's new shapes;
- ``heavy``: 28 matmuls interleaved with 36 row-wise kernels, adding up to about 12x the
  longest, so that every worker is busy for most of the batch and compiles running side
  by side slow each other down.

They are compiled for one explicit target, each way with a fresh ``TRITON_CACHE_DIR`` so
that every way really compiles every kernel:

- ``aiocompile``: ``Scheduler(workers=W)``, warmed with ``await sched.warm(target)``
  before the clock, then ``await sched.compile_many(specs)``. Its compile times go to a
  cost history (``cost_history``) kept for the whole run, so from the second round on it
  starts the longest compiles first, as a server or build that ran before would; the
  first round, which knows nothing, is reported as well;
- ``serial triton.compile``: one kernel after another in this (warm) process, from the
  coroutine, as code that does not hand compiles off would do; this also gives each
  kernel's single compile time;
- ``AsyncCompileMode``: Triton's own, with a ``ThreadPoolExecutor(W)``; each kernel is
  submitted from the coroutine as ``JITFunction`` does it (Triton's cache key computed
  in the calling thread, ``triton.compile`` in a pool thread), and the coroutine awaits
  the pool's futures;
- ``ProcessPoolExecutor``: the stdlib pool (forkserver), every worker warmed with one
  tiny compile before the clock, driven through ``loop.run_in_executor``;
- ``anyio to_process``: ``anyio.to_process.run_sync`` with a limiter of W, every worker
  warmed the same way.

Each way runs in an event loop of its own, in which a ticker wakes every 1 ms and notes
how late it woke. The benchmark process compiles one tiny kernel first, so that no way
pays Triton's one-time set-up in this process. Reported for each way: wall time (median
of ``--repeat``), its ratio to aiocompile, parallel efficiency = (sum of single compile
times / W) / wall, the lower bound max(sum / W, longest single compile), and the loop's
lateness (p50, p99, max over every tick of every repeat).

    python benchmarks/bench_throughput.py [--set mixed|heavy] [--workers N] [--target cuda:90] [--repeat 3]
                                          [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import inspect
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (HERE, ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import _kernel_set as kernel_set  # noqa: E402
from bench_loop_lag import Ticker  # noqa: E402

WAYS = ("aiocompile", "serial triton.compile", "AsyncCompileMode", "ProcessPoolExecutor", "anyio to_process")
BASELINE = "aiocompile"


class Unavailable(Exception):
    """This way of compiling does not exist in the installed versions."""


async def _timed(ticker: Ticker, work: Any) -> tuple[float, Any]:
    """Run ``await work()`` on the clock, with the ticker running around it."""
    tick = asyncio.create_task(ticker.run())
    await asyncio.sleep(0.05)  # the ticker's first ticks, before any work
    started = time.perf_counter()
    result = await work()
    wall = time.perf_counter() - started
    ticker._stop = True
    await tick
    return wall, result


# The cost history aiocompile's rounds share, and the kernel set (set by measure()).
COST_HISTORY: str | None = None
KIND = "mixed"


def _known_costs() -> int:
    if COST_HISTORY is None or not os.path.exists(COST_HISTORY):
        return 0
    with open(COST_HISTORY) as f:
        return len(json.load(f).get("costs", {}))


async def run_aiocompile(specs: list[dict], workers: int, target: str, cache_dir: str, ticker: Ticker) -> dict:
    import aiocompile

    known = _known_costs()
    config = aiocompile.SchedulerConfig(cost_history=COST_HISTORY)
    async with aiocompile.Scheduler(workers=workers, config=config) as sched:
        await sched.warm(target)
        os.environ["TRITON_CACHE_DIR"] = cache_dir  # each job carries the parent's TRITON_* environment
        wall, kernels = await _timed(ticker, lambda: sched.compile_many(specs))
        assert len(kernels) == len(specs)
        records = [r for r in sched.records() if r.backend == "triton"]
    assert len(records) == len(specs) and not any(r.compiler_cache_hit for r in records), records
    return {"wall_s": wall, "compile_s_in_workers": sum(r.run_time or 0.0 for r in records),
            "processes": len({r.worker_pid for r in records}), "costs_known": known}


async def run_serial(specs: list[dict], workers: int, target: str, cache_dir: str, ticker: Ticker) -> dict:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    single: dict[str, float] = {}

    async def work() -> None:
        for spec in specs:
            single[spec["label"]] = kernel_set.compile_spec(spec)
            await asyncio.sleep(0)  # a coroutine that compiles between awaits

    wall, _ = await _timed(ticker, work)
    return {"wall_s": wall, "compile_s_in_workers": sum(single.values()), "single_s": single, "processes": 1}


def _async_compile_mode() -> Any:
    """Triton's AsyncCompileMode, wherever the installed version keeps it."""
    import triton

    mode = getattr(triton, "AsyncCompileMode", None)
    if mode is None:
        try:
            from triton.runtime._async_compile import AsyncCompileMode as mode
        except ImportError as exc:
            raise Unavailable(f"triton {triton.__version__} has no AsyncCompileMode") from exc
    return mode


def _jit_style_submitter() -> Any:
    """A function that submits one spec to an AsyncCompileMode the way ``JITFunction`` does:
    Triton's cache key computed by the caller, ``triton.compile`` in the executor."""
    import triton

    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.compiler.compiler import make_backend
        from triton.runtime.cache import get_cache_key
    except ImportError:  # a Triton that moved these: key by label (every kernel is distinct anyway)
        get_cache_key = None

    def submit(mode: Any, spec: dict, seconds: list[float]) -> None:
        src, target, options = kernel_set.triton_args(spec)
        if get_cache_key is not None:
            backend = make_backend(target)
            parsed = backend.parse_options(options)
            env_vars = get_cache_invalidating_env_vars()
            key = get_cache_key(src, backend, parsed, env_vars)
            options = parsed.__dict__
        else:
            key = spec["label"]

        def compile_fn() -> Any:
            started = time.perf_counter()
            compiled = triton.compile(src, target=target, options=options)
            seconds.append(time.perf_counter() - started)
            return compiled

        def finalize_fn(kernel: Any) -> None:
            pass  # the JIT puts the kernel in its per-device cache here

        def cleanup_fn(future_kernel: Any) -> None:
            pass

        # Triton 3.9 added a cleanup callback; 3.6 takes three arguments.
        if len(inspect.signature(mode.submit).parameters) >= 4:
            mode.submit(key, compile_fn, finalize_fn, cleanup_fn)
        else:
            mode.submit(key, compile_fn, finalize_fn)

    return submit


async def run_async_compile_mode(specs: list[dict], workers: int, target: str, cache_dir: str,
                                 ticker: Ticker) -> dict:
    mode_cls = _async_compile_mode()
    submit = _jit_style_submitter()
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    seconds: list[float] = []
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="bench-async-compile") as executor:
        async def work() -> None:
            with mode_cls(executor) as mode:
                for spec in specs:
                    submit(mode, spec, seconds)
                    await asyncio.sleep(0)
                await asyncio.gather(*(asyncio.wrap_future(f) for f in mode.raw_futures))
            # Leaving the block finalises every kernel (their futures are done by now).

        wall, _ = await _timed(ticker, work)
    assert len(seconds) == len(specs)
    return {"wall_s": wall, "compile_s_in_workers": sum(seconds), "processes": 1}


async def _warm_distinct(start_one: Any, workers: int) -> set[int]:
    """Warm-up jobs, ``workers`` at a time, until ``workers`` distinct processes ran one."""
    pids: set[int] = set()
    for _ in range(5):
        pids |= set(await asyncio.gather(*(start_one() for _ in range(workers))))
        if len(pids) >= workers:
            break
    return pids


async def run_stdlib(specs: list[dict], workers: int, target: str, cache_dir: str, ticker: Ticker) -> dict:
    loop = asyncio.get_running_loop()
    context = multiprocessing.get_context("forkserver")
    with cf.ProcessPoolExecutor(workers, mp_context=context) as pool:
        pids = await _warm_distinct(lambda: loop.run_in_executor(pool, kernel_set.warm_worker, target, 0.3), workers)

        async def work() -> list[tuple[int, float]]:
            return await asyncio.gather(*(loop.run_in_executor(pool, kernel_set.compile_in_worker, i, target,
                                                               cache_dir, KIND) for i in range(len(specs))))

        wall, done = await _timed(ticker, work)
    return {"wall_s": wall, "compile_s_in_workers": sum(s for _, s in done), "processes": len({p for p, _ in done}),
            "warmed_processes": len(pids)}


async def run_anyio(specs: list[dict], workers: int, target: str, cache_dir: str, ticker: Ticker) -> dict:
    import anyio
    import anyio.to_process

    limiter = anyio.CapacityLimiter(workers)

    def call(fn: Any, *args: Any) -> Any:
        return anyio.to_process.run_sync(fn, *args, limiter=limiter)

    pids = await _warm_distinct(lambda: call(kernel_set.warm_worker, target, 0.3), workers)

    async def work() -> list[tuple[int, float]]:
        return await asyncio.gather(*(call(kernel_set.compile_in_worker, i, target, cache_dir, KIND)
                                      for i in range(len(specs))))

    wall, done = await _timed(ticker, work)
    # The workers end with this event loop.
    return {"wall_s": wall, "compile_s_in_workers": sum(s for _, s in done), "processes": len({p for p, _ in done}),
            "warmed_processes": len(pids)}


RUNNERS = {
    "aiocompile": run_aiocompile,
    "serial triton.compile": run_serial,
    "AsyncCompileMode": run_async_compile_mode,
    "ProcessPoolExecutor": run_stdlib,
    "anyio to_process": run_anyio,
}


def pick(ordered: list[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def measure(ways: list[str], workers: int, target: str, repeat: int, kernels: int = 64, kind: str = "mixed") -> dict:
    global COST_HISTORY, KIND
    KIND = kind
    specs = kernel_set.specs(target, kind)[:kernels]
    history_dir = tempfile.mkdtemp(prefix="bench-throughput-costs-")
    COST_HISTORY = os.path.join(history_dir, "costs.json")
    kernel_set.warm_up(target)  # this process's own one-time set-up, before any way
    walls: dict[str, list[float]] = {way: [] for way in ways}
    lags: dict[str, list[float]] = {way: [] for way in ways}
    extra: dict[str, list[dict]] = {way: [] for way in ways}
    unavailable: dict[str, str] = {}
    failed: dict[str, str] = {}  # a way that raised: reported, and left out of later rounds
    single: dict[str, list[float]] = {spec["label"]: [] for spec in specs}
    saved = os.environ.get("TRITON_CACHE_DIR")
    for round_ in range(repeat):
        # Rotate the order each round, so that drift of the machine hits every way alike.
        order = ways[round_ % len(ways):] + ways[:round_ % len(ways)]
        for way in order:
            if way in unavailable or way in failed:
                continue
            cache_dir = tempfile.mkdtemp(prefix="bench-throughput-")
            ticker = Ticker()
            try:
                row = asyncio.run(RUNNERS[way](specs, workers, target, cache_dir, ticker))
            except Unavailable as exc:
                unavailable[way] = str(exc)
                print(f"{way}: unavailable ({exc})", flush=True)
                continue
            except Exception as exc:
                failed[way] = f"{type(exc).__name__}: {exc}"
                print(f"{way}: FAILED ({failed[way]})", flush=True)
                traceback.print_exc()
                continue
            finally:
                if saved is None:
                    os.environ.pop("TRITON_CACHE_DIR", None)
                else:
                    os.environ["TRITON_CACHE_DIR"] = saved
                shutil.rmtree(cache_dir, ignore_errors=True)
            walls[way].append(row.pop("wall_s"))
            lags[way] += ticker.lags
            for label, seconds in row.pop("single_s", {}).items():
                single[label].append(seconds)
            extra[way].append(row)
            print(f"round {round_ + 1} {way:24} {walls[way][-1]:7.2f} s  loop late max "
                  f"{max(ticker.lags) * 1000:8.1f} ms", flush=True)

    report: dict[str, Any] = {"cpus": os.cpu_count(), "workers": workers, "target": target, "repeat": repeat,
                              "set": kind, "kernels": len(specs), "ways": {}}
    if all(single.values()):
        medians = {label: statistics.median(v) for label, v in single.items()}
        total = sum(medians.values())
        longest = max(medians, key=lambda label: medians[label])
        report["single"] = {"sum_s": total, "longest_s": medians[longest], "longest_label": longest,
                            "per_kernel_s": medians}
        report["lower_bound_s"] = max(total / workers, medians[longest])
    for way in ways:
        if way in unavailable:
            report["ways"][way] = {"available": False, "reason": unavailable[way]}
            continue
        if way in failed:
            report["ways"][way] = {"available": True, "error": failed[way]}
            continue
        ordered = sorted(lags[way])
        row = {"available": True, "wall_s": statistics.median(walls[way]), "walls_s": walls[way],
               "compile_s_in_workers": statistics.median(e["compile_s_in_workers"] for e in extra[way]),
               "processes": max(e["processes"] for e in extra[way]),
               "lag": {"ticks": len(ordered), "p50_ms": pick(ordered, 0.5) * 1000,
                       "p99_ms": pick(ordered, 0.99) * 1000, "max_ms": ordered[-1] * 1000,
                       "over_10ms": sum(1 for lag in ordered if lag > 0.010)}}
        if "single" in report:
            row["efficiency"] = report["single"]["sum_s"] / workers / row["wall_s"]
            row["wall_over_bound"] = row["wall_s"] / report["lower_bound_s"]
        known = [(e.get("costs_known", 0), wall) for e, wall in zip(extra[way], walls[way])]
        if way == BASELINE and known:
            cold = [wall for n, wall in known if n == 0]
            warm = [wall for n, wall in known if n > 0]
            row["nothing_known_s"] = statistics.median(cold) if cold else None
            row["costs_known_s"] = statistics.median(warm) if warm else None
            if warm and "lower_bound_s" in report:
                row["costs_known_over_bound"] = row["costs_known_s"] / report["lower_bound_s"]
        report["ways"][way] = row
    base = report["ways"].get(BASELINE, {}).get("wall_s")
    for row in report["ways"].values():
        if base and "wall_s" in row:
            row["ratio_to_aiocompile"] = row["wall_s"] / base
    return report


def print_report(report: dict) -> None:
    print(f"\n{report['kernels']} distinct kernels ({report['set']} set) for {report['target']}, "
          f"{report['workers']} workers, "
          f"{report['cpus']} CPUs, median of {report['repeat']}")
    if "single" in report:
        single = report["single"]
        print(f"single compiles (serial, warm process): sum {single['sum_s']:.2f} s, longest "
              f"{single['longest_s']:.2f} s ({single['longest_label']}); lower bound "
              f"max(sum/W, longest) = {report['lower_bound_s']:.2f} s")
    print(f"{'':24}{'wall s':>8}{'ratio':>7}{'effic.':>8}{'/bound':>8}{'compile s':>10}"
          f"{'lag p50 ms':>11}{'p99 ms':>9}{'max ms':>9}{'>10ms':>7}")
    for way, row in report["ways"].items():
        if not row["available"]:
            print(f"{way:24} unavailable: {row['reason']}")
            continue
        if "error" in row:
            print(f"{way:24} FAILED: {row['error']}")
            continue
        lag = row["lag"]
        print(f"{way:24}{row['wall_s']:8.2f}{row.get('ratio_to_aiocompile', float('nan')):7.2f}"
              f"{row.get('efficiency', float('nan')):8.2f}{row.get('wall_over_bound', float('nan')):8.2f}"
              f"{row['compile_s_in_workers']:10.2f}{lag['p50_ms']:11.2f}{lag['p99_ms']:9.2f}{lag['max_ms']:9.1f}"
              f"{lag['over_10ms']:7d}")
    print("(ratio: wall / aiocompile's; effic.: (sum of single compiles / W) / wall; /bound: wall / lower bound;"
          " compile s: the compiles' own times summed, as measured where they ran)")
    base = report["ways"].get(BASELINE, {})
    if base.get("nothing_known_s") is not None or base.get("costs_known_s") is not None:
        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f} s"
        print(f"aiocompile, first round (no compile times known): {fmt(base.get('nothing_known_s'))}; "
              f"later rounds (longest first, from the first round's times): {fmt(base.get('costs_known_s'))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="kind", default="mixed", choices=sorted(kernel_set.SETS),
                        help="the kernel set (default: mixed)")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--target", default="cuda:90")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS), help="a comma-separated subset of: " + ", ".join(WAYS))
    parser.add_argument("--kernels", type=int, default=64, help="compile only the first N (a smoke test)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    ways = [w for w in args.ways.split(",") if w]
    for way in ways:
        if way not in RUNNERS:
            parser.error(f"unknown way {way!r}")
    if "serial triton.compile" not in ways:
        print("(without the serial way there are no single compile times: no efficiency or bound)")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    report = measure(ways, args.workers, args.target, args.repeat, args.kernels, args.kind)
    import triton

    report["triton"] = triton.__version__
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if any("error" in row for row in report["ways"].values()):
        sys.exit(1)  # the others' results are written all the same


if __name__ == "__main__":
    main()
