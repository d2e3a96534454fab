"""What packing a model for a background compile costs the serving thread: the wait for the
interpreter lock.

``compile_in_background`` packs the model (``aiocompile/_torch/parcel.py``) in a
thread of the serving process, right after the call that met a new signature, while
further calls go on. Copying the weights holds the interpreter lock. A serving thread that
lets go of the lock (a GPU synchronisation, a socket's write; here ``time.sleep(0)``, then
a little Python work, as a call does) waits to get it back; without the packer offering
it, the wait is the switch interval (5 ms) or more. Measured both ways, in rounds that
alternate: the packer as it is (the lock offered before each tensor), and the same
packer with that offer taken out. Reported: the packing's own time, and the serving
thread's waits (p50, p99, max) while it ran.

    python benchmarks/bench_packing.py [--tensors 200] [--kib 256] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import types
from typing import Any

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def model_with(tensors: int, kib: int, local: bool) -> Any:
    """A module of ``tensors`` buffers of ``kib`` KiB: its class in this script (``__main__``,
    pickled by reference with its source alongside) or local to this function (pickled by
    value with cloudpickle, as a notebook's class is)."""

    class Local(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    model = Local() if local else Weights()
    for index in range(tensors):
        model.register_buffer(f"w{index}", torch.randn(kib * 256))
    return model


class Weights(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def one(model: Any, offered: bool) -> dict[str, float]:
    from aiocompile._torch import parcel

    # Without the offer: the packer's sleep(0) before each tensor made a no-op.
    parcel.time = time if offered else types.SimpleNamespace(sleep=lambda seconds: None)  # type: ignore[assignment]
    waits: list[float] = []
    done = threading.Event()
    took: list[float] = []

    def pack() -> None:
        started = time.perf_counter()
        parcel.pack(model)
        took.append(time.perf_counter() - started)
        done.set()

    try:
        packer = threading.Thread(target=pack)
        packer.start()
        while not done.is_set():
            started = time.perf_counter()
            time.sleep(0)
            waits.append(time.perf_counter() - started)
            total = 0
            for value in range(2000):  # a call's own Python work, holding the lock
                total += value
        packer.join()
    finally:
        parcel.time = time
    waits.sort()
    return {"pack_ms": took[0] * 1e3, "waits": len(waits), "wait_p50_ms": waits[len(waits) // 2] * 1e3,
            "wait_p99_ms": waits[min(len(waits) - 1, int(len(waits) * 0.99))] * 1e3, "wait_max_ms": waits[-1] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--kib", type=int, default=256, help="KiB per tensor")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--by-value", action="store_true",
                        help="the model's class local to a function: pickled by cloudpickle")
    parser.add_argument("--json")
    args = parser.parse_args()
    model = model_with(args.tensors, args.kib, args.by_value)
    from aiocompile._torch import parcel

    print(f"packed as: {parcel.pack(model).how}")
    rows: dict[str, list[dict[str, float]]] = {"offered": [], "not offered": []}
    for round_ in range(args.rounds):
        for way in (("not offered", "offered") if round_ % 2 == 0 else ("offered", "not offered")):
            row = one(model, way == "offered")
            rows[way].append(row)
            print(f"round {round_ + 1} {way:12} pack {row['pack_ms']:7.1f} ms, {row['waits']:5} waits: p50 "
                  f"{row['wait_p50_ms']:6.3f} ms, p99 {row['wait_p99_ms']:7.3f} ms, max {row['wait_max_ms']:7.3f} ms",
                  flush=True)
    print(f"\n{args.tensors} tensors of {args.kib} KiB, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"medians of {args.rounds} rounds")
    summary = {way: {name: statistics.median(row[name] for row in got) for name in got[0]}
               for way, got in rows.items()}
    for way, row in summary.items():
        print(f"{way:12} pack {row['pack_ms']:7.1f} ms  wait p50 {row['wait_p50_ms']:6.3f} ms  "
              f"p99 {row['wait_p99_ms']:7.3f} ms  max {row['wait_max_ms']:7.3f} ms")
    ratio = summary["offered"]["wait_p99_ms"] / summary["not offered"]["wait_p99_ms"]
    print(f"wait p99, offered / not offered: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
