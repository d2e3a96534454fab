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
- ``aiocompile-warm``: the same, with the scheduler warmed before the clock
  (``await sched.warm(benchmark=True)``, as a server does at start-up: compile workers
  ready, benchmark processes up).

Also checked: the launch after ``autotune()`` neither compiles nor benchmarks (Triton's own
``jit_cache_hook`` and the autotuner's ``do_bench``, counted), the output matches torch,
and the configuration chosen is Triton's own or one within 3% of its time as Triton
measured it (Triton's ``configs_timings`` from the ``triton`` run of the same round).

    python benchmarks/bench_autotune.py [--repeat 1] [--cases matmul_fp16_4096,fla_l2norm_fwd,liger_dyt_fwd]
        [--modes triton,aiocompile,aiocompile-warm] [--json out.json]

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
MODES = ("triton", "aiocompile", "aiocompile-warm")


def _label(config: Any) -> str:
    from aiocompile._tuning._plan import describe

    return describe(config)


def child(case: str, mode: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-triton-")
    sys.path.insert(0, HERE)
    import _autotune_kernels as kernels
    import torch

    kernel, args, kwargs, grid, check = kernels.CASES[case]()
    torch.cuda.synchronize()
    result: dict[str, Any] = {"case": case, "mode": mode, "device": torch.cuda.get_device_name(),
                              "configs": len(kernel.configs), "cpus": len(os.sched_getaffinity(0))}
    import triton

    result["triton"] = triton.__version__
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
    started = time.perf_counter()
    kernel[grid](*args, **kwargs)
    torch.cuda.synchronize()
    result["next_launch_ms"] = (time.perf_counter() - started) * 1000
    result["max_error"] = check()
    print(json.dumps(result), flush=True)


async def _with_aiocompile(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grid: Any,
                           warm: bool) -> dict[str, Any]:
    import torch
    from triton import knobs

    import aiocompile

    async with aiocompile.Scheduler() as sched:
        if warm:
            await sched.warm(benchmark=True)
            pool = sched._tuning().pool()
            deadline = time.monotonic() + 300
            while pool.ready() != set(pool.devices) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
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
        stats = sched.statistics()
        records = list(sched._metrics.benchmark_records)
        job_records = [r for r in sched.records() if r.outcome in ("compiled", "error")]
    compile_end = max((r.finished_at for r in job_records), default=None)
    bench_start = min((r.started_at for r in records if r.pid is not None), default=None)
    bench_end = max((r.finished_at for r in records), default=None)
    return {
        "seconds": seconds, "autotune_seconds": tuned - started, "chosen": best.label, "source": best.source,
        "launch_compiles": len(compiles), "launch_benchmarks": len(benchmarks),
        "timings": {t.label: t.time_ms for t in best.timings},
        "failed": {t.label: t.reason for t in best.timings if t.time_ms is None},
        "compiled": stats.compiled, "workers": sched.config.workers,
        "benchmark_outcomes": {k: v for k, v in stats.benchmark_outcomes.items() if v},
        "benchmark_processes_started": stats.benchmark_processes_started,
        "compile_phase_end": None if compile_end is None else compile_end - (time.time() - seconds),
        "bench_phase": None if bench_start is None or bench_end is None else bench_end - bench_start,
    }


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
                print(f"round {round_ + 1} {case:18} {mode:16} {run['seconds']:7.2f} s "
                      f"(max error {run['max_error']:.3g}{extra})", flush=True)
    if not runs:
        return
    first = runs[0]
    print(f"\n{first['device']}, Triton {first['triton']}, {first['cpus']} CPUs, median of {args.repeat}, "
          "fresh process and Triton cache each")
    print(f"{'case':18} {'configs':>7} {'triton s':>9} {'aiocompile s':>13} {'ratio':>6} {'warm s':>7} {'ratio':>6} "
          f"{'choice vs Triton':>17} {'next launch':>12}")
    for case in cases:
        of = [r for r in runs if r["case"] == case]

        def median(mode: str, field: str = "seconds", of: list[dict[str, Any]] = of) -> float:
            values = [r[field] for r in of if r["mode"] == mode and r.get(field) is not None]
            return statistics.median(values) if values else float("nan")

        base = median("triton")
        choice = max((r.get("vs_triton_choice", float("nan")) for r in of if r["mode"] != "triton"), default=0.0)
        launch = max((r["launch_compiles"] + r["launch_benchmarks"] for r in of if r["mode"] != "triton"), default=0)
        print(f"{case:18} {of[0]['configs']:7d} {base:9.2f} {median('aiocompile'):13.2f} "
              f"{median('aiocompile') / base:6.2f} {median('aiocompile-warm'):7.2f} "
              f"{median('aiocompile-warm') / base:6.2f} {choice:16.3f}x {launch:5d} c+b")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
