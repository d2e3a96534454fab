"""Autotuning's first launch: Triton's own autotuner against ``aiocompile.autotune()``.

For each autotuned kernel of ``_autotune_kernels.py`` (a 24-configuration fp16 matmul at
4096^3, and two autotuned kernels from public libraries: flash-linear-attention's l2norm
and Liger-Kernel's DyT), each measurement is a fresh interpreter with an empty Triton
cache, its tensors made and the GPU's context up before the clock starts:

- ``triton``: the first ordinary launch ``kernel[grid](...)``, Triton compiling every
  configuration one after another in the launching process, then benchmarking each there;
- ``aiocompile``: ``await sched.autotune(kernel, ..., grid=grid)`` then that same launch,
  the scheduler made just before the clock (its workers and benchmark processes start on
  the clock);
- ``aiocompile-server``: the scheduler made at the program's start, with
  ``benchmark_at_start=True`` (``AIOCOMPILE_BENCHMARK_AT_START=1``), before the program
  imports its kernels and makes its tensors; the clock starts when they are made, as a
  server's first request comes after its own start-up (how long that took is printed:
  it is what the benchmark process's start could hide behind);
- ``aiocompile-warm``: the scheduler warmed before the clock and waited for
  (``await sched.warm(benchmark=True)`` until the benchmark process is up).

Each ``aiocompile`` measurement also prints where its time went (from the tuner's profile
of the call: plan, the benchmark process's start and its steps, the tensors sent, the
compiles, the timings and the GPU's idle time between them, priming, the launch), and how
the timings taken while compiles ran on every core compare with Triton's own timings of
the same configurations (against those taken after the compiles ended).

Also checked: the launch after ``autotune()`` neither compiles nor benchmarks (Triton's own
``jit_cache_hook`` and the autotuner's ``do_bench``, counted), the output matches torch,
and the configuration chosen is Triton's own or one within 3% of its time as Triton
measured it (Triton's ``configs_timings`` from the ``triton`` run of the same round).

    python benchmarks/bench_autotune.py [--repeat 1] [--cases matmul_fp16_4096,fla_l2norm_fwd,liger_dyt_fwd]
        [--modes triton,aiocompile,aiocompile-server,aiocompile-warm] [--json out.json]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import asyncio
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
MODES = ("triton", "aiocompile", "aiocompile-server", "aiocompile-warm")


def _label(config: Any) -> str:
    from aiocompile._tuning.plan import describe

    return describe(config)


def child(case: str, mode: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-triton-")
    sys.path.insert(0, HERE)
    if mode == "aiocompile-server":
        asyncio.run(_server_child(case))
        return
    import _autotune_kernels as kernels
    import torch

    kernel, args, kwargs, grid, check = kernels.CASES[case]()
    torch.cuda.synchronize()
    result = _describe(case, mode, kernel)
    if mode == "triton":
        started = time.perf_counter()
        kernel[grid](*args, **kwargs)
        torch.cuda.synchronize()
        result["seconds"] = time.perf_counter() - started
        result["chosen"] = _label(kernel.best_config)
        result["timings"] = {_label(c): t[0] for c, t in kernel.configs_timings.items()}
        result["bench_seconds"] = getattr(kernel, "bench_time", None)
    else:
        result.update(asyncio.run(_with_aiocompile(kernel, args, kwargs, grid, warm=mode == "aiocompile-warm")))
    _finish(result, kernel, args, kwargs, grid, check)


def _profile(raw: dict[str, Any], starts: list[dict[str, Any]], wall: float, launched: float) -> dict[str, Any]:
    """The tuner's profile of the call, in seconds from the clock's start."""

    def at(value: Any) -> float | None:
        return None if value is None else round(value - wall, 3)

    configs = raw.get("configs", [])
    compiled = [c["compiled_at"] for c in configs if "compiled_at" in c]
    # Every timing, short and full, in the order they ran on the GPU.
    timed = sorted(({"label": c["label"], "bench_started_at": c[f"{p}bench_started_at"],
                     "bench_finished_at": c[f"{p}bench_finished_at"], "seconds": c.get(f"{p}seconds", 0.0),
                     "load_s": c.get(f"{p}load_s", 0.0), "round": p or "full"}
                    for c in configs for p in ("short_", "") if f"{p}bench_started_at" in c),
                   key=lambda c: c["bench_started_at"])
    busy = sum(c.get("seconds", 0.0) for c in timed)
    compile_end = max(compiled, default=None)
    profile: dict[str, Any] = {
        "resolved": at(raw.get("resolved_at")), "planned": at(raw.get("planned_at")),
        "expanded": at(raw.get("expanded_at")), "tune": at(raw.get("tune_at")),
        "inputs_read": at(raw.get("inputs_read_at")),
        "first_submitted": at(min((c["compile_submitted_at"] for c in configs if "compile_submitted_at" in c),
                                  default=None)),
        "first_compiled": at(min(compiled, default=None)), "compiles_done": at(compile_end),
        "first_timed": at(timed[0]["bench_started_at"]) if timed else None,
        "last_timed": at(timed[-1]["bench_finished_at"]) if timed else None,
        "process_busy_s": round(busy, 3),
        "load_s": round(sum(c.get("load_s", 0.0) for c in timed), 3),
        "first_load_s": round(timed[0].get("load_s", 0.0), 3) if timed else None,
        "decided": at(raw.get("decided_at")), "primed": at(raw.get("primed_at")), "launched": at(launched),
        "timed_during_compiles": [c["label"] for c in timed if c["round"] == "full"
                                  and compile_end is not None and c["bench_started_at"] < compile_end],
        "short_timings": sum(1 for c in timed if c["round"] == "short_"),
        "full_timings": sum(1 for c in timed if c["round"] == "full"),
        "first_full": at(min((c["bench_started_at"] for c in timed if c["round"] == "full"), default=None)),
        # The GPU waiting on the next configuration (its compile, or its turn).
        "waits": [round(b["bench_started_at"] - a["bench_finished_at"], 3) for a, b in zip(timed, timed[1:])],
    }
    for device, (sending, seconds) in dict(raw.get("inputs_sent", {})).items():
        profile[f"inputs_sent_{device}"] = [at(sending), round(seconds, 3)]
    mine = [s for s in starts if s.get("ready_at", 0) > wall - 600]
    if mine:
        last = mine[-1]
        profile["process"] = {key: (at(value) if key.endswith("_at") else round(value, 3))
                              for key, value in last.items() if isinstance(value, float)}
    return profile


async def _server_child(case: str) -> None:
    """A server's start: the scheduler first, then the program's own start-up (its
    imports, its tensors), then the first request."""
    import aiocompile

    program_start = time.perf_counter()
    async with aiocompile.Scheduler(config=aiocompile.SchedulerConfig(benchmark_at_start=True)) as sched:
        import _autotune_kernels as kernels
        import torch

        kernel, args, kwargs, grid, check = kernels.CASES[case]()
        torch.cuda.synchronize()
        result = _describe(case, "aiocompile-server", kernel)
        result["startup_before_clock"] = time.perf_counter() - program_start
        result.update(await _tune_and_launch(sched, kernel, args, kwargs, grid))
    _finish(result, kernel, args, kwargs, grid, check)


def _describe(case: str, mode: str, kernel: Any) -> dict[str, Any]:
    import torch
    import triton

    return {"case": case, "mode": mode, "device": torch.cuda.get_device_name(), "configs": len(kernel.configs),
            "cpus": len(os.sched_getaffinity(0)), "triton": triton.__version__}


def _finish(result: dict[str, Any], kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grid: Any,
            check: Any) -> None:
    import torch

    started = time.perf_counter()
    kernel[grid](*args, **kwargs)
    torch.cuda.synchronize()
    result["next_launch_ms"] = (time.perf_counter() - started) * 1000
    result["max_error"] = check()
    print(json.dumps(result), flush=True)


async def _with_aiocompile(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grid: Any,
                           warm: bool) -> dict[str, Any]:
    import aiocompile

    async with aiocompile.Scheduler() as sched:
        if warm:
            await sched.warm(benchmark=True)
            pool = sched.port.tuner().pool()
            deadline = time.monotonic() + 300
            while pool.ready() != set(pool.devices) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        return await _tune_and_launch(sched, kernel, args, kwargs, grid)


async def _tune_and_launch(sched: Any, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                           grid: Any) -> dict[str, Any]:
    import torch
    from triton import knobs

    wall = time.time()
    started = time.perf_counter()
    best = await sched.autotune(kernel, *args, grid=grid, **kwargs)
    tuned = time.perf_counter()
    # The launch, with Triton's own hooks counting compiles and benchmarks.
    compiles: list[Any] = []
    benchmarks: list[Any] = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: compiles.append(kw["key"]) or False
    real = kernel.do_bench
    kernel.__dict__["do_bench"] = lambda fn, quantiles: benchmarks.append(1) or real(fn, quantiles=quantiles)
    try:
        kernel[grid](*args, **kwargs)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = previous
        kernel.__dict__["do_bench"] = real
    seconds = time.perf_counter() - started
    launched = time.time()
    stats = sched.statistics()
    records = list(sched.port.benchmark_records())
    job_records = [r for r in sched.records() if r.outcome in ("compiled", "error")]
    tuner = sched.port.tuner()
    profile = _profile(tuner.last_profile, list(tuner.pool().starts), wall, launched)
    compile_end = max((r.finished_at for r in job_records), default=None)
    bench_start = min((r.started_at for r in records if r.pid is not None), default=None)
    bench_end = max((r.finished_at for r in records), default=None)
    return {
        "profile": profile, "wall_start": wall,
        "seconds": seconds, "autotune_seconds": tuned - started, "chosen": best.label, "source": best.source,
        "launch_compiles": len(compiles), "launch_benchmarks": len(benchmarks),
        "timings": {t.label: t.time_ms for t in best.timings},
        "failed": {t.label: t.reason for t in best.timings if t.time_ms is None},
        "left_out": [t.label for t in best.timings if t.time_ms is not None and t.reason is not None],
        "compiled": stats.compiled, "workers": sched.config.workers,
        "benchmark_outcomes": {k: v for k, v in stats.benchmark_outcomes.items() if v},
        "benchmark_processes_started": stats.benchmark_processes_started,
        "compile_phase_end": None if compile_end is None else compile_end - (time.time() - seconds),
        "bench_phase": None if bench_start is None or bench_end is None else bench_end - bench_start,
    }


def _profile_line(run: dict[str, Any], triton_run: dict[str, Any] | None) -> str:
    p = run["profile"]

    def t(value: Any) -> str:
        return "-" if value is None else f"{value:.2f}"

    proc = p.get("process", {})
    parts = [f"  plan {t(p['planned'])} expanded {t(p['expanded'])}"]
    if proc:
        parts.append(f"process launched {t(proc.get('launched_at'))} ready {t(proc.get('ready_at'))} "
                     f"(interpreter {t(proc.get('opening_at'))}, torch {t(proc.get('import_torch_s'))} s, "
                     f"context {t(proc.get('context_s'))} s, Triton driver {t(proc.get('triton_driver_s'))} s "
                     f"beside it, waited {t(proc.get('driver_wait_s'))} s)")
    else:
        parts.append("process up before the clock")
    sent = [v for k, v in p.items() if k.startswith("inputs_sent_")]
    if sent:
        parts.append(f"tensors sent {t(sent[0][0])} ({sent[0][1]:.3f} s)")
    waits = p.get("waits") or []
    parts.append(f"first compile sent {t(p.get('first_submitted'))}, compiled {t(p['first_compiled'])}.."
                 f"{t(p['compiles_done'])}")
    parts.append(f"timed {t(p['first_timed'])}..{t(p['last_timed'])} ({p.get('short_timings', 0)} short, "
                 f"{p.get('full_timings', 0)} full from {t(p.get('first_full'))}; busy {t(p['process_busy_s'])} s, "
                 f"loading {t(p['load_s'])} s of which the first {t(p['first_load_s'])} s, "
                 f"GPU waiting {sum(waits):.2f} s between configurations)")
    parts.append(f"decided {t(p['decided'])} primed {t(p['primed'])} launched {t(p['launched'])}")
    line = " | ".join(parts)
    if "startup_before_clock" in run:
        line += f"\n  the program's start-up before the clock: {run['startup_before_clock']:.2f} s"
    if triton_run is not None:
        theirs = triton_run["timings"]
        ours = {label: ms for label, ms in run["timings"].items() if label not in run.get("left_out", ())}
        during = set(p.get("timed_during_compiles", []))

        def ratios(labels: list[str]) -> list[float]:
            return [ours[label] / theirs[label] for label in labels
                    if ours.get(label) is not None and theirs.get(label) not in (None, 0, float("inf"))]

        for name, labels in (("while compiles ran", [x for x in ours if x in during]),
                             ("after the compiles", [x for x in ours if x not in during])):
            found = ratios(labels)
            if found:
                line += (f"\n  timings {name}: {len(found)} configurations, median {statistics.median(found):.3f}x "
                         f"Triton's own (min {min(found):.3f}, max {max(found):.3f})")
    return line


def measure(case: str, mode: str, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH", "")]))}
    env.pop("TRITON_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", case, mode], capture_output=True,
                          text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{case} {mode} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    found: dict[str, Any] = json.loads(lines[-1])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--cases", default="matmul_fp16_4096,fla_l2norm_fwd,liger_dyt_fwd")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    cases = [c for c in args.cases.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    runs: list[dict[str, Any]] = []
    for round_ in range(args.repeat):
        for case in cases:
            triton_run: dict[str, Any] | None = None
            for mode in modes:
                run = measure(case, mode, args.timeout)
                run["round"] = round_
                if mode == "triton":
                    triton_run = run
                elif triton_run is not None:
                    # Our choice, as Triton itself timed it in the same round.
                    theirs = triton_run["timings"]
                    run["vs_triton_choice"] = theirs.get(run["chosen"], float("nan")) / theirs[triton_run["chosen"]]
                    run["same_choice"] = run["chosen"] == triton_run["chosen"]
                runs.append(run)
                if args.json:  # after each measurement: a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(runs, f, indent=1)
                extra = ""
                if mode != "triton":
                    same = "same" if run.get("same_choice") else "other"
                    extra = (f", launch after: {run['launch_compiles']} compiles "
                             f"{run['launch_benchmarks']} benchmarks, choice {same} "
                             f"({run.get('vs_triton_choice', float('nan')):.3f}x Triton's)")
                print(f"round {round_ + 1} {case:18} {mode:17} {run['seconds']:7.2f} s "
                      f"(max error {run['max_error']:.3g}{extra})", flush=True)
                if "profile" in run:
                    print(_profile_line(run, triton_run), flush=True)
    if not runs:
        return
    first = runs[0]
    print(f"\n{first['device']}, Triton {first['triton']}, {first['cpus']} CPUs, median of {args.repeat}, "
          "fresh process and Triton cache each")
    shown = [m for m in MODES[1:] if m in modes]
    print(f"{'case':18} {'configs':>7} {'triton s':>9} " + " ".join(f"{m + ' s':>18} {'ratio':>6}" for m in shown) +
          f" {'choice vs Triton':>17} {'next launch':>12}")
    for case in cases:
        of = [r for r in runs if r["case"] == case]

        def median(mode: str, field: str = "seconds", of: list[dict[str, Any]] = of) -> float:
            values = [r[field] for r in of if r["mode"] == mode and r.get(field) is not None]
            return statistics.median(values) if values else float("nan")

        base = median("triton")
        choice = max((r.get("vs_triton_choice", float("nan")) for r in of if r["mode"] != "triton"), default=0.0)
        launch = max((r["launch_compiles"] + r["launch_benchmarks"] for r in of if r["mode"] != "triton"), default=0)
        print(f"{case:18} {of[0]['configs']:7d} {base:9.2f} " +
              " ".join(f"{median(m):18.2f} {median(m) / base:6.2f}" for m in shown) +
              f" {choice:16.3f}x {launch:5d} c+b")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
