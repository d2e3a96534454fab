"""Several GPUs: autotuning for each GPU at once, one benchmark process per GPU, a
configuration that faults one GPU leaving the other GPU's tuning untouched, and a model on
``cuda:1`` compiled and timed there, never on ``cuda:0``.

Run with ``pytest -m gpu`` on a machine with two GPUs of one model; skipped elsewhere. Plain
functions around ``asyncio.run``, as in the other GPU tests.
"""

from __future__ import annotations

import asyncio
import collections
import shutil
import subprocess

import gpu_tuning_kernels as gk
import pytest

import aiocompile

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2
                       and torch.cuda.get_device_name(0) != torch.cuda.get_device_name(1),
                       reason="needs two GPUs of one model"),
    pytest.mark.timeout(600),
]


def matmul_on(device: int, m: int = 512, n: int = 512, k: int = 512):
    torch.manual_seed(device)
    a = torch.randn(m, k, device=f"cuda:{device}", dtype=torch.float16)
    b = torch.randn(k, n, device=f"cuda:{device}", dtype=torch.float16)
    return a, b, torch.empty(m, n, device=f"cuda:{device}", dtype=torch.float16)


def sum_on(device: int, n: int = 1 << 20):
    x = torch.rand(n, device=f"cuda:{device}")
    return x, torch.zeros(1, device=f"cuda:{device}")


def sum_grid(x):
    return lambda meta: ((x.numel() + meta["BLOCK"] - 1) // meta["BLOCK"],)


def test_two_kernels_tuned_for_two_gpus_at_once_each_timed_on_its_own_gpu():
    matmul = gk.tuned()
    # Other shapes on each GPU: four tunings (two GPUs of one model would otherwise share
    # a decision, as they share Triton's autotuner cache).
    inputs = {0: (matmul_on(0), sum_on(0)), 1: (matmul_on(1, 1024, 1024, 1024), sum_on(1, 1 << 21))}

    async def tune():
        async with aiocompile.Scheduler(workers=4) as sched:
            calls = []
            for device, ((a, b, c), (x, total)) in inputs.items():
                calls.append(sched.autotune(matmul, *gk.launch_args(a, b, c), grid=gk.grid, device=device))
                calls.append(sched.autotune(gk.accumulate, x, total, x.numel(), grid=sum_grid(x), device=device))
            best = await asyncio.gather(*calls)
            pool = sched.port.tuner().pool()
            return best, list(sched.port.benchmark_records()), [s["device"] for s in pool.starts], sched.statistics()

    best, records, started, stats = asyncio.run(tune())
    assert [b.device for b in best] == [0, 0, 1, 1]
    assert all(b.device_name == torch.cuda.get_device_name(0) for b in best)
    # One benchmark process for each GPU, and each configuration timed on the GPU its
    # tuning was for.
    assert sorted(started) == [0, 1] and stats.benchmark_processes_started == 2
    configs = {device: {r.config for r in records if r.device == device} for device in (0, 1)}
    assert all(len(timed) == len(gk.CONFIGS) + len(gk.accumulate.configs) for timed in configs.values()), configs
    assert all(r.outcome == "ok" for r in records)
    # The kernels compute the right thing on each GPU.
    for device, ((a, b, c), (x, total)) in inputs.items():
        with torch.cuda.device(device):
            matmul[gk.grid](*gk.launch_args(a, b, c))
            gk.accumulate[sum_grid(x)](x, total, x.numel())
            torch.cuda.synchronize(device)
        torch.testing.assert_close(c, a @ b, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(total, x.sum().reshape(1), rtol=1e-4, atol=1e-2)


def test_a_configuration_that_faults_one_gpu_leaves_the_other_gpus_tuning_untouched():
    faulty = gk.tuned([*gk.CONFIGS[:3], gk.config(64, 64, 32, 4, 3, offset=1 << 40)])
    sound = gk.tuned()
    on0, on1 = matmul_on(0), matmul_on(1)

    async def tune():
        async with aiocompile.Scheduler(workers=4) as sched:
            best = await asyncio.gather(
                sched.autotune(faulty, *gk.launch_args(*on0), grid=gk.grid, device=0),
                sched.autotune(sound, *gk.launch_args(*on1), grid=gk.grid, device=1))
            pool = sched.port.tuner().pool()
            return best, list(sched.port.benchmark_records()), [s["device"] for s in pool.starts]

    (best0, best1), records, started = asyncio.run(tune())
    by_device = collections.defaultdict(list)
    for record in records:
        by_device[record.device].append(record)
    (fault,) = [r for r in by_device[0] if r.outcome == "fault"]
    assert "OFFSET=1099511627776" in fault.config
    assert all(r.outcome == "ok" for r in by_device[0] if r is not fault)
    # GPU 1's benchmark process lived through it: every configuration timed there, once.
    assert by_device[1] and all(r.outcome == "ok" and r.attempt == 1 for r in by_device[1])
    assert started.count(1) == 1 and started.count(0) >= 2
    assert best0.config.kwargs["OFFSET"] == 0 and best1.device == 1
    for device, (a, b, c), kernel in ((0, on0, faulty), (1, on1, sound)):
        with torch.cuda.device(device):
            kernel[gk.grid](*gk.launch_args(a, b, c))
            torch.cuda.synchronize(device)
        torch.testing.assert_close(c, a @ b, atol=1e-2, rtol=1e-2)


def _gpus_of(pids: set[int]) -> dict[int, set[int]]:
    """GPU index -> those of ``pids`` that hold a context on it, as nvidia-smi sees them."""
    index_of = {}
    for line in subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                               capture_output=True, text=True, check=True).stdout.splitlines():
        index, bus = (part.strip() for part in line.split(","))
        index_of[bus] = int(index)
    found: dict[int, set[int]] = collections.defaultdict(set)
    for line in subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
                               capture_output=True, text=True, check=True).stdout.splitlines():
        pid, bus = (part.strip() for part in line.split(","))
        if int(pid) in pids:
            found[index_of[bus]].add(int(pid))
    return found



@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi to see which GPU a process uses")
def test_a_model_on_the_second_gpu_is_compiled_and_timed_there(fresh_inductor):
    import aiocompile.torch as aiotorch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
    model = model.half().to("cuda:1").eval()
    x = torch.randn(64, 512, device="cuda:1", dtype=torch.float16)

    async def both():
        async with aiocompile.Scheduler(workers=4) as sched:
            records = []
            stop = sched.subscribe(lambda event: records.append(event)
                                   if isinstance(event, aiocompile.BenchmarkRecord) else None)
            with torch.no_grad():
                expected = model(x)
                # max-autotune: Inductor's choices timed in the benchmark process of cuda:1.
                with aiotorch.installed(sched):
                    tuned = torch.compile(model, mode="max-autotune")(x)
                # compile_in_background: the worker's compile and trial on cuda:1 too.
                compiled = aiotorch.compile_in_background(model, scheduler=sched)
                status = await compiled.ready(x)
                background = compiled(x)
            stop()
            pids = set(sched.worker_pids()) | set(sched.port.tuner().pool().processes().values())
            return expected, tuned, status, background, records, _gpus_of(pids)

    expected, tuned, status, background, records, gpus = asyncio.run(both())
    torch.testing.assert_close(tuned, expected, rtol=1e-2, atol=1e-2)
    assert status.state == "compiled", status
    torch.testing.assert_close(background, expected, rtol=1e-2, atol=1e-2)
    assert tuned.device == background.device == torch.device("cuda:1")
    timed = [r for r in records if r.config != "warm-up"]
    assert timed and {r.device for r in timed} == {1}
    # Our processes hold contexts on the second GPU only (seen there: the check can fail).
    assert gpus.get(1) and not gpus.get(0), dict(gpus)


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi to see which GPU a process uses")
def test_a_background_compile_under_max_autotune_of_a_model_on_the_second_gpu_stays_there(fresh_inductor):
    """The scheduler compile_in_background makes itself: its workers export, tune, compile
    and try the model on cuda:1, and none of them holds a context on cuda:0."""
    import aiocompile.torch as aiotorch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    model = model.half().to("cuda:1").eval()
    x = torch.randn(64, 256, device="cuda:1", dtype=torch.float16)

    async def compile_it():
        with torch.no_grad():
            expected = model(x)
            compiled = aiotorch.compile_in_background(model, mode="max-autotune")
            status = await compiled.ready(x)
            out = compiled(x)
        pids = set(compiled.scheduler.worker_pids())
        gpus = _gpus_of(pids)
        await compiled.aclose()
        await compiled.scheduler.aclose()
        return expected, status, out, pids, gpus

    expected, status, out, pids, gpus = asyncio.run(compile_it())
    assert status.state == "compiled", status
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    assert out.device == torch.device("cuda:1")
    assert pids and gpus.get(1) and not gpus.get(0), dict(gpus)
