"""A cold server's first seconds: ``compile_in_background`` beside stock ``torch.compile``,
public API only, nothing prepared before the clock.

Each way runs in a fresh interpreter with empty Inductor and Triton caches; the clock starts
at the program's start (before ``import torch``). Inside a running asyncio loop with a 1 ms
ticker, the program builds a small conv1d + MLP model, wraps it, and calls it every
``--pause`` seconds until a call is answered by the compiled version. Reported per way:
``import aiocompile.torch``'s time, the wrapper's constructor time, the first call's
latency beside eager's, when compiled answers began (seconds from the program's start),
the eager calls' p99/max meanwhile,
the loop's longest stall (the ticker's longest gap less its 1 ms), ``status()`` and
``close()`` times, and the ratio of compiled-from to stock's.

The ``server`` way pays the start-up first with the public ``await aiocompile.torch.warm()``
(its time printed), and starts the clock after it: when compiled answers began, against
stock's first call.

    python benchmarks/bench_cold_start.py [--repeat 1] [--pause 0.005]
"""

from __future__ import annotations

import time

T0 = time.perf_counter()
T0_WALL = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

WAYS = ("stock", "background", "server")


def child(way: str, pause: float) -> dict:
    import asyncio

    import torch
    from torch import nn

    torch.set_num_threads(1)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(4, 16, 3)
            self.head = nn.Sequential(nn.Linear(16 * 30, 64), nn.GELU(), nn.Linear(64, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.conv(x)).flatten(1))

    model, x = Net().eval(), torch.randn(8, 4, 32)

    async def main() -> dict:
        gaps: list[float] = []
        stalls: list[tuple[float, float]] = []  # (length, began at, from the program's start)
        stop = False

        async def ticker() -> None:
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last - 0.001)
                if now - last - 0.001 > 0.01:
                    stalls.append((now - last - 0.001, last - T0))
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        result: dict = {"way": way}
        with torch.no_grad():
            began = time.perf_counter()
            expected = model(x)
            result["eager_ms"] = (time.perf_counter() - began) * 1e3
            clock = T0
            if way != "stock":
                began = time.perf_counter()
                import aiocompile.torch as aiotorch

                result["import_ms"] = (time.perf_counter() - began) * 1e3
            if way == "server":
                # A server pays the start-up before it takes traffic; the clock starts after.
                began = time.perf_counter()
                await aiotorch.warm()
                result["warm_s"] = time.perf_counter() - began
                clock = time.perf_counter()
            began = time.perf_counter()
            if way == "stock":
                wrapped = torch.compile(model)
            else:
                wrapped = aiotorch.compile_in_background(model)
            result["constructor_ms"] = (time.perf_counter() - began) * 1e3
            timeline: list[tuple[float, str]] = []
            if way != "stock":
                # Worker events carry wall-clock times; they come from the pool's thread.
                def note(event: object) -> None:
                    what = getattr(event, "event", type(event).__name__)
                    detail = " ".join(str(part) for part in (getattr(event, "name", None),
                                                               getattr(event, "status", None),
                                                               "warm-up" if getattr(event, "warm_up", False) else None,
                                                               f"pid {getattr(event, 'pid', None)}")
                                      if part)
                    timeline.append((getattr(event, "time", time.time()) - T0_WALL, f"{what} {detail}"))

                wrapped.scheduler.subscribe(note)
                timeline.append((time.time() - T0_WALL, "constructor returned"))
            began = time.perf_counter()
            wrapped(x)
            result["first_call_ms"] = (time.perf_counter() - began) * 1e3
            latencies = []
            if way != "stock":
                timeline.append((time.time() - T0_WALL, "first call answered (eager), compile started"))
                while wrapped.state(x) == "compiling":
                    await asyncio.sleep(pause)
                    began = time.perf_counter()
                    wrapped(x)
                    latencies.append(time.perf_counter() - began)
                began = time.perf_counter()
                status = wrapped.status()
                result["status_ms"] = (time.perf_counter() - began) * 1e3
                result["state"] = status.shapes[0].state
                result["stages"] = {stage: round(seconds, 2) for stage, seconds in status.shapes[0].stages}
            result["compiled_from_s"] = time.perf_counter() - clock
            if way != "stock":
                timeline.append((time.time() - T0_WALL, "compiled answers from"))
                result["timeline"] = [f"{at:6.2f} s {what}" for at, what in sorted(timeline)]
            out = wrapped(x)
            result["equal"] = bool(torch.allclose(out, expected, rtol=1e-3, atol=1e-3))
            if latencies:
                ordered = sorted(latencies)
                result["eager_p99_ms"] = ordered[int(0.99 * (len(ordered) - 1))] * 1e3
                result["eager_max_ms"] = ordered[-1] * 1e3
            if way != "stock":
                began = time.perf_counter()
                wrapped.close()
                result["close_ms"] = (time.perf_counter() - began) * 1e3
                await asyncio.sleep(0.05)
        stop = True
        await task
        result["loop_stall_max_ms"] = max(gaps) * 1e3
        result["stalls_over_10ms"] = [f"{began:.2f} s: {length * 1e3:.0f} ms"
                                      for length, began in sorted(stalls, reverse=True)[:5]]
        if way != "stock":
            await wrapped.aclose()
            await wrapped.scheduler.aclose()
        return result

    return asyncio.run(main())


def measure(way: str, pause: float) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="bench-inductor-"),
               TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="bench-triton-"))
    run = subprocess.run([sys.executable, __file__, "--child", way, "--pause", str(pause)], capture_output=True,
                         text=True, env=env, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"{way} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--pause", type=float, default=0.005)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.pause)))
        return
    for _ in range(args.repeat):
        runs = {way: measure(way, args.pause) for way in WAYS}
        for result in runs.values():
            timeline = result.pop("timeline", ())
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}))
            for line in timeline:
                print(f"  {result['way']}: {line}")
        ratio = runs["background"]["compiled_from_s"] / runs["stock"]["compiled_from_s"]
        print(f"compiled from: background {runs['background']['compiled_from_s']:.1f} s, "
              f"stock {runs['stock']['compiled_from_s']:.1f} s ({ratio:.2f}x stock); "
              f"constructor {runs['background']['constructor_ms']:.1f} ms; first call "
              f"{runs['background']['first_call_ms']:.1f} ms (eager {runs['background']['eager_ms']:.2f} ms, stock's "
              f"{runs['stock']['first_call_ms']:.0f} ms); loop's longest stall "
              f"{runs['background']['loop_stall_max_ms']:.1f} ms (stock {runs['stock']['loop_stall_max_ms']:.0f} ms)")
        server, stock_first = runs["server"], runs["stock"]["first_call_ms"] / 1e3
        print(f"server (after warm(), {server['warm_s']:.1f} s): compiled from {server['compiled_from_s']:.1f} s after "
              f"the clock, {server['compiled_from_s'] / stock_first:.2f}x stock's first call ({stock_first:.1f} s); "
              f"first call {server['first_call_ms']:.1f} ms; loop's longest stall {server['loop_stall_max_ms']:.1f} ms")


if __name__ == "__main__":
    main()
