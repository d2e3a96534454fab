"""One benchmark, from two checkouts of aiocompile, in alternating rounds: before and after
a change, in one run, on one machine.

Each round runs ``python <checkout>/benchmarks/<benchmark> <args> --json <file>`` for one
checkout, then the other (the order alternating from round to round, so that drift of
the machine hits both alike), each in a fresh process that imports that checkout's
``aiocompile``. The figures are every number in the benchmark's JSON report; each is
printed with its median over the rounds for each checkout and the ratio after/before.
``--only`` keeps the figures whose path contains one of its words.

    python benchmarks/ab.py --before ../old-checkout --rounds 5 --only p50_us,max_ms \\
        bench_dispatch.py --rounds 2

The checkout given by ``--after`` defaults to this one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def figures(report: Any, path: str = "") -> dict[str, float]:
    """Every number in a JSON report, by its path (``results/aiocompile/p50_us``)."""
    found: dict[str, float] = {}
    if isinstance(report, dict):
        for name, value in report.items():
            found.update(figures(value, f"{path}/{name}" if path else str(name)))
    elif isinstance(report, list):
        for index, value in enumerate(report):
            found.update(figures(value, f"{path}/{index}"))
    elif isinstance(report, (int, float)) and not isinstance(report, bool):
        found[path] = float(report)
    return found


def run_once(checkout: str, benchmark: str, args: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="aiocompile-ab-") as scratch:
        out = os.path.join(scratch, "report.json")
        env = {**os.environ, "PYTHONPATH": checkout + os.pathsep + os.environ.get("PYTHONPATH", "")}
        done = subprocess.run([sys.executable, os.path.join(checkout, "benchmarks", benchmark), *args, "--json", out],
                              cwd=checkout, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{benchmark} failed in {checkout} (exit {done.returncode}):\n"
                             f"{done.stdout}\n{done.stderr}")
        with open(out) as f:
            return figures(json.load(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the checkout before the change")
    parser.add_argument("--after", default=HERE, help="the checkout after it (default: this one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated words: keep the figures whose path has one")
    parser.add_argument("--json", help="write every round's figures here too")
    parser.add_argument("benchmark", help="a file under benchmarks/, as both checkouts have it")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    options = parser.parse_args()
    checkouts = {"before": os.path.abspath(options.before), "after": os.path.abspath(options.after)}
    rounds: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for round_ in range(options.rounds):
        order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
        for which in order:
            rounds[which].append(run_once(checkouts[which], options.benchmark, options.args))
        print(f"round {round_ + 1}/{options.rounds} done", file=sys.stderr, flush=True)
    words = [word for word in options.only.split(",") if word]
    names = [name for name in rounds["after"][0] if name in rounds["before"][0]
             and (not words or any(word in name for word in words))]
    width = max((len(name) for name in names), default=10)
    print(f"{options.benchmark} {' '.join(options.args)}: {options.rounds} rounds, medians")
    print(f"{'figure':<{width}} {'before':>11} {'after':>11} {'after/before':>13}")
    for name in names:
        before = statistics.median(r[name] for r in rounds["before"])
        after = statistics.median(r[name] for r in rounds["after"])
        ratio = f"{after / before:13.3f}" if before else f"{'-':>13}"
        print(f"{name:<{width}} {before:11.3f} {after:11.3f} {ratio}")
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"checkouts": checkouts, "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
