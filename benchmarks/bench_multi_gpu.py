"""Two GPUs: two autotuned kernels made ready to launch on each of two GPUs, Triton's own
autotuner against ``aiocompile.autotune(..., device=i)``.

The kernels are ``_autotune_kernels.py``'s 24-configuration fp16 matmul at 4096^3 and
Liger-Kernel's DyT; each GPU gets its own tensors. Each measurement is a fresh interpreter
with an empty Triton cache, the tensors made on both GPUs before the clock:

- ``triton``: the first ordinary launch of each kernel on each GPU, one after another
  (``with torch.cuda.device(i): kernel[grid](...)``): Triton compiles and times every
  configuration in this process for the first GPU, and reuses its choice on the second
  (its autotuner's cache is not per device), compiling the choice there;
- ``aiocompile``: the scheduler made on the clock, ``autotune(kernel, ..., device=i)`` for
  every kernel and GPU at once (``asyncio.gather``), then the same launches;
- ``aiocompile-server``: the scheduler made and warmed before the clock (``await
  sched.warm(benchmark=True)``, waiting for the benchmark processes of both GPUs).

Reported: the wall time to every kernel launched on every GPU, its ratio to Triton's, and
each output checked against torch on its GPU.

    python benchmarks/bench_multi_gpu.py [--repeat 3] [--modes triton,aiocompile,aiocompile-server]

Needs two CUDA GPUs of one model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

CASES = ("matmul_fp16_4096", "liger_dyt_fwd")
MODES = ("triton", "aiocompile", "aiocompile-server")


def _cases() -> dict[tuple[int, str], tuple[Any, ...]]:
    import _autotune_kernels as kernels
    import torch

    made = {}
    for device in (0, 1):
        with torch.cuda.device(device):
            for case in CASES:
                made[device, case] = kernels.CASES[case]()
        torch.cuda.synchronize(device)
    return made


def _launch_all(made: dict[tuple[int, str], tuple[Any, ...]]) -> dict[str, float]:
    import torch

    for (device, _), (kernel, args, kwargs, grid, _check) in made.items():
        with torch.cuda.device(device):
            kernel[grid](*args, **kwargs)
    for device in (0, 1):
        torch.cuda.synchronize(device)
    return {f"{case}@cuda:{device}": check() for (device, case), (_, _, _, _, check) in made.items()}


async def _aiocompile(made: dict[tuple[int, str], tuple[Any, ...]], sched: Any) -> None:
    await asyncio.gather(*(sched.autotune(kernel, *args, grid=grid, device=device, **kwargs)
                           for (device, _), (kernel, args, kwargs, grid, _check) in made.items()))


def one(mode: str) -> dict[str, Any]:
    import torch

    import aiocompile

    made = _cases()
    result: dict[str, Any] = {"mode": mode, "device": torch.cuda.get_device_name(0)}
    if mode == "triton":
        started = time.perf_counter()
        errors = _launch_all(made)
    elif mode == "aiocompile":
        async def cold() -> dict[str, float]:
            async with aiocompile.Scheduler() as sched:
                await _aiocompile(made, sched)
                result["benchmarks"] = sched.statistics().benchmarks
                return _launch_all(made)

        started = time.perf_counter()
        errors = asyncio.run(cold())
    else:
        async def server() -> dict[str, float]:
            async with aiocompile.Scheduler() as sched:
                await sched.warm(benchmark=True)
                pool = sched.port.tuner().pool()
                deadline = time.monotonic() + 300
                while pool.ready() != set(pool.devices) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                nonlocal started
                started = time.perf_counter()
                await _aiocompile(made, sched)
                result["benchmarks"] = sched.statistics().benchmarks
                return _launch_all(made)

        started = 0.0
        errors = asyncio.run(server())
    result["wall_s"] = time.perf_counter() - started
    result["max_error"] = errors
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)), flush=True)
        return
    modes = args.modes.split(",")
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(args.repeat):
        order = modes[round_ % len(modes):] + modes[:round_ % len(modes)]
        for mode in order:
            with tempfile.TemporaryDirectory(prefix="bench-multi-gpu-") as cache:
                env = dict(os.environ, TRITON_CACHE_DIR=cache)
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", mode], env=env,
                                      capture_output=True, text=True, timeout=900)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                print(f"round {round_ + 1} {mode}: FAILED\n{proc.stderr[-3000:]}", flush=True)
                continue
            row = json.loads(lines[-1])
            walls[mode].append(row["wall_s"])
            worst = max(row["max_error"].values())
            print(f"round {round_ + 1} {mode:18} {row['wall_s']:7.2f} s  largest error {worst:.3g}"
                  + (f"  configurations timed {row['benchmarks']}" if "benchmarks" in row else ""), flush=True)
    base = statistics.median(walls["triton"]) if walls.get("triton") else None
    print(f"\nmedians of {args.repeat}: two kernels ready on two GPUs")
    for mode, values in walls.items():
        if values:
            ratio = f"  {statistics.median(values) / base:.2f}x triton" if base else ""
            print(f"  {mode:18} {statistics.median(values):7.2f} s{ratio}")


if __name__ == "__main__":
    main()
