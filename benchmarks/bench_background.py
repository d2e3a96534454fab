"""Compiling in the background while serving: ``aiocompile.torch.compile_in_background``
beside stock ``torch.compile``, on the two transformer blocks of
``examples/torch_models.py`` (d=256, 4 heads, batch 4 x 128).

Each measurement is a fresh interpreter with empty Inductor and Triton caches (Inductor's
caches on, as by default: the Python form is made of their entries), the model already
run eagerly (CUDA and its libraries initialised before the clock), and the compile pools
started before the clock, as in a server that starts them at start-up. Calls come one
after another with a short pause between them (``--pause``), the way requests reach a
model. Ways:

- ``stock``: ``torch.compile(model)``; its first call compiles (everything waits);
- ``subprocess``: the same with ``TORCHINDUCTOR_FX_COMPILE_MODE=subprocess`` (Inductor's
  lowering in a subprocess, tracing here);
- ``background``: ``compile_in_background(model)``: every call answered at once, eagerly
  until the compiled version is in use;
- ``background_quiet``: the same with no call between the first and the compiled one (the
  compile's own time, without traffic competing for the CPUs);
- ``background_package``: ``compile_in_background(model, artifact="package")``: an
  AOTInductor package whatever the device (the default on a GPU is the Python form);
- ``export_thread``: ``torch.export`` run in a thread of the serving process while it
  answers eager calls (what exporting here, instead of in a worker, would cost).

Reported per way: eager latency p50/p99 with nothing compiling (the baseline, measured in
the same process first), the first call's latency, eager p50/p99/max while compiling (and
how many calls were answered meanwhile), the time until compiled (stock: its first call;
background: from the first call until a call is answered by the compiled version), the
CPU seconds the compile cost the serving process itself over that time (work that
competes with eager calls for the interpreter lock: for stock, all of its first call; for
the others, the process's CPU time less the calling thread's), the compiled latency p50,
and whether compiled outputs equal eager ones (``rtol=atol=1e-3``).

The serving process runs torch with ``--threads`` intra-op threads (default 1, so that
every eager call's work is the calling thread's and the split above is exact).

    python benchmarks/bench_background.py [--repeat 2] [--ways stock,subprocess,background,export_thread]
        [--device auto|cpu|cuda] [--pause 0.005] [--threads 1] [--json out.json]

Runs on the CPU (Inductor compiles C++ for it) and on a GPU (``--device auto`` picks CUDA
when torch sees one).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("stock", "subprocess", "background", "background_quiet", "background_package", "export_thread")
IDLE_CALLS = 200
COMPILED_CALLS = 50


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(way: str, device: str, pause: float, timeout: float, threads: int) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-triton-")
    os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="bench-cache-"))
    if way == "subprocess":
        os.environ["TORCHINDUCTOR_FX_COMPILE_MODE"] = "subprocess"
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import torch
    import torch_models  # noqa: F401 - importable by workers, by reference
    from torch._inductor import config

    config.fx_graph_cache = False
    torch.set_num_threads(threads)
    model, (x,) = torch_models.make("transformer", device=device)
    cuda = device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn, *args):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        out = fn(*args)
        sync()
        return out, time.perf_counter() - started

    with torch.no_grad():
        expected, _ = timed(model, x)
        for _ in range(10):
            timed(model, x)
        idle = []
        for _ in range(IDLE_CALLS):
            idle.append(timed(model, x)[1])
            time.sleep(pause)
    result: dict = {"way": way, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "pause": pause, "threads": threads, "load": os.getloadavg()[0], "idle_p50": percentile(idle, 0.5),
                    "idle_p99": percentile(idle, 0.99)}

    with torch.no_grad():
        if way in ("stock", "subprocess"):
            start_inductor_pool()
            compiled = torch.compile(model)
            cpu, started = cpu_seconds(), time.perf_counter()
            out, first = timed(compiled, x)
            result.update(first_call=first, to_compiled=time.perf_counter() - started,
                          parent_cpu=cpu_seconds() - cpu)
            calls = [timed(compiled, x)[1] for _ in range(COMPILED_CALLS)]
            result.update(compiled_p50=percentile(calls, 0.5), matches_eager=close(torch, out, expected))
        elif way in ("background", "background_quiet", "background_package"):
            result.update(background(torch, model, x, expected, timed, pause, timeout, quiet=way == "background_quiet",
                                     artifact="package" if way == "background_package" else "auto"))
        else:
            result.update(export_thread(torch, model, x, timed, pause))
    print(json.dumps(result), flush=True)


def start_inductor_pool() -> None:
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.warm_pool()
    AsyncCompile.wakeup()
    AsyncCompile.wait_pool_ready(timeout=300)


def close(torch, got, expected) -> bool:  # type: ignore[no-untyped-def]
    return bool(torch.allclose(got, expected, rtol=1e-3, atol=1e-3))


def background(torch, model, x, expected, timed, pause, timeout, quiet, artifact) -> dict:  # type: ignore[no-untyped-def]
    import aiocompile.torch as aiotorch
    from aiocompile._torch import export as _export

    compiled = aiotorch.compile_in_background(model, artifact=artifact)
    sched = compiled.scheduler
    # The pool started before the clock, its workers ready (warmed for the model's
    # device, as compile_in_background warms them), as at a server's start-up.
    form = artifact if artifact != "auto" else ("python" if x.device.type == "cuda" else "package")
    for future in sched.port.warm_workers(_export.warm_up, (x.device.type, form)):
        future.result(timeout=300)
    cpu, mine, started = cpu_seconds(), time.thread_time(), time.perf_counter()
    _, first = timed(compiled, x)
    during = []
    answered_compiled_at = None
    deadline = started + timeout
    while time.perf_counter() < deadline:
        time.sleep(pause)
        if quiet and compiled.state(x) == "compiling":
            continue
        out, seconds = timed(compiled, x)
        shape = compiled.status().shapes[0]
        if shape.compiled_calls:
            answered_compiled_at = time.perf_counter()
            break
        if shape.state == "failed":
            raise RuntimeError(f"the background compile failed: {shape.error}")
        during.append(seconds)
    if answered_compiled_at is None:
        raise RuntimeError(f"not compiled within {timeout} s")
    # The calling thread served the eager calls; everything else the process did meanwhile
    # was the compile's (packing, loading, the scheduler's threads).
    parent_cpu = (cpu_seconds() - cpu) - (time.thread_time() - mine)
    calls = [timed(compiled, x)[1] for _ in range(COMPILED_CALLS)]
    shape = compiled.status().shapes[0]
    compiled.close()
    return {
        "first_call": first, "to_compiled": answered_compiled_at - started, "parent_cpu": parent_cpu,
        "calls_while_compiling": len(during), "during_p50": percentile(during, 0.5),
        "during_p99": percentile(during, 0.99), "during_max": max(during) if during else None,
        "compiled_p50": percentile(calls, 0.5), "matches_eager": close(torch, out, expected),
        "stages": dict(shape.stages), "trial_max_abs_difference": shape.max_abs_difference, "form": shape.form,
    }


def export_thread(torch, model, x, timed, pause) -> dict:  # type: ignore[no-untyped-def]
    outcome: dict = {}

    def export() -> None:
        started = time.perf_counter()
        try:
            torch.export.export(model, (x,))
        except Exception as exc:  # noqa: BLE001 - what happens is the finding
            outcome["export_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        outcome["export_seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=export)
    cpu, mine, started = cpu_seconds(), time.thread_time(), time.perf_counter()
    thread.start()
    during = []
    failed_calls, first_failure = 0, None
    while thread.is_alive():
        try:
            during.append(timed(model, x)[1])
        except Exception as exc:  # noqa: BLE001 - a call that fails beside an export is the finding
            failed_calls += 1
            first_failure = first_failure or f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        time.sleep(pause)
    thread.join()
    return {**outcome, "failed_calls": failed_calls, "first_failed_call": first_failure,
            "parent_cpu": (cpu_seconds() - cpu) - (time.thread_time() - mine), "to_compiled": None,
            "calls_while_compiling": len(during), "during_p50": percentile(during, 0.5),
            "during_p99": percentile(during, 0.99), "during_max": max(during) if during else None,
            "wall": time.perf_counter() - started}


def measure(way: str, device: str, pause: float, timeout: float, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH", "")]))}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", way, device, str(pause),
                           str(timeout), str(threads)], capture_output=True, text=True, timeout=timeout + 300,
                          env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{way} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def summary(runs: list[dict]) -> dict:
    """Medians per way, and the ratios the targets speak of."""
    fields = ("idle_p50", "idle_p99", "first_call", "during_p50", "during_p99", "during_max", "to_compiled",
              "parent_cpu", "compiled_p50", "calls_while_compiling", "export_seconds")
    out: dict = {}
    for way in WAYS:
        rows = [run for run in runs if run["way"] == way]
        if not rows:
            continue
        entry: dict = {"runs": len(rows), "matches_eager": all(r.get("matches_eager", True) for r in rows)}
        for name in fields:
            values = [r[name] for r in rows if r.get(name) is not None]
            entry[name] = statistics.median(values) if values else None
        errors = [r["export_error"] for r in rows if r.get("export_error")]
        if errors:
            entry["export_errors"] = errors
        failures = [r["first_failed_call"] for r in rows if r.get("first_failed_call")]
        if failures:
            entry["failed_calls"] = sum(r.get("failed_calls", 0) for r in rows)
            entry["failed_call_errors"] = failures
        out[way] = entry
    back, quiet, stock = out.get("background"), out.get("background_quiet"), out.get("stock")
    if back and stock:
        out["ratios"] = {
            "first_call_minus_idle_p50_ms": (back["first_call"] - back["idle_p50"]) * 1e3,
            "p99_while_compiling_over_idle_p99": back["during_p99"] / back["idle_p99"],
            "to_compiled_over_stock": back["to_compiled"] / stock["to_compiled"],
        }
        if quiet:
            out["ratios"]["quiet_to_compiled_over_stock"] = quiet["to_compiled"] / stock["to_compiled"]
    return out


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--pause", type=float, default=0.005, help="seconds between calls")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a compile may take")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in the serving process")
    parser.add_argument("--json", help="write the runs and the summary here")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        way, device, pause, timeout, threads = args.child
        child(way, device, float(pause), float(timeout), int(threads))
        return
    device = args.device
    if device == "auto":
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                               capture_output=True, text=True)
        device = "cuda" if probe.stdout.strip() == "True" else "cpu"
    ways = [w for w in args.ways.split(",") if w]
    unknown = set(ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways: {', '.join(sorted(unknown))}")
    runs = []
    for round_ in range(args.repeat):
        for way in (ways if round_ % 2 == 0 else ways[::-1]):
            run = measure(way, device, args.pause, args.timeout, args.threads)
            runs.append(run)
            print(f"round {round_ + 1} {way:13} idle p99 {ms(run['idle_p99'])} ms, first call "
                  f"{ms(run.get('first_call'))} ms, during p99 {ms(run.get('during_p99'))} ms, to compiled "
                  f"{run.get('to_compiled') or 0:.2f} s, parent cpu {run.get('parent_cpu') or 0:.2f} s"
                  + (f", export: {run['export_error']}" if run.get("export_error") else "")
                  + (f", {run['failed_calls']} eager calls failed ({run['first_failed_call']})"
                     if run.get("failed_calls") else ""), flush=True)
    result = summary(runs)
    loads = ", ".join(f"{run['load']:.1f}" for run in runs)
    print(f"\n{runs[0]['device']}, torch {runs[0]['torch']}, median of {args.repeat}, a call every "
          f"{args.pause * 1e3:.0f} ms, {args.threads} intra-op thread(s); 1-minute load average at each "
          f"start: {loads}")
    print(f"{'way':14} {'idle p50':>9} {'idle p99':>9} {'first':>9} {'during p50':>11} {'during p99':>11} "
          f"{'during max':>11} {'calls':>6} {'compiled s':>11} {'parent cpu s':>13} {'compiled p50':>13} {'equal':>6}")
    for way in WAYS:
        row = result.get(way)
        if row is None:
            continue
        to_compiled = "-" if row["to_compiled"] is None else f"{row['to_compiled']:.2f}"
        calls = "-" if row["calls_while_compiling"] is None else f"{row['calls_while_compiling']:.0f}"
        print(f"{way:14} {ms(row['idle_p50']):>9} {ms(row['idle_p99']):>9} {ms(row['first_call']):>9} "
              f"{ms(row['during_p50']):>11} {ms(row['during_p99']):>11} {ms(row['during_max']):>11} {calls:>6} "
              f"{to_compiled:>11} {row['parent_cpu']:>13.2f} {ms(row['compiled_p50']):>13} "
              f"{str(row['matches_eager']):>6}")
    if "ratios" in result:
        r = result["ratios"]
        print(f"\nbackground: first call - eager p50 = {r['first_call_minus_idle_p50_ms']:.1f} ms (target <= 10); "
              f"eager p99 while compiling / without = {r['p99_while_compiling_over_idle_p99']:.2f} (target <= 1.5); "
              f"time to compiled / stock = {r['to_compiled_over_stock']:.2f} (target <= 1.3)"
              + (f"; without traffic {r['quiet_to_compiled_over_stock']:.2f}"
                 if "quiet_to_compiled_over_stock" in r else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "repeat": args.repeat, "pause": args.pause, "threads": args.threads,
                       "runs": runs,
                       "summary": result}, f, indent=1)


if __name__ == "__main__":
    main()
