"""torch.compile wall time: stock Inductor against Inductor with aiocompile installed.

For each model of ``examples/torch_models.py`` (an MLP, an attention block, a small conv
net), each measurement is a fresh interpreter with empty Inductor and Triton caches and
no FX graph cache, so every kernel is generated and compiled: the time from
``torch.compile(model)`` to the first output. On a GPU (``--device cuda``) the kernels are
Triton's; on the CPU (``--device cpu``) they are Inductor's C++ kernels, built with the
host compiler. Two scenarios:

- cold: the compile pools start on the clock (aiocompile's ``install()`` is timed too);
  on a GPU stock Inductor compiles Triton kernels in the process itself until its pool
  is ready, aiocompile always in its pool;
- started: each pool was started (and its workers readied) before the clock, as in a
  program that installs at start-up and compiles later.

Stock and aiocompile alternate, their order swapped each round; both use as many compile
workers as Inductor would (its ``compile_threads``). The outputs are checked against eager.
Each round prints both times and their ratio; the summary gives the medians, their ratio
and the median of the rounds' ratios (steadier on a machine shared with other work). On
the CPU, "ms added per build" is what the pool adds to a C++ build beyond the compiler's
own time and the wait for a free worker (median over the run's builds). With
``--cpu-backend halide`` the CPU kernels are Inductor's Halide ones (``pip install halide``):
each a Halide generator and a C++ glue, and Halide's runtime once per run.

    python benchmarks/bench_torch_compile.py [--device cpu] [--repeat 3] [--scenarios cold,started]
        [--models mlp,attention,convnet] [--cpu-backend cpp|halide] [--json out.json]

The device is the GPU where torch sees one, the CPU otherwise.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("stock", "aiocompile")


def child(mode: str, name: str, scenario: str, device: str) -> None:
    inductor_dir = tempfile.mkdtemp(prefix="bench-inductor-")
    triton_dir = tempfile.mkdtemp(prefix="bench-triton-")
    try:
        measure_in_child(mode, name, scenario, device, inductor_dir, triton_dir)
    finally:
        for path in (inductor_dir, triton_dir):
            shutil.rmtree(path, ignore_errors=True)


def measure_in_child(mode: str, name: str, scenario: str, device: str, inductor_dir: str, triton_dir: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
    os.environ["TRITON_CACHE_DIR"] = triton_dir
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    import importlib.util

    import torch
    from torch._dynamo.utils import counters
    from torch._inductor import config

    config.fx_graph_cache = False
    config.cpu_backend = os.environ.get("BENCH_CPU_BACKEND", "cpp")
    spec = importlib.util.spec_from_file_location("torch_models", os.path.join(ROOT, "examples", "torch_models.py"))
    assert spec is not None and spec.loader is not None
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    model, inputs = models.make(name, device)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        expected = model(*inputs)  # CUDA and cuDNN initialised before the clock starts
    synchronize()
    workers = config.decide_compile_threads() if config.compile_threads is None else config.compile_threads
    sched = None
    if scenario == "started":
        sched = start_pool(mode, workers)
    started = time.perf_counter()
    if mode == "aiocompile" and sched is None:
        sched = start_pool(mode, workers, wait=False)
    with torch.no_grad():
        out = torch.compile(model)(*inputs)
    synchronize()
    elapsed = time.perf_counter() - started
    result = {
        "mode": mode, "model": name, "scenario": scenario, "device_kind": device, "seconds": elapsed,
        "workers": workers, "matches_eager": bool(torch.allclose(out, expected, rtol=1e-3, atol=1e-3)),
        "inductor_triton_calls": int(counters["inductor"]["async_compile_cache_miss"]),
        # Each C++ kernel is one library in Inductor's cache directory, whoever built it.
        "cpp_libraries": len(glob.glob(os.path.join(inductor_dir, "**", "*.so"), recursive=True)),
        "device": torch.cuda.get_device_name() if device == "cuda" else cpu_name(), "torch": torch.__version__,
    }
    if sched is not None:
        stats = sched.statistics()
        halide = [r for r in sched.records() if r.backend == "inductor-halide" and r.outcome == "compiled"]
        if halide:
            result.update(halide_builds=len(halide), halide_build_seconds=round(sum(r.run_time or 0.0
                                                                                   for r in halide), 3))
        result.update(compiled=stats.compiled, joined=stats.joined, cache_hits=stats.cache_hits,
                      compile_seconds_in_workers=round(stats.run_time.total, 3),
                      worker_crashes=stats.worker_crashes, failed=stats.failed,
                      slowest=[list(item) for item in stats.slowest[:3]])
        builds = [r for r in sched.records() if r.backend == "inductor-cpp" and r.outcome == "compiled"]
        if builds:
            # What the pool adds to a C++ build, beyond the compiler's own time and the
            # wait for a free worker: the request, the round trip, Inductor's lock.
            added = [r.total_time - dict(r.stages).get("build", 0.0) - (r.queue_wait or 0.0) for r in builds]
            result.update(cpp_builds=len(builds), cpp_build_seconds=round(sum(dict(r.stages)["build"]
                                                                               for r in builds), 3),
                          cpp_added_ms=round(1000 * statistics.median(added), 1))
        import aiocompile.torch

        aiocompile.torch.uninstall()
    print(json.dumps(result), flush=True)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return f"{platform.processor() or 'CPU'} ({os.cpu_count()} CPUs)"


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

    os.environ["AIOCOMPILE_WORKERS"] = str(workers)
    sched = aiocompile.torch.install()
    if wait:
        # As install() readies workers on the first torch.compile: importing Inductor's
        # Triton runtime where Triton kernels may come, nothing for a CPU build of torch.
        for future in sched.port.warm_workers(aiocompile._torch.install._warm_up_function()):
            future.result(timeout=300)
    return sched


def measure(mode: str, name: str, scenario: str, device: str, timeout: float, cpu_backend: str = "cpp") -> dict:
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, name, scenario, device],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "BENCH_CPU_BACKEND": cpu_backend, "PYTHONPATH": path})
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
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where torch sees a GPU, else cpu")
    parser.add_argument("--cpu-backend", choices=("cpp", "halide"), default="cpp", help="Inductor's CPU kernels")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "MODEL", "SCENARIO", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    device = args.device or default_device()
    names = [n for n in args.models.split(",") if n]
    scenarios = [n for n in args.scenarios.split(",") if n]
    runs: list[dict] = []
    for round_ in range(args.repeat):
        for scenario in scenarios:
            for name in names:
                pair = {}
                for mode in (MODES if round_ % 2 == 0 else MODES[::-1]):
                    run = pair[mode] = measure(mode, name, scenario, device, args.timeout, args.cpu_backend)
                    run["round"] = round_ + 1
                    runs.append(run)
                    extra = f", {run['compiled']} compiled in workers" if mode == "aiocompile" else ""
                    if device == "cpu":
                        extra += f", {run['cpp_libraries']} C++ libraries built"
                        if "cpp_added_ms" in run:
                            extra += f", {run['cpp_added_ms']} ms added per build"
                    print(f"round {round_ + 1} {scenario:8} {name:9} {mode:10} {run['seconds']:7.2f} s "
                          f"(matches eager: {run['matches_eager']}{extra})", flush=True)
                ratio = pair["aiocompile"]["seconds"] / pair["stock"]["seconds"]
                print(f"round {round_ + 1} {scenario:8} {name:9} ratio      {ratio:7.2f}", flush=True)
    if runs:
        print(f"\n{runs[0]['device']}, torch {runs[0]['torch']}, {runs[0]['workers']} compile workers, "
              f"median of {args.repeat}, fresh process and caches each")
    print(f"{'scenario':9} {'model':10} {'stock s':>9} {'aiocompile s':>13} {'ratio':>7} {'per round':>10} "
          f"{'kernels':>8}")
    for scenario in scenarios:
        for name in names:
            mine = [r for r in runs if (r["model"], r["scenario"]) == (name, scenario)]
            times = {mode: statistics.median(r["seconds"] for r in mine if r["mode"] == mode) for mode in MODES}
            # Each round's two measurements ran back to back: their ratio is steadier than
            # the ratio of medians where other work on the machine comes and goes.
            rounds = {}
            for r in mine:
                rounds.setdefault(r["round"], {})[r["mode"]] = r["seconds"]
            per_round = statistics.median(pair["aiocompile"] / pair["stock"] for pair in rounds.values())
            # Kernels compiled in the pool: Triton's on a GPU, C++ libraries on the CPU.
            kernels = max(r.get("compiled", 0) for r in mine)
            print(f"{scenario:9} {name:10} {times['stock']:9.2f} {times['aiocompile']:13.2f} "
                  f"{times['aiocompile'] / times['stock']:7.2f} {per_round:10.2f} {kernels:8d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


def default_device() -> str:
    probe = "import torch; print(torch.cuda.is_available())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    return "cuda" if out == "True" else "cpu"


if __name__ == "__main__":
    main()
