"""Eager calls beside the load's imports, and how long after each call began the import
thread stood aside: where a background thread of aiocompile's holds the interpreter lock
with no point at which to stand aside.

Each round is a fresh process (the imports happen once a process): a model of 40 small
``Linear`` + ``ReLU`` pairs on the CPU (about 80 operators, each letting the lock go, as a
GPU model's launches do) is called every 4 ms, first alone (300 calls), then while the
Python form's load imports what it needs in a thread of its own (``ahead``, as a
background compile starts it), until those imports end. For each call: its time, and how
long after it began the import thread first stood aside (``aside``). Printed: the p50 and
p99 alone and beside the imports, the slowest calls with that delay and the function the
thread stood aside in, and the delays over 0.8 ms summed by that function.

``--walk torch`` makes the imports with torch's own walk over its CompositeImplicitAutograd
operators (``_torch/cia.py``'s pieces switched off); the default, ``pieces``, as aiocompile
makes them. ``--walk both`` alternates the two, a round each. The timestamps come from
wrapping internal functions, so this is a diagnostic of one mechanism, not a figure of
what a user meets: ``bench_cold_start.py`` is that.

    python benchmarks/aside_steps.py [--walk pieces|torch|both] [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PAUSE = 0.004
ALONE_CALLS = 300
LATE = 0.0008


def child(walk: str) -> dict[str, object]:
    import torch

    from aiocompile._base import aside
    from aiocompile._torch import ahead, cia

    if walk == "torch":
        cia.in_pieces = contextlib.nullcontext  # type: ignore[assignment]
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[m for _ in range(40) for m in (torch.nn.Linear(8, 8), torch.nn.ReLU())]).eval()
    x = torch.randn(1, 8)
    clock = time.perf_counter
    state: dict[str, object] = {"began": 0.0, "first": None, "where": None}
    stand_aside = aside._stand_aside

    def noted() -> None:
        if state["first"] is None:
            state["first"] = clock() - state["began"]  # type: ignore[operator]
            entered = sys._getframe(2)
            caller = entered.f_back
            state["where"] = (f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_code.co_name}"
                              if caller is not None else "?") + f" -> {entered.f_code.co_name}"
        stand_aside()

    aside._stand_aside = noted
    calls: list[tuple[float, float | None, str | None]] = []

    def call() -> None:
        state["first"] = None
        aside.serve_begin()
        began = state["began"] = clock()
        try:
            with torch.no_grad():
                model(x)
        finally:
            aside.serve_end()
        calls.append((clock() - began, state["first"], state["where"]))  # type: ignore[arg-type]

    for _ in range(50):
        call()
    calls.clear()
    for _ in range(ALONE_CALLS):
        call()
        time.sleep(PAUSE)
    alone = [c[0] for c in calls]
    calls.clear()
    began = clock()
    ahead.start("python")
    finished = ahead.finished("python")
    while finished is not None and not finished.done():
        call()
        time.sleep(PAUSE)
    late: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for _, first, where in calls:
        if first is not None and first > LATE and where is not None:
            late[where] += first
            count[where] += 1
    return {"walk": walk, "imports_s": clock() - began, "alone": alone, "beside": [c[0] for c in calls],
            "slowest": sorted(calls, key=lambda c: -c[0])[:10],
            "late": [(where, total, count[where]) for where, total in late.most_common(8)]}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--walk", default="pieces", choices=("pieces", "torch", "both"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    walks = ["pieces", "torch"] if args.walk == "both" else [args.walk]
    ratios: dict[str, list[float]] = {walk: [] for walk in walks}
    for round_ in range(args.rounds):
        for walk in walks:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", walk],
                                  capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            alone, beside = result["alone"], result["beside"]
            ratio = quantile(beside, 0.99) / quantile(alone, 0.99)
            ratios[walk].append(ratio)
            print(f"round {round_ + 1}, walk {walk}: imports {result['imports_s']:.2f} s; calls alone p50 "
                  f"{quantile(alone, 0.5) * 1e3:.2f} ms, p99 {quantile(alone, 0.99) * 1e3:.2f} ms; beside them "
                  f"({len(beside)} calls) p50 {quantile(beside, 0.5) * 1e3:.2f} ms, p99 "
                  f"{quantile(beside, 0.99) * 1e3:.2f} ms ({ratio:.2f}x), max {max(beside) * 1e3:.2f} ms")
            for length, first, where in result["slowest"][:5]:
                delay = "never" if first is None else f"after {first * 1e3:.2f} ms in {where}"
                print(f"    {length * 1e3:5.2f} ms call; stood aside {delay}")
            for where, total, count in result["late"]:
                print(f"    late by over {LATE * 1e3:.1f} ms: {count:3d} times, {total * 1e3:6.1f} ms in all, "
                      f"in {where}")
    for walk, values in ratios.items():
        print(f"walk {walk}: p99 beside the imports against alone: {', '.join(f'{v:.2f}x' for v in values)}")


if __name__ == "__main__":
    main()
