"""A model on the second GPU under max-autotune: stock Inductor, Inductor with aiocompile
installed, and ``compile_in_background``, each in a fresh process, in one run.

The model: a bf16 gated MLP 2048 -> 5632 -> 2048 (SiLU gate), batch 512, on ``--device``
(default ``cuda:1``). Each way is a fresh interpreter with empty Inductor and Triton
caches and no FX graph cache; the clock starts at the program's start (before ``import
torch``), public API only:

- ``stock``: ``torch.compile(model, mode="max-autotune")``, its first output;
- ``installed``: ``aiocompile.torch.install()`` at the program's start, then the same;
- ``background``: ``compile_in_background(model, mode="max-autotune")`` and
  ``await ready(x)``, then a compiled output.

Reported per way: seconds from the program's start to a compiled output, the ratio to
stock's, whether the output equals eager's (bf16, ``rtol=atol=3e-2``), and, from
``nvidia-smi``, which GPUs held a context of the program or of any process it started
(its workers and benchmark processes): a model on ``cuda:1`` should never touch ``cuda:0``.

    python benchmarks/bench_multi_gpu_model.py [--device cuda:1] [--repeat 1] [--ways stock,installed,background]

Needs as many GPUs as ``--device`` names.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("stock", "installed", "background")


def _descendants(root: int) -> set[int]:
    """``root`` and every live process under it (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid and child not in found]
        found.update(children)
        frontier.extend(children)
    return found


class GpuWatch:
    """Which GPUs (by index) held a context of this program's process tree, sampled
    every 0.2 s with ``nvidia-smi`` while it runs."""

    def __init__(self) -> None:
        self.indexes: set[int] = set()
        self.own: set[int] = set()  # those of the program itself
        self.others: set[int] = set()  # those of the processes it started (workers, benchmark processes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"]
        uuids = {}
        listing = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                                 capture_output=True, text=True)
        for line in listing.stdout.splitlines():
            index, uuid = (part.strip() for part in line.split(","))
            uuids[uuid] = int(index)
        while not self._stop.wait(0.2):
            ours = _descendants(os.getpid())
            apps = subprocess.run(query, capture_output=True, text=True).stdout
            for line in apps.splitlines():
                pid, uuid = (part.strip() for part in line.split(","))
                if pid.isdigit() and int(pid) in ours and uuid in uuids:
                    self.indexes.add(uuids[uuid])
                    (self.own if int(pid) == os.getpid() else self.others).add(uuids[uuid])

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return sorted(self.indexes)


def child(way: str, device: str) -> dict:
    watch = GpuWatch()
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    if way == "installed":
        import aiocompile.torch

        aiocompile.torch.install()
    import torch
    from torch import nn

    class GatedMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(2048, 5632, bias=False)
            self.up = nn.Linear(2048, 5632, bias=False)
            self.down = nn.Linear(5632, 2048, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(nn.functional.silu(self.gate(x)) * self.up(x))

    torch.manual_seed(0)
    model = GatedMLP().to(device=device, dtype=torch.bfloat16).eval()
    x = torch.randn(512, 2048, device=device, dtype=torch.bfloat16)
    result: dict = {"way": way, "device": device}
    with torch.no_grad():
        expected = model(x)
        if way == "background":
            import asyncio

            import aiocompile.torch

            compiled = aiocompile.torch.compile_in_background(model, mode="max-autotune")

            async def ready() -> str:
                return (await compiled.ready(x)).state

            result["state"] = asyncio.run(ready())
            if result["state"] != "compiled":
                result["error"] = (compiled.status().shapes[0].error or "")[-3000:]
            out = compiled(x)
            shape = compiled.status().shapes[0]
            result["compiled_calls"] = shape.compiled_calls
            result["stages"] = {stage: round(seconds, 2) for stage, seconds in shape.stages}
        else:
            out = torch.compile(model, mode="max-autotune")(x)
        torch.cuda.synchronize(device)
    result["seconds"] = time.perf_counter() - T0
    result["equal"] = bool(torch.allclose(out.float(), expected.float(), rtol=3e-2, atol=3e-2))
    time.sleep(0.5)  # a last sample of the GPUs' processes
    result["gpus_used"] = watch.stop()
    result["gpus_used_by_the_program_itself"] = sorted(watch.own)
    result["gpus_used_by_its_workers"] = sorted(watch.others)
    result["gpu"] = torch.cuda.get_device_name(device)
    if way == "background":
        compiled.close()
    elif way == "installed":
        aiocompile.torch.uninstall()
    return result


def measure(way: str, device: str, timeout: float) -> dict:
    inductor_dir = tempfile.mkdtemp(prefix="bench-inductor-")
    triton_dir = tempfile.mkdtemp(prefix="bench-triton-")
    try:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir, "TRITON_CACHE_DIR": triton_dir,
               "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH", "")]))}
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", way, "--device", device],
                             capture_output=True, text=True, timeout=timeout, env=env)
    finally:
        shutil.rmtree(inductor_dir, ignore_errors=True)
        shutil.rmtree(triton_dir, ignore_errors=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"{way} failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:1")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--timeout", type=float, default=400.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.device)), flush=True)
        return
    ways = [way for way in args.ways.split(",") if way]
    if "stock" not in ways or set(ways) - set(WAYS):
        raise SystemExit(f"--ways takes stock and any of {', '.join(WAYS[1:])}; got {args.ways!r}")
    for round_ in range(args.repeat):
        stock = None
        for way in ["stock", *(way for way in ways if way != "stock")]:
            run = measure(way, args.device, args.timeout)
            stock = stock or run["seconds"]
            # Each way as it ends: a run cut short still shows what it measured.
            print(json.dumps({"round": round_ + 1, **{k: round(v, 2) if isinstance(v, float) else v
                                                      for k, v in run.items()}}), flush=True)
            print(f"  {way}: compiled output {run['seconds']:.1f} s from the program's start "
                  f"({run['seconds'] / stock:.2f}x stock), equal {run['equal']}, GPUs used {run['gpus_used']} "
                  f"(by the program itself {run['gpus_used_by_the_program_itself']}, by the processes it started "
                  f"{run['gpus_used_by_its_workers']})", flush=True)


if __name__ == "__main__":
    main()
