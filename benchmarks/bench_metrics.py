"""What measuring costs: the round trip of a trivial job with metrics off and on, in one run.

A trivial job (``await sched.run(abs, -1)``: pickle, send to a warm worker, run, answer,
wake the caller) is where a per-request cost shows most; a real compile takes 10^4 times
longer. Four schedulers take turns, in rounds, so that drift of the machine hits them all
alike:

- ``off``: ``SchedulerConfig(metrics=False)``, counters only;
- ``on``: the default, a record per request and worker events, the ``aiocompile``
  logger with no handler wanting them (how most programs run);
- ``on + event file``, ``on + callback``, ``on + DEBUG log handler``: one sink each (a
  JSON-lines file; an ``on_event`` callback; a logging handler taking every record);
- ``on + all sinks``: all three, and a Prometheus collector scraped once per round;
- for scale, the stdlib ``ProcessPoolExecutor`` through ``loop.run_in_executor``.

    python benchmarks/bench_metrics.py [--calls 400] [--rounds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda p: ordered[min(len(ordered) - 1, int(p * len(ordered)))]  # noqa: E731
    return {"p50_us": pick(0.50) * 1e6, "p90_us": pick(0.90) * 1e6, "mean_us": statistics.fmean(ordered) * 1e6,
            "n": len(ordered)}


async def main(calls: int, rounds: int) -> dict[str, object]:
    import aiocompile

    scratch = tempfile.mkdtemp(prefix="aiocompile-bench-metrics-")
    events: list[object] = []
    handler = logging.StreamHandler(io.StringIO())
    handler.setLevel(logging.DEBUG)
    registry = collector = None
    try:
        import prometheus_client

        from aiocompile.prometheus import SchedulerCollector
    except ImportError:
        prometheus_client = None  # type: ignore[assignment]

    off = aiocompile.Scheduler(config=aiocompile.SchedulerConfig(workers=1, metrics=False))
    on = aiocompile.Scheduler(workers=1)
    file_only = aiocompile.Scheduler(workers=1, event_log=os.path.join(scratch, "file-only.jsonl"))
    callback_only = aiocompile.Scheduler(workers=1, on_event=lambda event: None)
    log_only = aiocompile.Scheduler(workers=1)
    sinks = aiocompile.Scheduler(workers=1, event_log=os.path.join(scratch, "events.jsonl"), on_event=events.append)
    if prometheus_client is not None:
        registry = prometheus_client.CollectorRegistry()
        collector = SchedulerCollector(sinks)
        registry.register(collector)
    stdlib = cf.ProcessPoolExecutor(1)
    loop = asyncio.get_running_loop()
    logger = logging.getLogger("aiocompile")

    async def via_stdlib() -> object:
        return await loop.run_in_executor(stdlib, abs, -1)

    modes = {
        "off": lambda: off.run(abs, -1),
        "on": lambda: on.run(abs, -1),
        "on + event file": lambda: file_only.run(abs, -1),
        "on + callback": lambda: callback_only.run(abs, -1),
        "on + DEBUG log handler": lambda: log_only.run(abs, -1),
        "on + all sinks": lambda: sinks.run(abs, -1),
        "stdlib run_in_executor": via_stdlib,
    }
    samples: dict[str, list[float]] = {name: [] for name in modes}
    try:
        for call in modes.values():  # warm every worker and code path
            for _ in range(50):
                await call()
        for _ in range(rounds):
            for name, call in modes.items():
                logs = name in ("on + all sinks", "on + DEBUG log handler")
                if logs:
                    logger.addHandler(handler)
                    logger.setLevel(logging.DEBUG)
                for _ in range(calls):
                    started = time.perf_counter()
                    await call()
                    samples[name].append(time.perf_counter() - started)
                if logs:
                    logger.removeHandler(handler)
                    logger.setLevel(logging.NOTSET)
                if name == "on + all sinks":
                    if registry is not None:
                        prometheus_client.generate_latest(registry)
    finally:
        for sched in (off, on, file_only, callback_only, log_only, sinks):
            await sched.aclose()
        stdlib.shutdown()

    results = {name: summary(values) for name, values in samples.items()}
    base = results["off"]["p50_us"]
    for values in results.values():
        values["p50_vs_off"] = values["p50_us"] / base
    lines = open(os.path.join(scratch, "events.jsonl")).read().count("\n")
    return {"calls_per_mode": calls * rounds, "results": results, "event_lines": lines,
            "callbacks": len(events), "cpus": os.cpu_count()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json")
    options = parser.parse_args()
    report = asyncio.run(main(options.calls, options.rounds))
    print(f"dispatch round trip of a trivial job, {report['calls_per_mode']} calls each, "
          f"{report['cpus']} CPUs")
    print(f"{'':<26}{'p50 µs':>9}{'p90 µs':>9}{'mean µs':>9}{'p50 / off':>11}")
    for name, values in report["results"].items():  # type: ignore[union-attr]
        print(f"{name:<26}{values['p50_us']:9.1f}{values['p90_us']:9.1f}{values['mean_us']:9.1f}"
              f"{values['p50_vs_off']:11.2f}")
    print(f"(the file got {report['event_lines']} lines, the callback {report['callbacks']} events)")
    if options.json:
        with open(options.json, "w") as f:
            json.dump(report, f, indent=2)
