"""What the event loop's own thread does while many requests arrive at once.

The loop must not pay for thread start-ups or first imports: both hold it while other
threads (hashing kernel sources, building launchers) own the GIL. These tests watch the
loop's thread directly, in a fresh interpreter so that nothing was imported before.
"""

import json
import os
import subprocess
import sys
import textwrap

from conftest import ROOT, subprocess_env

BURST = textwrap.dedent('''
    import asyncio, json, sys, threading
    sys.path.insert(0, sys.argv[1])
    import aiocompile
    from aiocompile.backends.triton import _kernel as _triton_kernel
    from triton_kernels import ADD_SIGNATURE, add_kernel

    watching = False
    imported_in_loop = []

    def audit(event, args):
        if watching and event == "import" and threading.current_thread() is threading.main_thread():
            imported_in_loop.append(args[0])

    sys.addaudithook(audit)

    # Triton hashes a kernel (walks its source and callees) the first time its cache_key is
    # asked for, and a JITFunction's hash() asks for it.
    from triton.runtime import jit as triton_jit
    hashed_in_loop = []
    plain_init = triton_jit.DependenciesFinder.__init__

    def watched_init(self, *args, **kwargs):
        if watching and threading.current_thread() is threading.main_thread():
            hashed_in_loop.append(kwargs.get("name", "?"))
        plain_init(self, *args, **kwargs)

    triton_jit.DependenciesFinder.__init__ = watched_init

    async def main():
        global watching
        async with aiocompile.Scheduler(workers=2) as sched:
            await sched.warm("cuda:80")
            from triton.runtime.cache import triton_key
            # warm() paid this process's first-key cost too (hashing Triton: ~0.4 s).
            key_ready = triton_key.cache_info().currsize == 1
            threads_before = {t.ident for t in threading.enumerate()}
            specs = [dict(kernel=add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 2 ** (5 + i % 8)},
                          num_warps=2 ** (i // 8), target="cuda:80") for i in range(32)]
            watching = True
            kernels = await sched.compile_many(specs)
            watching = False
            new_threads = sorted(t.name for t in threading.enumerate() if t.ident not in threads_before)
            return {"kernels": len({k.key for k in kernels}), "new_threads": new_threads,
                    "imported_in_loop": sorted(set(imported_in_loop)), "hashed_in_loop": hashed_in_loop,
                    "compiled": sched.statistics().compiled, "key_ready": key_ready,
                    "primed": _triton_kernel._primed, "torch_imported": "torch" in sys.modules}

    print(json.dumps(asyncio.run(main())))
''')


def test_after_warm_a_burst_of_requests_starts_no_thread_per_request_and_imports_nothing_in_the_loop():
    proc = subprocess.run([sys.executable, "-c", BURST, str(ROOT / "tests")], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kernels"] == 32 and result["compiled"] == 32 and result["key_ready"]
    # Keys are computed in one long-lived thread, started once; not in a thread per request.
    assert len(result["new_threads"]) <= 1, result["new_threads"]
    assert all(name.startswith("aiocompile-keys") for name in result["new_threads"])
    # What the first requests need of anyio was imported in a helper thread, not the loop.
    assert not [name for name in result["imported_in_loop"] if name.startswith("anyio")], result["imported_in_loop"]
    # Kernels are hashed in the key thread, never in the loop's.
    assert result["hashed_in_loop"] == []
    # warm() also tried to pay the one-time cost of loading kernels: here, with no GPU,
    # it found nothing to load on (tests/test_gpu.py checks the other side).
    # On a machine without any GPU device, it did not even import torch to ask.
    if not _has_cuda_gpu():
        assert not result["primed"]
    if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")):
        assert result["torch_imported"] is False


def _has_cuda_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
