"""torch.compile(mode="max-autotune") wall time: stock Inductor against Inductor with
aiocompile installed, public API only.

The model: an fp16 MLP 1024 -> 4096 -> 1024 (GELU), batch 256, on the GPU (this benchmark
needs one, and says so without). Each measurement is a fresh interpreter with empty
Inductor and Triton caches and no FX graph cache. Stock Inductor precompiles the template
choices (in its compile pool once that is ready, else in threads of the process) and times
them in the process; with aiocompile, every choice compiles in the pool's workers and is
timed in a benchmark process. Four ways:

- ``stock``, ``aiocompile`` (cold): the clock starts at the program's start (before
  ``import torch``) and stops at the first output of ``torch.compile(model,
  mode="max-autotune")``; the program imports torch (with aiocompile, imports
  ``aiocompile.torch`` and calls ``install()`` at once, as a program that installs at its
  start does), builds the model and runs it once eagerly (CUDA and cuBLAS initialised),
  then compiles;
- ``stock-server``, ``aiocompile-server``: each way's start-up is paid first, through
  public calls, as a server pays it before its first request, then the clock runs from
  ``torch.compile`` to the first output. Stock: Inductor's modules imported and its compile
  pool started and waited for (``AsyncCompile.warm_pool()``, ``wait_pool_ready()``,
  torch's own). aiocompile: ``install()``, ``AsyncCompile.warm_pool()`` (which
  ``install()`` turns into starting and readying its workers), ``await
  sched.warm(target, benchmark=True)`` for this GPU's architecture (each worker's compiler
  set up, the benchmark process started), and a wait until ``worker_pids()`` counts every
  worker and ``statistics()`` none busy.

Each run has an empty bytecode directory of aiocompile's own (``AIOCOMPILE_BYTECODE_DIR``,
used where the installation has no bytecode): a host's first start. Set the variable to
one directory to measure later starts.

Stock and aiocompile alternate, their order swapped each round; both use as many compile
workers as Inductor would. The outputs are checked against eager. Each round prints the
cold ratio (aiocompile / stock) and the server ratio (aiocompile-server / stock-server).
Each run also reports what Inductor says its autotuning took ("AUTOTUNE benchmarking takes
... precompiling ...", summed over the matmuls) and, with aiocompile, what became of each
choice.

    python benchmarks/bench_maxautotune.py [--repeat 2] [--modes stock,aiocompile,stock-server,aiocompile-server]
        [--json out.json]

With ``BENCH_MAXAUTOTUNE_TRACE=1`` each run also prints its timeline (see
``maxautotune_trace.py``; from the clock's start): when the choices were submitted and
waited for, where they compiled, the pool's jobs and workers.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()
T0_WALL = time.time()

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("stock", "aiocompile")
SERVER_MODES = ("stock-server", "aiocompile-server")
_RATIOS = (("cold", "aiocompile", "stock"), ("server", "aiocompile-server", "stock-server"),
           ("server against cold stock", "aiocompile-server", "stock"))
_AUTOTUNE_LINE = re.compile(r"AUTOTUNE benchmarking takes ([0-9.]+) seconds and ([0-9.]+) seconds precompiling "
                            r"for (\d+) choices")
NO_GPU = "bench_maxautotune.py needs a CUDA GPU (max-autotune tunes GPU matmul templates); torch sees none here"


def child(mode: str) -> None:
    inductor_dir = tempfile.mkdtemp(prefix="bench-inductor-")
    triton_dir = tempfile.mkdtemp(prefix="bench-triton-")
    try:
        measure_in_child(mode, inductor_dir, triton_dir)
    finally:
        for path in (inductor_dir, triton_dir):
            shutil.rmtree(path, ignore_errors=True)


def measure_in_child(mode: str, inductor_dir: str, triton_dir: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
    os.environ["TRITON_CACHE_DIR"] = triton_dir
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    import torch
    from torch._inductor import config

    if not torch.cuda.is_available():
        raise SystemExit(NO_GPU)
    config.fx_graph_cache = False
    workers = config.decide_compile_threads() if config.compile_threads is None else config.compile_threads
    server = mode.endswith("-server")
    started = T0
    records: list = []
    sched = None
    breakdown: list[str] = []
    if mode.startswith("aiocompile"):
        import logging

        import aiocompile.records
        import aiocompile.torch

        # Each choice's breakdown in its benchmark process (see _autotune's debug log).
        handler = logging.Handler(logging.DEBUG)
        handler.emit = lambda record: breakdown.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("aiocompile").addHandler(handler)
        logging.getLogger("aiocompile").setLevel(logging.DEBUG)

        os.environ["AIOCOMPILE_WORKERS"] = str(workers)
        sched = aiocompile.torch.install()
        sched.subscribe(lambda event: records.append(event) if isinstance(event, aiocompile.records.BenchmarkRecord)
                        else None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    model = model.half().cuda().eval()
    x = torch.randn(256, 1024, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        expected = model(x)  # CUDA and cuBLAS initialised (on the clock when cold)
    torch.cuda.synchronize()
    start_up = None
    if server:
        began = time.perf_counter()
        start_server(sched, workers)
        start_up = time.perf_counter() - began
        started = time.perf_counter()
    trace = None
    if os.environ.get("BENCH_MAXAUTOTUNE_TRACE") == "1":
        from maxautotune_trace import Trace

        trace = Trace(T0_WALL + (started - T0))  # the timeline starts with the clock
        if sched is not None:
            trace.hook_aiocompile(sched)
        trace.hook_inductor()
    with torch.no_grad():
        out = torch.compile(model, mode="max-autotune")(x)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    result = {
        "mode": mode, "seconds": elapsed, "start_up": start_up, "workers": workers,
        "matches_eager": bool(torch.allclose(out, expected, rtol=1e-2, atol=1e-2)),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cpus": os.cpu_count(),
    }
    if sched is not None:
        choices = [r for r in records if r.config != "warm-up"]
        stats = sched.statistics()
        result.update(compiled=stats.compiled, failed=stats.failed, worker_crashes=stats.worker_crashes,
                      compile_seconds_in_workers=round(stats.run_time.total, 3),
                      choices=dict(collections.Counter(r.outcome for r in choices)),
                      benchmark_seconds_in_processes=round(sum(r.finished_at - r.started_at for r in choices), 3),
                      failures=sorted({(r.reason or "").splitlines()[0][:120] for r in choices if r.outcome != "ok"}))
        parts = [re.search(r"rebuilt in ([0-9.]+) s, benchmark\(\) ([0-9.]+) s, of which Triton compiled "
                           r"([0-9.]+) s, cache hit (\w+)", line) for line in breakdown]
        found = [p.groups() for p in parts if p]
        if found:
            result.update(per_choice_rebuild_s=round(statistics.median(float(f[0]) for f in found), 3),
                          per_choice_benchmark_call_s=round(statistics.median(float(f[1]) for f in found), 3),
                          triton_compile_s_in_benchmark_processes=round(sum(float(f[2]) for f in found), 3),
                          triton_cache_hits=dict(collections.Counter(f[3] for f in found)))
        aiocompile.torch.uninstall()
    result["cubins"] = sum(name.endswith(".cubin") for _, _, names in os.walk(triton_dir) for name in names)
    if trace is not None:
        result["trace"] = trace.summary()
    print(json.dumps(result), flush=True)


def start_server(sched: object, workers: int) -> None:
    """A server's start-up before its first request, through public calls only. Stock:
    Inductor's modules imported and its compile pool started and waited for. aiocompile
    (``install()`` already called): the same call of torch's, which ``install()`` turns into
    starting and readying its workers, then ``Scheduler.warm`` for this GPU's architecture
    with the benchmark process, and a wait until every worker is up and none is busy."""
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.select_algorithm  # noqa: F401
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.warm_pool()
    AsyncCompile.wait_pool_ready()
    if sched is None:
        return
    import asyncio

    import torch

    major, minor = torch.cuda.get_device_capability()
    asyncio.run(sched.warm(f"cuda:{major}{minor}", benchmark=True))  # type: ignore[attr-defined]
    deadline = time.monotonic() + 300
    while len(sched.worker_pids()) < workers or sched.statistics().busy_workers:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise RuntimeError(f"aiocompile's workers not ready within 300 s: {sched.statistics()}")  # type: ignore[attr-defined]
        time.sleep(0.05)


def measure(mode: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH", "")]))}
    # Each run a host's first start: aiocompile's bytecode directory (for packages installed
    # without bytecode) empty, unless AIOCOMPILE_BYTECODE_DIR names one for every run.
    env.setdefault("AIOCOMPILE_BYTECODE_DIR", tempfile.mkdtemp(prefix="bench-aiocompile-bytecode-"))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode], capture_output=True,
                          text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1])
    # What Inductor says of each autotuning (one line per matmul).
    found = [tuple(float(v) for v in m.groups()) for m in _AUTOTUNE_LINE.finditer(proc.stdout + proc.stderr)]
    result["inductor_benchmark_s"] = round(sum(f[0] for f in found), 3)
    result["inductor_precompile_s"] = round(sum(f[1] for f in found), 3)
    result["inductor_choices"] = int(sum(f[2] for f in found))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--modes", default=",".join((*MODES, *SERVER_MODES)),
                        help="of stock,aiocompile,stock-server,aiocompile-server")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--child", metavar="MODE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    asked = [m for m in args.modes.split(",") if m]
    unknown = set(asked) - {*MODES, *SERVER_MODES}
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}")
    modes = tuple(m for m in (*MODES, *SERVER_MODES) if m in asked)
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != "True":
        parser.exit(2, f"{NO_GPU}{': ' + probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else ''}\n")
    runs: list[dict] = []
    for round_ in range(args.repeat):
        pair = {}
        for mode in (modes if round_ % 2 == 0 else modes[::-1]):
            run = pair[mode] = measure(mode, args.timeout)
            run["round"] = round_ + 1
            runs.append(run)
            extra = ""
            if mode.startswith("aiocompile"):
                extra = (f", {run['compiled']} compiled in workers, choices {run['choices']}, "
                         f"{run['benchmark_seconds_in_processes']} s timing in benchmark processes; per choice "
                         f"there: rebuilt {run.get('per_choice_rebuild_s')} s, benchmark() "
                         f"{run.get('per_choice_benchmark_call_s')} s; Triton compiled "
                         f"{run.get('triton_compile_s_in_benchmark_processes')} s there, cache hits "
                         f"{run.get('triton_cache_hits')}")
            start_up = f"after a {run['start_up']:.2f} s start-up, " if run.get("start_up") is not None else ""
            print(f"round {round_ + 1} {mode:17} {run['seconds']:7.2f} s ({start_up}matches eager: "
                  f"{run['matches_eager']}, "
                  f"{run['cubins']} cubins, "
                  f"Inductor: {run['inductor_choices']} choices, precompile {run['inductor_precompile_s']} s, "
                  f"benchmark {run['inductor_benchmark_s']} s{extra})", flush=True)
        for name, ours, theirs in _RATIOS:
            if ours in pair and theirs in pair:
                print(f"round {round_ + 1} {name}: {ours} / {theirs} = "
                      f"{pair[ours]['seconds'] / pair[theirs]['seconds']:.2f}", flush=True)
        for mode, run in pair.items():
            for failure in run.get("failures", []):
                print(f"    {mode} failed choice: {failure}")
            for line in run.get("trace", []):
                print(f"    {mode} trace: {line}")
    if not runs:
        return
    first = runs[0]
    print(f"\n{first['device']}, {first['cpus']} CPUs, torch {first['torch']}, {first['workers']} compile workers, "
          f"fp16 MLP 1024-4096-1024 batch 256, mode=max-autotune, median of {args.repeat}, fresh process and caches; "
          "cold: from the program's start, server: after each way's public start-up")
    times = {mode: statistics.median(r["seconds"] for r in runs if r["mode"] == mode) for mode in modes}
    print(", ".join(f"{mode} {seconds:.2f} s" for mode, seconds in times.items()))
    for name, ours, theirs in _RATIOS:
        if ours in times and theirs in times:
            print(f"{name}: {ours} / {theirs} = {times[ours] / times[theirs]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
