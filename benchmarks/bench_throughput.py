"""Compile throughput and event-loop lag: distinct kernels, five ways, in one run.

The kernels (``benchmarks/_kernel_set.py``: the example kernels in many tile, dtype, block
and ``num_warps`` configurations) are one of three sets:

- ``adds_matmuls``: 32 vector adds and 18 matmuls of several tile sizes, the longest
  compile (a 128x256 matmul) 34th in the order given. With ``--first-run`` every aiocompile
  round starts with no compile history at all, as a first run on a fresh machine does: the
  order comes from the predicted costs alone, whose rank correlation with the measured
  times is reported;

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

``aiocompile[workers=8,nice=0,pin]`` is aiocompile with other pool settings (fewer
workers, workers as nice as the parent, each worker pinned to a CPU of its own), for the
contention figures. ``--alone N`` times, after each round, the round's N longest compiles
alone (each in a warm worker process of its own, nothing else running): the longest of
them is the round's lower bound, and their time in the batch over their time alone is how
much the compiles beside them slowed them down.

Each way runs in an event loop of its own, in which a ticker wakes every 1 ms and notes
how late it woke. The benchmark process compiles one tiny kernel first, so that no way
pays Triton's one-time set-up in this process. Reported for each way: wall time (median
of ``--repeat``), its ratio to aiocompile, parallel efficiency = (sum of single compile
times / W) / wall, the lower bound max(sum / W, longest single compile), and the loop's
lateness (p50, p99, max over every tick of every repeat).

    python benchmarks/bench_throughput.py [--set mixed|heavy|adds_matmuls] [--workers N] [--target cuda:90]
                                          [--repeat 3] [--first-run] [--alone N] [--ways a,b] [--json out.json]
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


# The cost history aiocompile's rounds share, the kernel set, and whether each aiocompile
# round starts with no history at all (set by measure()).
COST_HISTORY: str | None = None
KIND = "mixed"
FIRST_RUN = False


def _known_costs(path: str | None) -> int:
    if path is None or not os.path.exists(path):
        return 0
    with open(path) as f:
        return len(json.load(f).get("costs", {}))


def parse_way(way: str) -> tuple[str, dict[str, Any]]:
    """``"aiocompile[workers=8,nice=0,pin]"`` -> ``("aiocompile", {"workers": 8, "nice": 0,
    "pin": True})``: aiocompile with other pool settings, for the contention figures."""
    if "[" not in way:
        return way, {}
    base, _, rest = way.partition("[")
    options: dict[str, Any] = {}
    for part in rest.rstrip("]").split(","):
        name, eq, value = part.strip().partition("=")
        if not name:
            continue
        if name not in ("workers", "nice", "pin"):
            raise ValueError(f"unknown pool setting {name!r} in {way!r} (workers=N, nice=N, pin)")
        options[name] = int(value) if eq else True
    return base, options


def _pin(pids: list[int]) -> None:
    """Each worker on a CPU of its own (the parent stays where it was)."""
    cpus = sorted(os.sched_getaffinity(0))
    for index, pid in enumerate(sorted(pids)):
        os.sched_setaffinity(pid, {cpus[index % len(cpus)]})


async def _predictions(sched: Any, specs: list[dict], history: str | None) -> list[float | None] | None:
    """What a scheduler with the cost history ``history`` held before the batch predicted
    for each spec (the keys come from the batch's own memo now, at no cost)."""
    from aiocompile._core.costs import CostHistory

    items = [{"kernel": spec["kernel"], "signature": spec["signature"], "constexprs": spec.get("constexprs"),
              "target": spec.get("target"), "attrs": None,
              "options": {k: spec[k] for k in ("num_warps", "num_stages") if k in spec}} for spec in specs]
    requests = await sched.port.triton.prepare_many(sched.port, items)
    before = CostHistory(history, read_only=True)
    before.load()
    try:
        return [before.estimate(r.key, r.name, r.backend, r.target, getattr(r, "features", ())) for r in requests]
    except TypeError:  # a version without a cost model
        return None


async def run_aiocompile(specs: list[dict], workers: int, target: str, cache_dir: str, ticker: Ticker,
                         options: dict[str, Any] | None = None) -> dict:
    import aiocompile

    options = options or {}
    workers = options.get("workers", workers)
    scratch = tempfile.mkdtemp(prefix="bench-throughput-history-")
    history = os.path.join(scratch, "costs.json") if FIRST_RUN else COST_HISTORY
    before = os.path.join(scratch, "before.json")
    if history is not None and os.path.exists(history):
        shutil.copyfile(history, before)
    known = _known_costs(history)
    settings: dict[str, Any] = {"cost_history": history}
    if "nice" in options:
        settings["worker_nice"] = options["nice"]
    config = aiocompile.SchedulerConfig(**settings)
    try:
        async with aiocompile.Scheduler(workers=workers, config=config) as sched:
            await sched.warm(target)
            if options.get("pin"):
                _pin(sched.worker_pids())
            os.environ["TRITON_CACHE_DIR"] = cache_dir  # each job carries the parent's TRITON_* environment
            clock = time.time()
            wall, kernels = await _timed(ticker, lambda: sched.compile_many(specs))
            clock += 0.05  # _timed's ticker start, before its clock
            assert len(kernels) == len(specs)
            records = [r for r in sched.records() if r.backend == "triton"]
            predicted = await _predictions(sched, specs, before)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert len(records) == len(specs) and not any(r.compiler_cache_hit for r in records), records
    run_times = {r.key: r.run_time or 0.0 for r in records}
    per_kernel = {spec["label"]: run_times[kernel.key] for spec, kernel in zip(specs, kernels)}
    row = {"wall_s": wall, "compile_s_in_workers": sum(r.run_time or 0.0 for r in records),
           "processes": len({r.worker_pid for r in records}), "costs_known": known, "per_kernel_s": per_kernel}
    if predicted is not None:
        row["predicted_s"] = {spec["label"]: p for spec, p in zip(specs, predicted)}
    row["timeline"] = timeline(records, clock, wall, workers)
    return row


def timeline(records: list[Any], clock: float, wall: float, workers: int) -> dict[str, float]:
    """Where a batch's wall time went, from its records (times in seconds from the clock's
    start): the first job's start, the last job's end in its worker, the last answer; the
    parent's loading (sum and longest), the queue waits, how busy the workers were, and when
    the job that ended last started and how long it ran."""
    starts = [r.started_at - clock for r in records if r.started_at is not None]
    ends = [r.started_at - clock + (r.run_time or 0.0) for r in records if r.started_at is not None]
    loads = [r.load_time or 0.0 for r in records]
    waits = sorted(r.queue_wait or 0.0 for r in records)
    last = max((r for r in records if r.started_at is not None),
               key=lambda r: r.started_at + (r.run_time or 0.0))
    used = {r.worker_pid for r in records}
    busy = sum(r.run_time or 0.0 for r in records)
    return {"first_start_s": min(starts), "last_end_in_worker_s": max(ends),
            "last_answer_s": max(r.finished_at for r in records) - clock, "wall_s": wall,
            "load_sum_s": sum(loads), "load_max_s": max(loads), "queue_wait_p50_s": pick(waits, 0.5),
            "queue_wait_max_s": waits[-1], "busy_share": busy / (workers * wall),
            "workers_used": len(used), "last_job_start_s": last.started_at - clock,
            "last_job_run_s": last.run_time or 0.0}


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
            "warmed_processes": len(pids), "per_kernel_s": {spec["label"]: s for spec, (_, s) in zip(specs, done)}}


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


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2  # ties share their mean rank
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation of two equally long lists (None if either is constant)."""
    if len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else None


def split_ways(text: str) -> list[str]:
    """Comma-separated ways; commas inside a way's ``[...]`` settings do not split it."""
    ways, depth, current = [], 0, ""
    for char in text:
        depth += char == "["
        depth -= char == "]"
        if char == "," and not depth:
            ways.append(current.strip())
            current = ""
        else:
            current += char
    ways.append(current.strip())
    return [way for way in ways if way]


def _alone(specs: list[dict], labels: list[str], target: str) -> dict[str, float]:
    """Each of ``labels`` compiled alone, one after another, in a worker process of its own
    (a stdlib pool of one, warmed with a tiny compile) with nothing else running, each in
    a fresh Triton cache: the time the batch's lower bound is made of."""
    index = {spec["label"]: i for i, spec in enumerate(specs)}
    out: dict[str, float] = {}
    with cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        pool.submit(kernel_set.warm_worker, target, 0.0).result()
        for label in labels:
            scratch = tempfile.mkdtemp(prefix="bench-throughput-alone-")
            try:
                out[label] = pool.submit(kernel_set.compile_in_worker, index[label], target, scratch, KIND).result()[1]
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return out


def measure(ways: list[str], workers: int, target: str, repeat: int, kernels: int = 64, kind: str = "mixed",
            first_run: bool = False, alone: int = 0) -> dict:
    global COST_HISTORY, KIND, FIRST_RUN
    KIND = kind
    FIRST_RUN = first_run
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
    rounds: list[dict[str, Any]] = []
    saved = os.environ.get("TRITON_CACHE_DIR")
    for round_ in range(repeat):
        # Rotate the order each round, so that drift of the machine hits every way alike.
        order = ways[round_ % len(ways):] + ways[:round_ % len(ways)]
        this_round: dict[str, Any] = {"round": round_ + 1, "ways": {}}
        for way in order:
            if way in unavailable or way in failed:
                continue
            cache_dir = tempfile.mkdtemp(prefix="bench-throughput-")
            ticker = Ticker()
            base, options = parse_way(way)
            try:
                if options:
                    row = asyncio.run(RUNNERS[base](specs, workers, target, cache_dir, ticker, options))
                else:
                    row = asyncio.run(RUNNERS[base](specs, workers, target, cache_dir, ticker))
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
            entry: dict[str, Any] = {"wall_s": walls[way][-1], "costs_known": row.get("costs_known"),
                                     "per_kernel_s": row.get("per_kernel_s"), "predicted_s": row.get("predicted_s")}
            if "predicted_s" in row:
                labels = [spec["label"] for spec in specs]
                if all(row["predicted_s"][label] is not None for label in labels):
                    entry["spearman"] = spearman([row["predicted_s"][label] for label in labels],
                                                 [row["per_kernel_s"][label] for label in labels])
            this_round["ways"][way] = entry
            note = f"  predictions' rank correlation {entry['spearman']:.3f}" if entry.get("spearman") is not None \
                else ""
            print(f"round {round_ + 1} {way:24} {walls[way][-1]:7.2f} s  loop late max "
                  f"{max(ticker.lags) * 1000:8.1f} ms{note}", flush=True)
            if "timeline" in row:
                entry["timeline"] = line = row["timeline"]
                print(f"    first start {line['first_start_s']:.3f} s, last end in a worker "
                      f"{line['last_end_in_worker_s']:.3f} s, last answer {line['last_answer_s']:.3f} s; loading "
                      f"{line['load_sum_s']:.3f} s (longest {line['load_max_s'] * 1000:.1f} ms); queue wait p50 "
                      f"{line['queue_wait_p50_s']:.3f} s max {line['queue_wait_max_s']:.3f} s; workers busy "
                      f"{line['busy_share']:.0%} ({line['workers_used']} used); the last to end started at "
                      f"{line['last_job_start_s']:.3f} s and ran {line['last_job_run_s']:.3f} s", flush=True)
        if alone:
            # The longest compiles of this round, whichever pool ran them, each timed alone
            # now: the longest of them is this round's lower bound.
            seen: dict[str, float] = {}
            for way in this_round["ways"]:
                for label, seconds in extra[way][-1].get("per_kernel_s", {}).items():
                    seen[label] = max(seen.get(label, 0.0), seconds)
            longest = sorted(seen, key=lambda label: -seen[label])[:alone]
            measured = _alone(specs, longest, target)
            bound = max(measured.values()) if measured else None
            this_round["alone_s"] = measured
            this_round["lower_bound_s"] = bound
            for way, entry in this_round["ways"].items():
                batch = extra[way][-1].get("per_kernel_s", {})
                if bound:
                    entry["wall_over_bound"] = entry["wall_s"] / bound
                slowdowns = [batch[label] / measured[label] for label in measured if label in batch]
                if slowdowns:
                    entry["slowdown"] = statistics.median(slowdowns)
            print(f"round {round_ + 1} alone: " + ", ".join(f"{label} {t:.2f} s" for label, t in measured.items())
                  + "; " + ", ".join(f"{way} {e['wall_over_bound']:.2f}x bound, longest slowed "
                                     f"{e.get('slowdown', float('nan')):.2f}x"
                                     for way, e in this_round["ways"].items() if "wall_over_bound" in e),
                  flush=True)
        rounds.append(this_round)

    report: dict[str, Any] = {"cpus": os.cpu_count(), "workers": workers, "target": target, "repeat": repeat,
                              "set": kind, "kernels": len(specs), "first_run": first_run, "ways": {},
                              "rounds": rounds}
    if all(single.values()):
        medians = {label: statistics.median(v) for label, v in single.items()}
        total = sum(medians.values())
        longest = max(medians, key=lambda label: medians[label])
        report["single"] = {"sum_s": total, "longest_s": medians[longest], "longest_label": longest,
                            "per_kernel_s": medians}
        report["lower_bound_s"] = max(total / workers, medians[longest])
    elif alone and all(r.get("lower_bound_s") for r in rounds):
        report["lower_bound_s"] = statistics.median(r["lower_bound_s"] for r in rounds)
        report["lower_bound_from"] = "the longest compile timed alone after each round (median over rounds)"
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
        if "lower_bound_s" in report:
            row["wall_over_bound"] = row["wall_s"] / report["lower_bound_s"]
        per_round = [r["ways"][way] for r in rounds if way in r["ways"]]
        over = [e["wall_over_bound"] for e in per_round if "wall_over_bound" in e]
        if over:
            row["wall_over_round_bound"] = statistics.median(over)
        slowed = [e["slowdown"] for e in per_round if "slowdown" in e]
        if slowed:
            row["longest_slowdown"] = statistics.median(slowed)
        correlations = [e["spearman"] for e in per_round if e.get("spearman") is not None]
        if correlations:
            row["spearman"] = statistics.median(correlations)
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
    stdlib = report["ways"].get("ProcessPoolExecutor", {}).get("wall_s")
    for row in report["ways"].values():
        if base and "wall_s" in row:
            row["ratio_to_aiocompile"] = row["wall_s"] / base
        if stdlib and "wall_s" in row:
            row["ratio_to_stdlib"] = row["wall_s"] / stdlib
    return report


def print_report(report: dict) -> None:
    print(f"\n{report['kernels']} distinct kernels ({report['set']} set) for {report['target']}, "
          f"{report['workers']} workers, "
          f"{report['cpus']} CPUs, median of {report['repeat']}"
          + (", every aiocompile round with no compile history" if report.get("first_run") else ""))
    if "single" in report:
        single = report["single"]
        print(f"single compiles (serial, warm process): sum {single['sum_s']:.2f} s, longest "
              f"{single['longest_s']:.2f} s ({single['longest_label']}); lower bound "
              f"max(sum/W, longest) = {report['lower_bound_s']:.2f} s")
    elif "lower_bound_s" in report:
        print(f"lower bound {report['lower_bound_s']:.2f} s: {report['lower_bound_from']}")
    print(f"{'':34}{'wall s':>8}{'/aioc.':>7}{'/stdlib':>8}{'/bound':>8}{'slowed':>7}{'rank r':>7}{'compile s':>10}"
          f"{'lag p99 ms':>11}{'max ms':>9}")
    for way, row in report["ways"].items():
        if not row["available"]:
            print(f"{way:34} unavailable: {row['reason']}")
            continue
        if "error" in row:
            print(f"{way:34} FAILED: {row['error']}")
            continue
        lag = row["lag"]
        nan = float("nan")
        print(f"{way:34}{row['wall_s']:8.2f}{row.get('ratio_to_aiocompile', nan):7.2f}"
              f"{row.get('ratio_to_stdlib', nan):8.2f}"
              f"{row.get('wall_over_round_bound', row.get('wall_over_bound', nan)):8.2f}"
              f"{row.get('longest_slowdown', nan):7.2f}{row.get('spearman', nan):7.2f}"
              f"{row['compile_s_in_workers']:10.2f}{lag['p99_ms']:11.2f}{lag['max_ms']:9.1f}")
    print("(/bound: wall / lower bound, the median of each round's own; slowed: the longest compiles' time in the"
          " batch / alone; rank r: Spearman's correlation of the predicted and measured compile times;"
          " compile s: the compiles' own times summed, as measured where they ran)")
    base = report["ways"].get(BASELINE, {})
    if base.get("nothing_known_s") is not None or base.get("costs_known_s") is not None:
        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f} s"
        print(f"aiocompile, rounds with no compile times known: {fmt(base.get('nothing_known_s'))}; "
              f"rounds with the earlier rounds' times known: {fmt(base.get('costs_known_s'))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="kind", default="mixed", choices=sorted(kernel_set.SETS),
                        help="the kernel set (default: mixed)")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--target", default="cuda:90")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS), help="a comma-separated subset of: " + ", ".join(WAYS))
    parser.add_argument("--kernels", type=int, default=64, help="compile only the first N (a smoke test)")
    parser.add_argument("--first-run", action="store_true",
                        help="every aiocompile round starts with an empty compile history, as a first run does")
    parser.add_argument("--alone", type=int, default=0, metavar="N",
                        help="after each round, time its N longest compiles alone: the round's lower bound")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    ways = split_ways(args.ways)
    for way in ways:
        try:
            base, _ = parse_way(way)
        except ValueError as exc:
            parser.error(str(exc))
        if base not in RUNNERS:
            parser.error(f"unknown way {way!r}")
    if "serial triton.compile" not in ways and not args.alone:
        print("(without the serial way or --alone there are no single compile times: no efficiency or bound)")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    report = measure(ways, args.workers, args.target, args.repeat, args.kernels, args.kind, args.first_run,
                     args.alone)
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
