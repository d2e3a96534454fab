"""A cold server's first seconds: ``compile_in_background`` beside stock ``torch.compile``,
public API only, nothing prepared before the clock.

Each way runs in a fresh interpreter with empty Inductor and Triton caches; the clock starts
at the program's start (before ``import torch``). Inside a running asyncio loop with a 1 ms
ticker, the program builds a model (``--model``), wraps it, and calls it every ``--pause``
seconds until a call is answered by the compiled version. Reported per way:
``import aiocompile.torch``'s time, the wrapper's constructor time, the first call's
latency beside eager's, when compiled answers began (seconds from the program's start),
the eager calls' p99/max meanwhile (on a GPU each call is synchronised, so its latency is
the GPU's too), the loop's longest stall from the wrapper's making on (the ticker's longest gap less its
1 ms; for the ``server`` way, after ``warm()``, whose own is printed apart) and its stalls
over 10 ms with when they began, the interpreter's full garbage collections over
10 ms (a stall of every thread, whoever's allocation set it off: with torch imported a
full collection walks several hundred thousand objects), ``status()`` and ``close()``
times, and the ratio of compiled-from to stock's.

The ``server`` way pays the start-up first with the public ``await
aiocompile.torch.warm(device)`` (its time printed), and starts the clock after it: when
compiled answers began, against stock's first call.

Models: ``conv1d`` (a conv1d + MLP, batch 8 x 4 x 32), ``convnet`` (a small conv net with
an MLP head, batch 8 x 3 x 64 x 64), ``gpt2`` and ``llama`` (Hugging Face's, built from
small configs with random weights: 4 layers, width 256, batch 4 x 128 tokens, the logits
as output; ``pip install transformers``).

    python benchmarks/bench_cold_start.py [--model conv1d] [--device cpu|cuda] [--repeat 1]
        [--pause 0.005] [--ways stock,background,server] [--artifact auto|package|python]
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


def build(name: str, device: str) -> tuple:
    """The model and an input, made on ``device``."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "conv1d":
        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv = nn.Conv1d(4, 16, 3)
                self.head = nn.Sequential(nn.Linear(16 * 30, 64), nn.GELU(), nn.Linear(64, 8))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(torch.relu(self.conv(x)).flatten(1))

        return Net().eval().to(device), torch.randn(8, 4, 32, device=device)
    if name == "convnet":
        class ConvNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.features = nn.Sequential(
                    nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                    nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                    nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
                self.head = nn.Sequential(nn.Flatten(), nn.Linear(128 * 16, 256), nn.GELU(), nn.Linear(256, 10))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(self.features(x))

        return ConvNet().eval().to(device), torch.randn(8, 3, 64, 64, device=device)
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=256, vocab_size=8192, n_positions=256,
                                         use_cache=False)
        inner = transformers.GPT2LMHeadModel(config)
    elif name == "llama":
        config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=4, vocab_size=8192,
                                          max_position_embeddings=256, use_cache=False)
        inner = transformers.LlamaForCausalLM(config)
    else:
        raise SystemExit(f"unknown model {name!r}")

    class LogitsOf(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).logits

    return LogitsOf(inner).eval().to(device), torch.randint(0, 8192, (4, 128), device=device)


def child(way: str, pause: float, model_name: str, device: str, artifact: str, stall_stacks: float) -> dict:
    import asyncio
    import faulthandler
    import gc

    import torch

    torch.set_num_threads(1)
    model, x = build(model_name, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    collections: list[tuple[float, float]] = []  # (length, began at, from the program's start)
    collecting: dict[int, float] = {}

    def noted(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            collecting[2] = time.perf_counter()
        elif 2 in collecting:
            began = collecting.pop(2)
            if time.perf_counter() - began > 0.01:
                collections.append((time.perf_counter() - began, began - T0))

    gc.callbacks.append(noted)

    async def main() -> dict:
        gaps: list[float] = []
        stalls: list[tuple[float, float]] = []  # (length, began at, from the program's start)
        stop = False

        async def ticker() -> None:
            last = time.perf_counter()
            armed = 0.0
            while not stop:
                if stacks is not None and last - armed > 0.01:
                    # Rearmed every 10 ms (each arming starts a thread): a tick later than
                    # this makes faulthandler's own thread, which needs no interpreter
                    # lock, write every thread's stack.
                    faulthandler.dump_traceback_later(stall_stacks / 1e3 + 0.01, file=stacks)
                    armed = last
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last - 0.001)
                if now - last - 0.001 > 0.01:
                    stalls.append((now - last - 0.001, last - T0))
                last = now

        stacks = None
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        result: dict = {"way": way}
        with torch.no_grad():
            model(x)
            sync()
            began = time.perf_counter()
            expected = model(x)
            sync()
            result["eager_ms"] = (time.perf_counter() - began) * 1e3
            # The loop is watched from here: the model's own first runs (CUDA's and its
            # libraries' start) are the program's, whichever way it compiles (the ticker
            # notes the gap they made first).
            await asyncio.sleep(0.01)
            gaps.clear()
            stalls.clear()
            collections.clear()
            if stall_stacks:
                stacks = tempfile.TemporaryFile("w+")
            clock = T0
            if way != "stock":
                began = time.perf_counter()
                import aiocompile.torch as aiotorch

                result["import_ms"] = (time.perf_counter() - began) * 1e3
            if way == "server":
                # A server pays the start-up before it takes traffic; the clock starts after.
                began = time.perf_counter()
                await aiotorch.warm(device)
                result["warm_s"] = time.perf_counter() - began
                clock = time.perf_counter()
                result["loop_stall_in_warm_ms"] = max(gaps, default=0.0) * 1e3
                gaps.clear()
            began = time.perf_counter()
            if way == "stock":
                wrapped = torch.compile(model)
            else:
                wrapped = aiotorch.compile_in_background(model, artifact=artifact)
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

                timeline.append((time.time() - T0_WALL, "constructor returned"))
                # The wrapper's scheduler is made in a thread from the constructor on: it
                # is looked up in one too (the lookup waits for it).
                scheduler = await asyncio.to_thread(lambda: wrapped.scheduler)
                scheduler.subscribe(note)
            began = time.perf_counter()
            wrapped(x)
            sync()
            result["first_call_ms"] = (time.perf_counter() - began) * 1e3
            latencies = []
            if way != "stock":
                timeline.append((time.time() - T0_WALL, "first call answered (eager), compile started"))
                while wrapped.state(x) == "compiling":
                    await asyncio.sleep(pause)
                    began = time.perf_counter()
                    wrapped(x)
                    sync()
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
            result["equal"] = bool(torch.allclose(out, expected, rtol=1e-2, atol=1e-2))
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
        if stacks is not None:
            faulthandler.cancel_dump_traceback_later()
            stacks.seek(0)
            result["stall_stacks"] = stacks.read()[-60000:]
        result["loop_stall_max_ms"] = max(gaps) * 1e3
        result["stalls_over_10ms"] = [f"{began:.2f} s: {length * 1e3:.0f} ms"
                                      for length, began in sorted(stalls, reverse=True)[:5]]
        result["full_collections_over_10ms"] = [f"{began:.2f} s: {length * 1e3:.0f} ms"
                                                for length, began in sorted(collections, reverse=True)[:5]]
        if way != "stock":
            await wrapped.aclose()
            await wrapped.scheduler.aclose()
        return result

    return asyncio.run(main())


def measure(way: str, pause: float, model: str, device: str, artifact: str, stall_stacks: float) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="bench-inductor-"),
               TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="bench-triton-"))
    run = subprocess.run([sys.executable, __file__, "--child", way, "--pause", str(pause), "--model", model,
                          "--device", device, "--artifact", artifact, "--stall-stacks", str(stall_stacks)],
                         capture_output=True, text=True, env=env, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"{way} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--pause", type=float, default=0.005)
    parser.add_argument("--model", default="conv1d", choices=("conv1d", "convnet", "gpt2", "llama"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--artifact", default="auto", choices=("auto", "package", "python"),
                        help="compile_in_background's artifact= (auto: a package on the CPU, the Python form on a GPU)")
    parser.add_argument("--stall-stacks", type=float, default=0.0, metavar="MS",
                        help="print every thread's stack whenever the loop's ticker is this many ms (and up to "
                             "10 more) late (written by faulthandler's own thread, which needs no interpreter lock; "
                             "on a GPU host the background way's process died with it on, without a word)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.pause, args.model, args.device, args.artifact, args.stall_stacks)))
        return
    # As an installed package has it: aiocompile's modules compiled to bytecode (where
    # PYTHONDONTWRITEBYTECODE is set, each import would compile the source, holding the
    # interpreter lock, on the clock).
    import compileall

    import aiocompile

    compileall.compile_dir(os.path.dirname(aiocompile.__file__), quiet=1)
    ways = [way for way in args.ways.split(",") if way]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown or "stock" not in ways:
        raise SystemExit(f"--ways takes stock and any of {', '.join(WAYS[1:])}; got {args.ways!r}")
    print(f"model {args.model} on {args.device}, artifact={args.artifact}")
    for _ in range(args.repeat):
        runs = {way: measure(way, args.pause, args.model, args.device, args.artifact, args.stall_stacks)
                for way in ways}
        for result in runs.values():
            timeline = result.pop("timeline", ())
            stall_stacks = result.pop("stall_stacks", "")
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}))
            for line in timeline:
                print(f"  {result['way']}: {line}")
            if stall_stacks:
                print(f"  {result['way']}: stacks when the loop stalled:")
                print(stall_stacks)
        stock = runs["stock"]
        stock_first = stock["first_call_ms"] / 1e3
        if "background" in runs:
            cold = runs["background"]
            print(f"cold: compiled from {cold['compiled_from_s']:.1f} s, stock {stock['compiled_from_s']:.1f} s "
                  f"({cold['compiled_from_s'] / stock['compiled_from_s']:.2f}x stock); constructor "
                  f"{cold['constructor_ms']:.1f} ms; first call {cold['first_call_ms']:.1f} ms (eager "
                  f"{cold['eager_ms']:.2f} ms, stock's {stock['first_call_ms']:.0f} ms); eager while compiling p99 "
                  f"{cold.get('eager_p99_ms', 0):.2f} ms, max {cold.get('eager_max_ms', 0):.1f} ms; loop's longest "
                  f"stall {cold['loop_stall_max_ms']:.1f} ms (stock {stock['loop_stall_max_ms']:.0f} ms)")
        if "server" in runs:
            server = runs["server"]
            print(f"server (after warm(), {server['warm_s']:.1f} s): compiled from {server['compiled_from_s']:.1f} s "
                  f"after the clock, {server['compiled_from_s'] / stock_first:.2f}x stock's first call "
                  f"({stock_first:.1f} s); first call {server['first_call_ms']:.1f} ms; eager while compiling p99 "
                  f"{server.get('eager_p99_ms', 0):.2f} ms, max {server.get('eager_max_ms', 0):.1f} ms; loop's "
                  f"longest stall {server['loop_stall_max_ms']:.1f} ms (in warm() "
                  f"{server['loop_stall_in_warm_ms']:.0f} ms)")

if __name__ == "__main__":
    main()
