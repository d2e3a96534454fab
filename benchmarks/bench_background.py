"""Compiling in the background while serving: ``aiocompile.torch.compile_in_background``
beside stock ``torch.compile``, on the two transformer blocks of
``examples/torch_models.py`` (d=256, 4 heads, batch 4 x 128).

Public API only: nothing is prepared before the clock but through calls a program can
make. Each measurement is a fresh interpreter with empty Inductor and Triton caches
(Inductor's caches on, as by default: the Python form is made of their entries). The
program imports torch, builds the model and runs it once eagerly (its expected output;
CUDA and its libraries initialised), then takes calls one after another with a short pause
between them (``--pause``), the way requests reach a model. Ways:

- ``stock``: ``torch.compile(model)``, nothing prepared; its first call compiles
  (everything waits);
- ``stock_pool``: the same after Inductor's own compile pool was started and waited for
  before the clock (``AsyncCompile.warm_pool()``, ``wait_pool_ready()``: torch's calls, a
  server's start-up for stock);
- ``subprocess``: ``stock`` with ``TORCHINDUCTOR_FX_COMPILE_MODE=subprocess`` (Inductor's
  lowering in a subprocess, tracing here);
- ``cold``: ``compile_in_background(model)``, nothing prepared: every call answered at once,
  eagerly until the compiled version is in use;
- ``server``: ``await aiocompile.torch.warm(device)`` first (its time reported), then the
  clock, then ``compile_in_background(model)`` as in ``cold``;
- ``server_quiet``: ``server`` with no call between the first and the compiled one (the
  compile's own time, without traffic competing for the CPUs);
- ``server_package``: ``server`` with ``artifact="package"``: an AOTInductor package
  whatever the device (the default on a GPU is the Python form);
- ``export_thread``: ``torch.export`` run in a thread of the serving process while it
  answers eager calls (what exporting here, instead of in a worker, would cost).

Two clocks. "Compiled from start": from the program's start (``time.perf_counter()`` taken
before ``import torch``) until a call is answered by the compiled version (stock: the end
of its first call): the ``cold`` ratio is ``cold`` over ``stock``. "To compiled": from the
first call (the clock of ``stock_pool`` and ``server``, whose start-up came before it):
the ``server`` ratio is ``server`` over ``stock`` (its first call) and over
``stock_pool``.

Reported per way: eager latency p50/p99 with nothing compiling (the baseline, measured in
the same process once the way is done), the first call's latency, eager p50/p99/max while
compiling (and how many calls were answered meanwhile), both clocks, the CPU seconds the
compile cost the serving process itself from the first call until compiled (work that
competes with eager calls for the interpreter lock: for stock, all of its first call; for
the others, the process's CPU time less the calling thread's), the compiled latency p50,
and whether compiled outputs equal eager ones (``rtol=atol=1e-3``).

The serving process runs torch with ``--threads`` intra-op threads (default 1, so that
every eager call's work is the calling thread's and the split above is exact).

    python benchmarks/bench_background.py [--repeat 2] [--ways stock,cold,server]
        [--device auto|cpu|cuda] [--pause 0.005] [--threads 1] [--json out.json]

Runs on the CPU (Inductor compiles C++ for it) and on a GPU (``--device auto`` picks CUDA
when torch sees one).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("stock", "stock_pool", "subprocess", "cold", "server", "server_quiet", "server_package", "export_thread")
DEFAULT_WAYS = ("stock", "stock_pool", "cold", "server", "server_quiet")
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
    result: dict = {"way": way, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "pause": pause, "threads": threads, "load": os.getloadavg()[0]}
    scheduler = None
    # A server's start-up, before the clock, through public calls only.
    if way == "stock_pool":
        began = time.perf_counter()
        start_inductor_pool()
        result["start_up"] = time.perf_counter() - began
    elif way.startswith("server"):
        import asyncio

        import aiocompile.torch as aiotorch

        began = time.perf_counter()
        scheduler = asyncio.run(aiotorch.warm(device))
        result["start_up"] = time.perf_counter() - began

    with torch.no_grad():
        if way in ("stock", "stock_pool", "subprocess"):
            from torch._inductor import config

            # This process compiles: no FX graph cache, so that it compiles everything.
            config.fx_graph_cache = False
            compiled = torch.compile(model)
            cpu, started = cpu_seconds(), time.perf_counter()
            out, first = timed(compiled, x)
            now = time.perf_counter()
            result.update(first_call=first, to_compiled=now - started, compiled_from_start=now - T0,
                          parent_cpu=cpu_seconds() - cpu)
            calls = [timed(compiled, x)[1] for _ in range(COMPILED_CALLS)]
            result.update(compiled_p50=percentile(calls, 0.5), matches_eager=close(torch, out, expected))
        elif way in ("cold", "server", "server_quiet", "server_package"):
            result.update(background(torch, model, x, expected, timed, pause, timeout, quiet=way == "server_quiet",
                                     artifact="package" if way == "server_package" else "auto"))
        else:
            result.update(export_thread(torch, model, x, timed, pause))
        # The baseline: eager calls with nothing compiling, in this same process.
        for _ in range(10):
            timed(model, x)
        idle = []
        for _ in range(IDLE_CALLS):
            idle.append(timed(model, x)[1])
            time.sleep(pause)
    result.update(idle_p50=percentile(idle, 0.5), idle_p99=percentile(idle, 0.99))
    if scheduler is not None:
        scheduler.close()
    print(json.dumps(result), flush=True)


def start_inductor_pool() -> None:
    """Stock's start-up: Inductor's own compile pool, started and waited for."""
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.warm_pool()
    AsyncCompile.wakeup()
    AsyncCompile.wait_pool_ready(timeout=300)


def close(torch, got, expected) -> bool:  # type: ignore[no-untyped-def]
    return bool(torch.allclose(got, expected, rtol=1e-3, atol=1e-3))


def background(torch, model, x, expected, timed, pause, timeout, quiet, artifact) -> dict:  # type: ignore[no-untyped-def]
    import aiocompile.torch as aiotorch

    began = time.perf_counter()
    compiled = aiotorch.compile_in_background(model, artifact=artifact)
    constructor = time.perf_counter() - began
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
        "constructor": constructor, "first_call": first, "to_compiled": answered_compiled_at - started,
        "compiled_from_start": answered_compiled_at - T0, "parent_cpu": parent_cpu,
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
              "compiled_from_start", "start_up", "parent_cpu", "compiled_p50", "calls_while_compiling",
              "export_seconds")
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
    found = ratios(out)
    if found:
        out["ratios"] = found
    return out


def ratios(by_way: dict) -> dict:
    """The ratios of one round's runs, or of the medians: ``by_way`` maps a way to its
    run (or its medians)."""
    stock, pool = by_way.get("stock"), by_way.get("stock_pool")
    out: dict = {}
    cold = by_way.get("cold")
    if cold and stock:
        # Both clocks from the program's start, nothing prepared.
        out["cold_from_start_over_stock"] = cold["compiled_from_start"] / stock["compiled_from_start"]
    for way in ("server", "server_quiet", "server_package"):
        row = by_way.get(way)
        if not row:
            continue
        # The clock after the start-up: the first call until compiled answers, against
        # stock's first call (all of its compile) and stock's after its own pool's start.
        if stock:
            out[f"{way}_to_compiled_over_stock"] = row["to_compiled"] / stock["first_call"]
        if pool:
            out[f"{way}_to_compiled_over_stock_pool"] = row["to_compiled"] / pool["first_call"]
    for way in ("server", "cold"):
        row = by_way.get(way)
        if row and row.get("idle_p50") is not None:
            out[f"{way}_first_call_minus_idle_p50_ms"] = (row["first_call"] - row["idle_p50"]) * 1e3
            if row.get("during_p99") is not None:
                out[f"{way}_p99_while_compiling_over_idle_p99"] = row["during_p99"] / row["idle_p99"]
    return out


def describe_ratios(found: dict) -> list[str]:
    lines = []
    if "cold_from_start_over_stock" in found:
        lines.append(f"cold: compiled from the program's start / stock's = {found['cold_from_start_over_stock']:.2f}")
    for way in ("server", "server_quiet", "server_package"):
        if f"{way}_to_compiled_over_stock" in found or f"{way}_to_compiled_over_stock_pool" in found:
            parts = [f"{way} (after warm()): to compiled / stock's first call = "
                     f"{found.get(f'{way}_to_compiled_over_stock', float('nan')):.2f}"
                     + (" (target <= 1.3)" if way == "server" else "")]
            if f"{way}_to_compiled_over_stock_pool" in found:
                parts.append(f"/ stock_pool's = {found[f'{way}_to_compiled_over_stock_pool']:.2f}")
            lines.append(", ".join(parts))
    for way in ("server", "cold"):
        if f"{way}_first_call_minus_idle_p50_ms" in found:
            lines.append(f"{way}: first call - eager p50 = {found[f'{way}_first_call_minus_idle_p50_ms']:.1f} ms "
                         f"(target <= 10); eager p99 while compiling / without = "
                         f"{found.get(f'{way}_p99_while_compiling_over_idle_p99', float('nan')):.2f} (target <= 1.5)")
    return lines


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--ways", default=",".join(DEFAULT_WAYS), help=f"of {','.join(WAYS)}")
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
        pair = {}
        for way in (ways if round_ % 2 == 0 else ways[::-1]):
            run = pair[way] = measure(way, device, args.pause, args.timeout, args.threads)
            run["round"] = round_ + 1
            runs.append(run)
            start_up = f", start-up {run['start_up']:.2f} s before the clock" if run.get("start_up") else ""
            from_start = (f", compiled from the program's start {run['compiled_from_start']:.2f} s"
                          if run.get("compiled_from_start") else "")
            print(f"round {round_ + 1} {way:14} idle p99 {ms(run['idle_p99'])} ms, first call "
                  f"{ms(run.get('first_call'))} ms, during p99 {ms(run.get('during_p99'))} ms, to compiled "
                  f"{run.get('to_compiled') or 0:.2f} s{from_start}{start_up}, parent cpu "
                  f"{run.get('parent_cpu') or 0:.2f} s"
                  + (f", export: {run['export_error']}" if run.get("export_error") else "")
                  + (f", {run['failed_calls']} eager calls failed ({run['first_failed_call']})"
                     if run.get("failed_calls") else ""), flush=True)
        for line in describe_ratios(ratios(pair)):
            print(f"round {round_ + 1} {line}", flush=True)
    result = summary(runs)
    loads = ", ".join(f"{run['load']:.1f}" for run in runs)
    print(f"\n{runs[0]['device']}, torch {runs[0]['torch']}, median of {args.repeat}, a call every "
          f"{args.pause * 1e3:.0f} ms, {args.threads} intra-op thread(s); 1-minute load average at each "
          f"start: {loads}")
    print(f"{'way':15} {'idle p50':>9} {'idle p99':>9} {'first':>9} {'during p50':>11} {'during p99':>11} "
          f"{'during max':>11} {'calls':>6} {'to compiled s':>14} {'from start s':>13} {'start-up s':>11} "
          f"{'parent cpu s':>13} {'compiled p50':>13} {'equal':>6}")
    for way in WAYS:
        row = result.get(way)
        if row is None:
            continue
        to_compiled = "-" if row["to_compiled"] is None else f"{row['to_compiled']:.2f}"
        from_start = "-" if row["compiled_from_start"] is None else f"{row['compiled_from_start']:.2f}"
        start_up = "-" if row["start_up"] is None else f"{row['start_up']:.2f}"
        calls = "-" if row["calls_while_compiling"] is None else f"{row['calls_while_compiling']:.0f}"
        print(f"{way:15} {ms(row['idle_p50']):>9} {ms(row['idle_p99']):>9} {ms(row['first_call']):>9} "
              f"{ms(row['during_p50']):>11} {ms(row['during_p99']):>11} {ms(row['during_max']):>11} {calls:>6} "
              f"{to_compiled:>14} {from_start:>13} {start_up:>11} {row['parent_cpu']:>13.2f} "
              f"{ms(row['compiled_p50']):>13} {str(row['matches_eager']):>6}")
    if "ratios" in result:
        print()
        for line in describe_ratios(result["ratios"]):
            print(f"median: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "repeat": args.repeat, "pause": args.pause, "threads": args.threads,
                       "runs": runs,
                       "summary": result}, f, indent=1)


if __name__ == "__main__":
    main()
