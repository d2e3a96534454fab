"""torch.compile wall time: stock Inductor against Inductor with aiocompile installed.

For each model of ``examples/torch_models.py`` (an MLP, an attention block, a small conv
net), each measurement is a fresh interpreter with empty Inductor and Triton caches and
no FX graph cache, so every kernel is generated and compiled. On a GPU (``--device cuda``)
the kernels are Triton's; on the CPU (``--device cpu``) they are Inductor's C++ kernels,
built with the host compiler. Public API only: nothing is prepared before the clock but
through calls a program can make. Two scenarios:

- cold: the clock starts at the program's start (before ``import torch``) and stops at
  the first compiled output; the program imports torch (and, with aiocompile,
  ``aiocompile.torch`` and calls ``install()`` at once, as a program that installs at its
  start does), builds the model and calls ``torch.compile(model)(x)``; eager's output is
  computed after the clock;
- server: each way's start-up is paid before the clock, as a server pays it before its
  first request, by public calls only: stock starts Inductor's compile pool and waits for
  it (``AsyncCompile.warm_pool()``, ``wait_pool_ready()``, torch's own); with aiocompile,
  ``install()`` then ``AsyncCompile.warm_pool()`` (which ``install()`` turns into starting
  and readying its workers) and a wait until ``worker_pids()`` counts every worker and
  ``statistics()`` none busy. The model has run eagerly (CUDA initialised) before the
  clock; the clock runs from ``torch.compile(model)`` to the first output.

Stock and aiocompile alternate, their order swapped each round; both use as many compile
workers as Inductor would (its ``compile_threads``). The outputs are checked against eager.
Each round prints both times and their ratio (aiocompile / stock); the summary gives the
medians, their ratio and the median of the rounds' ratios (steadier on a machine shared
with other work). On the CPU, "ms added per build" is what the pool adds to a C++ build
beyond the compiler's own time and the wait for a free worker (median over the run's
builds). With ``--cpu-backend halide`` the CPU kernels are Inductor's Halide ones (``pip
install halide``): each a Halide generator and a C++ glue, and Halide's runtime once per
run. ``--timeline`` prints, for each aiocompile measurement, the scheduler's worker events
and builds in seconds from the program's start.

    python benchmarks/bench_torch_compile.py [--device cpu] [--repeat 3] [--scenarios cold,server]
        [--models mlp,attention,convnet] [--cpu-backend cpp|halide] [--timeline] [--json out.json]

The device is the GPU where torch sees one, the CPU otherwise.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()
T0_WALL = time.time()

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("stock", "aiocompile")
SCENARIOS = ("cold", "server")


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
    from torch._inductor import config

    timeline: list[tuple[float, str]] = [(time.time() - T0_WALL, "torch and Inductor's config imported")]
    config.fx_graph_cache = False
    config.cpu_backend = os.environ.get("BENCH_CPU_BACKEND", "cpp")
    workers = config.decide_compile_threads() if config.compile_threads is None else config.compile_threads
    sched = None
    if mode == "aiocompile":
        os.environ["AIOCOMPILE_WORKERS"] = str(workers)
        import aiocompile.torch

        sched = aiocompile.torch.install()
        timeline.append((time.time() - T0_WALL, "install() returned"))
        if os.environ.get("BENCH_TIMELINE") == "1":
            sched.subscribe(lambda event: timeline.append(describe(event)))
    spec = importlib.util.spec_from_file_location("torch_models", os.path.join(ROOT, "examples", "torch_models.py"))
    assert spec is not None and spec.loader is not None
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    model, inputs = models.make(name, device)
    timeline.append((time.time() - T0_WALL, "model built"))
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    expected = None
    started = T0
    if scenario == "server":
        with torch.no_grad():
            expected = model(*inputs)  # CUDA and cuDNN initialised before the clock starts
        synchronize()
        start_up(sched, workers)
        started = time.perf_counter()
    timeline.append((time.time() - T0_WALL, "torch.compile"))
    with torch.no_grad():
        out = torch.compile(model)(*inputs)
    synchronize()
    elapsed = time.perf_counter() - started
    timeline.append((time.time() - T0_WALL, "first compiled output"))
    if expected is None:
        with torch.no_grad():
            expected = model(*inputs)
    from torch._dynamo.utils import counters

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
        records = sched.records()
        halide = [r for r in records if r.backend == "inductor-halide" and r.outcome == "compiled"]
        if halide:
            result.update(halide_builds=len(halide), halide_build_seconds=round(sum(r.run_time or 0.0
                                                                                   for r in halide), 3))
        result.update(compiled=stats.compiled, joined=stats.joined, cache_hits=stats.cache_hits,
                      compile_seconds_in_workers=round(stats.run_time.total, 3),
                      worker_crashes=stats.worker_crashes, failed=stats.failed,
                      slowest=[list(item) for item in stats.slowest[:3]])
        builds = [r for r in records if r.backend == "inductor-cpp" and r.outcome == "compiled"]
        if builds:
            # What the pool adds to a C++ build, beyond the compiler's own time and the
            # wait for a free worker: the request, the round trip, Inductor's lock.
            added = [r.total_time - dict(r.stages).get("build", 0.0) - (r.queue_wait or 0.0) for r in builds]
            result.update(cpp_builds=len(builds), cpp_build_seconds=round(sum(dict(r.stages)["build"]
                                                                               for r in builds), 3),
                          cpp_added_ms=round(1000 * statistics.median(added), 1))
        aiocompile.torch.uninstall()
    if os.environ.get("BENCH_TIMELINE") == "1":
        result["timeline"] = [f"{at:6.2f} s {what}" for at, what in sorted(timeline)]
    print(json.dumps(result), flush=True)


def describe(event: object) -> tuple[float, str]:
    """A worker event or a job's record, as (seconds from the program's start, a line)."""
    if not hasattr(event, "queued_at"):  # a worker's life
        warm_up = " (warm-up)" if getattr(event, "warm_up", False) else ""
        return (getattr(event, "time", time.time()) - T0_WALL,
                f"worker {getattr(event, 'event', '?')}{warm_up} pid {getattr(event, 'pid', '?')}")
    queued = getattr(event, "queued_at", time.time())
    stages = ", ".join(f"{stage} {seconds:.2f}" for stage, seconds in getattr(event, "stages", ()))
    wait = getattr(event, "queue_wait", None)
    return queued - T0_WALL, (f"{getattr(event, 'backend', type(event).__name__)} {getattr(event, 'outcome', '')} "
                              f"{getattr(event, 'name', '') or ''}: answered at "
                              f"{getattr(event, 'finished_at', queued) - T0_WALL:.2f} s"
                              f"{f', queued {wait:.2f} s' if wait else ''}{f' ({stages})' if stages else ''}")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return f"{platform.processor() or 'CPU'} ({os.cpu_count()} CPUs)"


def start_up(sched: object, workers: int) -> None:
    """A server's start-up before its first request, through public calls only. Stock:
    Inductor's compile pool started and waited for. aiocompile (``install()`` already
    called): ``AsyncCompile.warm_pool()``, which ``install()`` turns into starting and
    readying its workers (Inductor calls it in ``torch.compile``), then a wait until every
    worker is up and none is busy with its warm-up."""
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.warm_pool()
    AsyncCompile.wakeup()
    AsyncCompile.wait_pool_ready(timeout=300)
    if sched is None:
        return
    deadline = time.monotonic() + 300
    while len(sched.worker_pids()) < workers or sched.statistics().busy_workers:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise RuntimeError(f"aiocompile's workers not ready within 300 s: {sched.statistics()}")  # type: ignore[attr-defined]
        time.sleep(0.02)


def measure(mode: str, name: str, scenario: str, device: str, timeout: float, cpu_backend: str = "cpp",
            timeline: bool = False) -> dict:
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, name, scenario, device],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "BENCH_CPU_BACKEND": cpu_backend, "PYTHONPATH": path,
                               "BENCH_TIMELINE": "1" if timeline else "0"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} {name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--models", default="mlp,attention,convnet")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="of cold,server")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where torch sees a GPU, else cpu")
    parser.add_argument("--cpu-backend", choices=("cpp", "halide"), default="cpp", help="Inductor's CPU kernels")
    parser.add_argument("--timeline", action="store_true", help="print each measurement's timeline")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "MODEL", "SCENARIO", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    device = args.device or default_device()
    names = [n for n in args.models.split(",") if n]
    scenarios = [n for n in args.scenarios.split(",") if n]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))} (of {', '.join(SCENARIOS)})")
    runs: list[dict] = []
    for round_ in range(args.repeat):
        for scenario in scenarios:
            for name in names:
                pair = {}
                for mode in (MODES if round_ % 2 == 0 else MODES[::-1]):
                    run = pair[mode] = measure(mode, name, scenario, device, args.timeout, args.cpu_backend,
                                               args.timeline)
                    run["round"] = round_ + 1
                    runs.append(run)
                    extra = f", {run['compiled']} compiled in workers" if mode == "aiocompile" else ""
                    if device == "cpu":
                        extra += f", {run['cpp_libraries']} C++ libraries built"
                        if "cpp_added_ms" in run:
                            extra += f", {run['cpp_added_ms']} ms added per build"
                    print(f"round {round_ + 1} {scenario:8} {name:9} {mode:10} {run['seconds']:7.2f} s "
                          f"(matches eager: {run['matches_eager']}{extra})", flush=True)
                    for line in run.pop("timeline", ()):
                        print(f"    {line}")
                ratio = pair["aiocompile"]["seconds"] / pair["stock"]["seconds"]
                print(f"round {round_ + 1} {scenario:8} {name:9} ratio      {ratio:7.2f} (aiocompile / stock)",
                      flush=True)
    if runs:
        print(f"\n{runs[0]['device']}, torch {runs[0]['torch']}, {runs[0]['workers']} compile workers, "
              f"median of {args.repeat}, fresh process and caches each; cold: from the program's start, "
              f"server: after each way's public start-up")
    print(f"{'scenario':9} {'model':10} {'stock s':>9} {'aiocompile s':>13} {'ratio':>7} {'per round':>10} "
          f"{'kernels':>8}")
    for scenario in scenarios:
        for name in names:
            mine = [r for r in runs if (r["model"], r["scenario"]) == (name, scenario)]
            times = {mode: statistics.median(r["seconds"] for r in mine if r["mode"] == mode) for mode in MODES}
            # Each round's two measurements ran back to back: their ratio is steadier than
            # the ratio of medians where other work on the machine comes and goes.
            rounds: dict[int, dict[str, float]] = {}
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
