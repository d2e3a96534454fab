"""Benchmark requests that go wrong in the benchmark process, for max-autotune tests.

``Faulty(request, how)`` (``how``: exit, segfault, hang, fault (an illegal address on the
GPU), or raise) stands in for one of Inductor's ``BenchmarkRequest``s (it reads
as the request it wraps) and, timed in a benchmark process, exits, segfaults, raises or
hangs there for real. Importable by the benchmark processes: they get the test's
``sys.path``.
"""

from __future__ import annotations

import ctypes
import os
import time


class Faulty:
    def __init__(self, inner, how):
        self.inner = inner
        self.how = how

    def __getattr__(self, name):
        if name in ("inner", "how"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __reduce__(self):
        return Faulty, (self.inner, self.how)

    def benchmark(self, *args, **kwargs):
        if self.how == "exit":
            os._exit(7)
        if self.how == "segfault":
            ctypes.string_at(0)
        if self.how == "hang":
            time.sleep(3600)
        if self.how == "fault":
            illegal_address()
        raise RuntimeError(f"injected failure in {self.inner.kernel_name}")


def inject(monkeypatch, faults):
    """Make the ``n``-th choice (counting every choice the tuning pool is given, in
    order, from 0) of ``faults = {n: how}`` a ``Faulty`` one while it is timed; returns
    the labels of the choices made faulty."""
    from aiocompile._torch import autotune

    real = autotune.TuningPool.benchmark
    seen = [0]
    made = {}

    def benchmark(self, choices):
        swapped = []
        for choice in choices:
            how = faults.get(seen[0])
            seen[0] += 1
            if how is not None:
                swapped.append((choice, choice.bmreq))
                made[autotune._label(choice)] = how
                choice.bmreq = Faulty(choice.bmreq, how)
        try:
            return real(self, choices)
        finally:
            for choice, bmreq in swapped:
                choice.bmreq = bmreq

    monkeypatch.setattr(autotune.TuningPool, "benchmark", benchmark)
    return made


def illegal_address():
    """A store far outside any allocation: the device is left unusable (a GPU only)."""
    import gpu_tuning_kernels as gk
    import torch

    a, b, c = (torch.zeros(64, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    gk.matmul_base[(1,)](*gk.launch_args(a, b, c), BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, OFFSET=1 << 40)
    torch.cuda.synchronize()
