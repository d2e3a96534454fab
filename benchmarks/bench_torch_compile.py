"""torch.compile wall time: stock Inductor against Inductor with aiocompile installed.

For each model of ``examples/torch_models.py`` (an MLP, an attention block, a small conv
net), each measurement is a fresh interpreter with empty Inductor and Triton caches and
no FX graph cache, so every kernel is generated and compiled: the time from
``torch.compile(model)`` to the first output on the GPU. Two scenarios:

- cold: the compile pools start on the clock (aiocompile's ``install()`` is timed too);
  stock Inductor compiles in the process itself until its pool is ready, aiocompile
  always in its pool;
- started: each pool was started (and its workers readied) before the clock, as in a
  program that installs at start-up and compiles later.

Stock and aiocompile alternate, their order swapped each round; both use as many compile
workers as Inductor would (its ``compile_threads``). The outputs are checked against eager.

    python benchmarks/bench_torch_compile.py [--repeat 3] [--scenarios cold,started]
        [--models mlp,attention,convnet] [--json out.json]

Needs a CUDA GPU.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("stock", "aiocompile")


def child(mode: str, name: str, scenario: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-triton-")
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    import importlib.util

    import torch
    from torch._dynamo.utils import counters
    from torch._inductor import config

    config.fx_graph_cache = False
    spec = importlib.util.spec_from_file_location("torch_models", os.path.join(ROOT, "examples", "torch_models.py"))
    assert spec is not None and spec.loader is not None
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    model, inputs = models.make(name)
    with torch.no_grad():
        expected = model(*inputs)  # CUDA and cuDNN initialised before the clock starts
    torch.cuda.synchronize()
    workers = config.decide_compile_threads() if config.compile_threads is None else config.compile_threads
    sched = None
    if scenario == "started":
        sched = start_pool(mode, workers)
    started = time.perf_counter()
    if mode == "aiocompile" and sched is None:
        sched = start_pool(mode, workers, wait=False)
    with torch.no_grad():
        out = torch.compile(model)(*inputs)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    result = {
        "mode": mode, "model": name, "scenario": scenario, "seconds": elapsed, "workers": workers,
        "matches_eager": bool(torch.allclose(out, expected, rtol=1e-3, atol=1e-3)),
        "inductor_triton_calls": int(counters["inductor"]["async_compile_cache_miss"]),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    }
    if sched is not None:
        stats = sched.statistics()
        result.update(compiled=stats.compiled, joined=stats.joined, cache_hits=stats.cache_hits,
                      compile_seconds_in_workers=round(stats.run_time.total, 3),
                      slowest=[list(item) for item in stats.slowest[:3]])
        import aiocompile.torch

        aiocompile.torch.uninstall()
    print(json.dumps(result), flush=True)


def start_pool(mode: str, workers: int, wait: bool = True) -> object:
    """aiocompile: install (its own scheduler, configured from the environment), and with
    ``wait`` have every worker ready. Stock: start Inductor's pool and wait for it."""
    if mode == "stock":
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.warm_pool()
        AsyncCompile.wakeup()
        AsyncCompile.wait_pool_ready(timeout=300)
        return None
    import aiocompile.torch
    from aiocompile.backends.inductor import _worker as _inductor_worker

    os.environ["AIOCOMPILE_WORKERS"] = str(workers)
    sched = aiocompile.torch.install()
    if wait:
        for job in sched._pool.warm(_inductor_worker.warm_up):
            job.future.result(timeout=300)
    return sched


def measure(mode: str, name: str, scenario: str, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, name, scenario],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get(
                              "PYTHONPATH", "")]))})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} {name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--models", default="mlp,attention,convnet")
    parser.add_argument("--scenarios", default="cold,started")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "MODEL", "SCENARIO"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    names = [n for n in args.models.split(",") if n]
    scenarios = [n for n in args.scenarios.split(",") if n]
    runs: list[dict] = []
    for round_ in range(args.repeat):
        for scenario in scenarios:
            for name in names:
                for mode in (MODES if round_ % 2 == 0 else MODES[::-1]):
                    run = measure(mode, name, scenario, args.timeout)
                    runs.append(run)
                    extra = f", {run['compiled']} compiled in workers" if mode == "aiocompile" else ""
                    print(f"round {round_ + 1} {scenario:8} {name:9} {mode:10} {run['seconds']:7.2f} s "
                          f"(matches eager: {run['matches_eager']}{extra})", flush=True)
    if runs:
        print(f"\n{runs[0]['device']}, torch {runs[0]['torch']}, {runs[0]['workers']} compile workers, "
              f"median of {args.repeat}, fresh process and caches each")
    print(f"{'scenario':9} {'model':10} {'stock s':>9} {'aiocompile s':>13} {'ratio':>7} {'kernels':>8}")
    for scenario in scenarios:
        for name in names:
            times = {mode: statistics.median(r["seconds"] for r in runs
                                             if (r["model"], r["mode"], r["scenario"]) == (name, mode, scenario))
                     for mode in MODES}
            kernels = max(r.get("compiled", 0) for r in runs if r["model"] == name)
            print(f"{scenario:9} {name:10} {times['stock']:9.2f} {times['aiocompile']:13.2f} "
                  f"{times['aiocompile'] / times['stock']:7.2f} {kernels:8d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
