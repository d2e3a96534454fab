"""A cold server's first seconds: ``compile_in_background`` beside stock ``torch.compile``,
public API only, nothing prepared before the clock.

Each way runs in a fresh interpreter with empty Inductor and Triton caches; the clock starts
at the program's start (before ``import torch``). Inside a running asyncio loop with a 1 ms
ticker, the program builds a model (``--model``), wraps it, and calls it every ``--pause``
seconds until a call is answered by the compiled version. Reported per way:
``import aiocompile.torch``'s time, the wrapper's constructor time, the first call's
latency beside eager's, when compiled answers began (seconds from the program's start),
the eager calls' p99/max meanwhile (on a GPU each call is synchronised, so its latency is
the GPU's too) and their p99 alone (as many calls as were made while compiling, 300 to
3,000, made the same way after the compile, nothing beside them), and their p50s, the
slowest eager calls while compiling with when they began (on a GPU, each split into the
time to return, its launches, and the wait for the GPU), how many calls over 1.3x the p99
alone began in each half second (which stage the p99 comes from; ``--slow-call-stacks MS``
prints what every thread ran during the calls that passed MS ms, ``--stall-stacks`` and
``--long-calls`` what held the loop), the loop's longest stall from the wrapper's making on
(the ticker's longest gap less its 1 ms; the ``import aiocompile.torch`` made in the loop
just before, and for the ``server`` way ``warm()``, have theirs printed apart) and its
stalls over 10 ms with when they began, the interpreter's full garbage collections over
10 ms (a stall of every thread, whoever's allocation set it off: with torch imported a
full collection walks several hundred thousand objects), ``status()`` and ``close()``
times, and the ratio of compiled-from to stock's.

aiocompile's own bytecode directory (``AIOCOMPILE_BYTECODE_DIR``, for modules installed
without bytecode where Python writes none) is one of the run's own, empty at the start:
with ``--repeat 2`` the first round is a host's first start, the second a later one.

The ``server`` way pays the start-up first with the public ``await
aiocompile.torch.warm(device)`` (its time printed), and starts the clock after it: when
compiled answers began, against stock's first call.

Each way's process leaves torch's intra-op thread count as torch sets it (one per core), as a
program that sets none does; ``--threads N`` sets N in every way.

Models: ``conv1d`` (a conv1d + MLP, batch 8 x 4 x 32), ``convnet`` (a small conv net with
an MLP head, batch 8 x 3 x 64 x 64), ``gpt2`` and ``llama`` (Hugging Face's, built from
small configs with random weights: 4 layers, width 256, batch 4 x 128 tokens, the logits
as output; ``pip install transformers``).

    python benchmarks/bench_cold_start.py [--model conv1d] [--device cpu|cuda] [--repeat 1]
        [--pause 0.005] [--ways stock,background,server] [--artifact auto|package|python]
        [--stall-stacks MS] [--slow-call-stacks MS] [--long-calls MS] [--threads N]
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

import _cold_start_watch as watch  # noqa: E402

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


def child(way: str, pause: float, model_name: str, device: str, artifact: str, stall_stacks: float,
          long_calls: float = 0.0, call_stacks: float = 0.0, thread_times: bool = False,
          process_times: bool = False) -> dict:
    processes = watch.ProcessTimes(T0) if process_times else None
    import asyncio
    import gc

    import torch

    threads = int(os.environ.get("BENCH_TORCH_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
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
            while not stop:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                if sampler is not None:
                    sampler.beat = now
                if len(gaps) % 20 == 0:
                    for noting in (times, processes):
                        if noting is not None:
                            noting.note_names()
                gaps.append(now - last - 0.001)
                if now - last - 0.001 > 0.01:
                    stalls.append((now - last - 0.001, last - T0))
                last = now

        sampler = None
        times = watch.ThreadTimes(T0) if thread_times else None
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
            if stall_stacks or call_stacks:
                sampler = watch.StallSampler(T0, stall_stacks / 1e3, call_stacks / 1e3)
            clock = T0
            calls: list[tuple[float, float, str, str]] = []
            if long_calls:
                watch.long_calls(long_calls / 1e3, calls, T0)
            if way != "stock":
                began = time.perf_counter()
                import aiocompile.torch as aiotorch

                result["import_ms"] = (time.perf_counter() - began) * 1e3
                # The import is the program's line, as ``import torch`` is (most programs
                # make it at their top, before a loop runs): its stall is printed apart, and
                # the loop is watched from the wrapper's making on.
                await asyncio.sleep(0.002)
                result["loop_stall_in_import_ms"] = max(gaps, default=0.0) * 1e3
                gaps.clear()
                stalls.clear()
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
            latencies: list[float] = []
            began_at: list[float] = []  # when each began, from the program's start
            launches: list[float] = []  # how long each took to return, before the sync

            def timed_call(fn: object) -> tuple[object, float, float, float]:
                """``fn(x)``, synchronised: (its output, when it began, how long it took to
                return, how long in all); the sampler, if any, told of the call."""
                began = time.perf_counter()
                if sampler is not None:
                    sampler.call_began = began
                out = fn(x)  # type: ignore[operator]
                launched = time.perf_counter()
                sync()
                taken = time.perf_counter() - began
                if sampler is not None:
                    sampler.call_began = None
                return out, began, launched - began, taken
            if way != "stock":
                timeline.append((time.time() - T0_WALL, "first call answered (eager), compile started"))
                while wrapped.state(x) == "compiling":
                    await asyncio.sleep(pause)
                    _, began, launch, taken = timed_call(wrapped)
                    latencies.append(taken)
                    launches.append(launch)
                    began_at.append(began - T0)
                began = time.perf_counter()
                status = wrapped.status()
                result["status_ms"] = (time.perf_counter() - began) * 1e3
                result["state"] = status.shapes[0].state
                result["stages"] = {stage: round(seconds, 2) for stage, seconds in status.shapes[0].stages}
                timeline.append((time.time() - T0_WALL, "state compiled"))
                # On a GPU the first calls after the switch may still be answered eagerly,
                # each making one of the compiled version's convolution plans in this
                # thread: they count as eager calls, and compiled answers begin with the
                # first call the compiled version answers (its ``compiled_calls``).
                result["calls_after_the_switch_eager"] = 0
                while result["state"] == "compiled" and wrapped.status().shapes[0].compiled_calls == 0:
                    await asyncio.sleep(pause)
                    out, began, launch, taken = timed_call(wrapped)
                    if wrapped.status().shapes[0].compiled_calls:
                        result["first_compiled_call_ms"] = taken * 1e3
                        break
                    latencies.append(taken)
                    launches.append(launch)
                    began_at.append(began - T0)
                    result["calls_after_the_switch_eager"] += 1
            result["compiled_from_s"] = time.perf_counter() - clock
            if way != "stock":
                timeline.append((time.time() - T0_WALL, "compiled answers from"))
                result["timeline"] = [f"{at:6.2f} s {what}" for at, what in sorted(timeline)]
            if "first_compiled_call_ms" not in result:
                began = time.perf_counter()
                out = wrapped(x)
                sync()
                result["first_compiled_call_ms"] = (time.perf_counter() - began) * 1e3
            if latencies:
                ordered = sorted(latencies)
                result["eager_p99_ms"] = ordered[int(0.99 * (len(ordered) - 1))] * 1e3
                result["eager_max_ms"] = ordered[-1] * 1e3
                result["eager_p50_ms"] = ordered[len(ordered) // 2] * 1e3
                slowest = sorted(range(len(latencies)), key=latencies.__getitem__)[-SLOWEST_CALLS:]
                # On a GPU: the time to return (the launches) + the wait for the GPU.
                def split(i: int) -> str:
                    waited = latencies[i] - launches[i]
                    return f" ({launches[i] * 1e3:.2f} + {waited * 1e3:.2f})" if device == "cuda" else ""

                result["slowest_calls"] = [f"{began_at[i]:6.2f} s: {latencies[i] * 1e3:.2f} ms{split(i)}"
                                           for i in sorted(slowest)]
                ordered_launches = sorted(launches)
                result["eager_p99_launch_ms"] = ordered_launches[int(0.99 * (len(ordered_launches) - 1))] * 1e3
            if way != "stock":
                began = time.perf_counter()
                wrapped.close()
                result["close_ms"] = (time.perf_counter() - began) * 1e3
                await asyncio.sleep(0.05)
                # The eager calls' p99 with no compile beside them, the same way (calls
                # every --pause seconds, the ticker running): what the p99 while
                # compiling is held against.
                alone = []
                alone_launches = []
                # As many as were made while compiling (within bounds): a p99 is held
                # against one of as many samples, not the 3rd slowest of 300.
                for _ in range(min(max(len(latencies), ALONE_CALLS), ALONE_CALLS_MAX)):
                    await asyncio.sleep(pause)
                    began = time.perf_counter()
                    model(x)
                    launched = time.perf_counter()
                    sync()
                    alone.append(time.perf_counter() - began)
                    alone_launches.append(launched - began)
                alone.sort()
                alone_launches.sort()
                result["eager_alone_p99_launch_ms"] = alone_launches[int(0.99 * (len(alone_launches) - 1))] * 1e3
                result["eager_alone_p99_ms"] = alone[int(0.99 * (len(alone) - 1))] * 1e3
                result["eager_alone_p50_ms"] = alone[len(alone) // 2] * 1e3
                # Where the calls over 1.3x the p99 alone were made: how many began in each
                # half second (from the program's start), which stage the p99 comes from.
                over = 1.3 * alone[int(0.99 * (len(alone) - 1))]
                bins: dict[float, int] = {}
                for at, taken in zip(began_at, latencies):
                    if taken > over:
                        bins[int(at * 2) / 2] = bins.get(int(at * 2) / 2, 0) + 1
                result["calls_over_1_3x_by_half_second"] = " ".join(f"{at:.1f}:{n}" for at, n in sorted(bins.items()))
        stop = True
        await task
        # After the ticker: a first comparison's own start (its kernels loaded) is the
        # benchmark's, not a stall of the way's.
        result["equal"] = bool(torch.allclose(out, expected, rtol=1e-2, atol=1e-2))
        if sampler is not None:
            sampler.stop = True
            result["stall_stacks"] = sampler.report()
        result["loop_stall_max_ms"] = max(gaps) * 1e3
        result["stalls_over_10ms"] = [f"{began:.2f} s: {length * 1e3:.0f} ms"
                                      for length, began in sorted(stalls, reverse=True)[:5]]
        result["full_collections_over_10ms"] = [f"{began:.2f} s: {length * 1e3:.0f} ms"
                                                for length, began in sorted(collections, reverse=True)[:5]]
        if times is not None:
            slowest = sorted(range(len(latencies)), key=latencies.__getitem__)[-SLOWEST_CALLS * 2:]
            result["thread_times"] = times.report([(began_at[i] + T0, latencies[i]) for i in sorted(slowest)])
        if processes is not None:
            result["process_times"] = processes.report(clock + result["compiled_from_s"])
        if long_calls:
            result["long_calls"] = [f"{began:.2f} s: {length * 1e3:.0f} ms in {thread}: {what}"
                                    for began, length, thread, what in sorted(calls)[:60]]
        if way != "stock":
            await wrapped.aclose()
            await wrapped.scheduler.aclose()
        return result

    return asyncio.run(main())


SLOWEST_CALLS = 12
"""The slowest eager calls while compiling, printed with when they began: where the p99 comes
from (with ``--stall-stacks``/``--long-calls``, what ran beside them)."""

ALONE_CALLS = 300
ALONE_CALLS_MAX = 3000
"""Eager calls made after the compile, with nothing beside them, for the p99 baseline: as
many as were made while compiling, at least ``ALONE_CALLS`` and at most ``ALONE_CALLS_MAX``."""


def measure(way: str, pause: float, model: str, device: str, artifact: str, stall_stacks: float,
            long_calls: float, call_stacks: float = 0.0, thread_times: bool = False,
            process_times: bool = False) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="bench-inductor-"),
               TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="bench-triton-"))
    run = subprocess.run([sys.executable, __file__, "--child", way, "--pause", str(pause), "--model", model,
                          "--device", device, "--artifact", artifact, "--stall-stacks", str(stall_stacks),
                          "--long-calls", str(long_calls), "--slow-call-stacks", str(call_stacks)]
                         + (["--thread-times"] if thread_times else [])
                         + (["--process-times"] if process_times else []),
                         capture_output=True, text=True, env=env, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"{way} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _against_alone(result: dict) -> str:
    alone = result.get("eager_alone_p99_ms")
    if not alone or "eager_p99_ms" not in result:
        return "no p99 alone"
    return f"{result['eager_p99_ms'] / alone:.2f}x the p99 alone, {alone:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--pause", type=float, default=0.005)
    parser.add_argument("--model", default="conv1d", choices=("conv1d", "convnet", "gpt2", "llama"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--artifact", default="auto", choices=("auto", "package", "python"),
                        help="compile_in_background's artifact= (auto: the Python form, on the CPU and on a GPU)")
    parser.add_argument("--stall-stacks", type=float, default=0.0, metavar="MS",
                        help="print every thread's Python stack whenever the loop's ticker is this many ms late "
                             "(a thread of the benchmark's looks every millisecond), for the longest stalls")
    parser.add_argument("--long-calls", type=float, default=0.0, metavar="MS",
                        help="print the C calls of this many ms or more made by threads started after the model's "
                             "warm-up (those of the wrapper, its scheduler and the pool): what can hold the "
                             "interpreter lock away from the loop (a diagnostic: the profiling slows those threads)")
    parser.add_argument("--slow-call-stacks", type=float, default=0.0, metavar="MS",
                        help="print every thread's Python stack whenever an eager call made while compiling has "
                             "run this many ms (at most 60 calls): what ran beside the slowest calls")
    parser.add_argument("--thread-times", action="store_true",
                        help="for the slowest eager calls while compiling, how long each thread of the process "
                             "was on a CPU during the call (read by a process of its own from /proc, Linux)")
    parser.add_argument("--process-times", action="store_true",
                        help="where the CPUs went from the program's start until compiled answers: the CPU time "
                             "of each of the process's threads and of every process it started (fork server, "
                             "workers, compilers, others), and what was left idle (read every 50 ms by a process "
                             "of its own from /proc, Linux)")
    parser.add_argument("--bytecode", action="store_true",
                        help="first compile the bytecode of every installed package into a directory of the run's "
                             "own, read by every way (PYTHONPYCACHEPREFIX): as pip leaves an install, for machines "
                             "whose packages have none and that may not write it (PYTHONDONTWRITEBYTECODE), where "
                             "every import compiles its module's source, holding the interpreter lock")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch.set_num_threads(N) in every way's process before the model is built; 0 "
                             "(default) leaves torch's own count, as a program that sets none has it (one thread "
                             "per core, which spin a while between the eager calls)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child:
        os.environ["BENCH_TORCH_THREADS"] = str(args.threads)
    if (args.thread_times or args.process_times) and not os.path.isdir(f"/proc/{os.getpid()}/task"):
        parser.error("--thread-times and --process-times read /proc (Linux)")
    if args.child:
        print(json.dumps(child(args.child, args.pause, args.model, args.device, args.artifact, args.stall_stacks,
                               args.long_calls, args.slow_call_stacks, args.thread_times, args.process_times)))
        return
    # As an installed package has it: aiocompile's modules compiled to bytecode (where
    # PYTHONDONTWRITEBYTECODE is set, each import would compile the source, holding the
    # interpreter lock, on the clock).
    import compileall

    import aiocompile

    if args.bytecode:
        import site
        import sysconfig

        sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="bench-pycache-")
        began = time.perf_counter()
        roots = {sysconfig.get_paths()["purelib"], *site.getsitepackages(), os.path.dirname(os.path.dirname(
            aiocompile.__file__))}
        for root in sorted(root for root in roots if os.path.isdir(root)):
            compileall.compile_dir(root, quiet=2, workers=0)
        print(f"bytecode of the installed packages compiled in {time.perf_counter() - began:.1f} s")
    else:
        compileall.compile_dir(os.path.dirname(aiocompile.__file__), quiet=1)
    # aiocompile's own bytecode (for modules that have none, where Python writes none):
    # a directory of the run's own, empty at first, so the first round is a host's first
    # start and the later rounds read what it wrote, as a server's later starts do.
    if "AIOCOMPILE_BYTECODE_DIR" not in os.environ:
        os.environ["AIOCOMPILE_BYTECODE_DIR"] = tempfile.mkdtemp(prefix="bench-aiocompile-bytecode-")
    ways = [way for way in args.ways.split(",") if way]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown or "stock" not in ways:
        raise SystemExit(f"--ways takes stock and any of {', '.join(WAYS[1:])}; got {args.ways!r}")
    print(f"model {args.model} on {args.device}, artifact={args.artifact}, torch threads "
          f"{args.threads or 'as torch sets them'}")
    for round_ in range(args.repeat):
        folder = os.environ["AIOCOMPILE_BYTECODE_DIR"]
        files = sum(len(names) for _, _, names in os.walk(folder)) if os.path.isdir(folder) else 0
        print(f"round {round_ + 1}: aiocompile's bytecode directory {folder} holds {files} files")
        runs = {way: measure(way, args.pause, args.model, args.device, args.artifact, args.stall_stacks,
                             args.long_calls, args.slow_call_stacks, args.thread_times, args.process_times)
                for way in ways}
        for result in runs.values():
            timeline = result.pop("timeline", ())
            stall_stacks = result.pop("stall_stacks", "")
            long = result.pop("long_calls", ())
            thread_times = result.pop("thread_times", ())
            process_times = result.pop("process_times", ())
            slowest = result.pop("slowest_calls", ())
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}))
            for line in timeline:
                print(f"  {result['way']}: {line}")
            for line in process_times:
                print(f"  {result['way']}: {line}")
            if slowest:
                print(f"  {result['way']}: the slowest eager calls while compiling, when they began:",
                      ", ".join(line.strip() for line in slowest))
            if thread_times:
                print(f"  {result['way']}: each thread's time on a CPU during the slowest eager calls while compiling:")
            for line in thread_times:
                print(f"    {line}")
            if long:
                print(f"  {result['way']}: the longest C calls outside the loop's thread:")
            for line in long:
                print(f"    {line}")
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
                  f"{cold.get('eager_p99_ms', 0):.2f} ms ({_against_alone(cold)}), "
                  f"max {cold.get('eager_max_ms', 0):.1f} ms; loop's longest "
                  f"stall {cold['loop_stall_max_ms']:.1f} ms (in the import of aiocompile.torch before it "
                  f"{cold['loop_stall_in_import_ms']:.1f} ms; stock {stock['loop_stall_max_ms']:.0f} ms)")
        if "server" in runs:
            server = runs["server"]
            print(f"server (after warm(), {server['warm_s']:.1f} s): compiled from {server['compiled_from_s']:.1f} s "
                  f"after the clock, {server['compiled_from_s'] / stock_first:.2f}x stock's first call "
                  f"({stock_first:.1f} s); first call {server['first_call_ms']:.1f} ms; eager while compiling p99 "
                  f"{server.get('eager_p99_ms', 0):.2f} ms ({_against_alone(server)}), "
                  f"max {server.get('eager_max_ms', 0):.1f} ms; loop's "
                  f"longest stall {server['loop_stall_max_ms']:.1f} ms (in warm() "
                  f"{server['loop_stall_in_warm_ms']:.0f} ms)")

if __name__ == "__main__":
    main()
