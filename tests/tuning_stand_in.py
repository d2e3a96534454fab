"""Stand-ins for GPUs, so that ``autotune()`` runs its real machinery on a CPU machine.

- ``StandInDriver``: what Triton's JIT asks of a driver to specialise and compile for an
  H100 (``cuda:90``) on any device number; nothing is launched.
- ``StandInTiming``: the parent's view of N stand-in devices; each benchmark process (a
  real process, started, replaced and killed as on a GPU machine) runs a ``StandInTimer``.
- ``StandInTimer``: "times" a configuration from its constexprs, really doing what they
  ask: ``MODE`` 0 answers ``COST`` microseconds, 1 raises (like an out-of-resources
  error), 2 leaves its "device" unusable (like an illegal address), 3 segfaults its
  process, 4 hangs, 5 waits until ``COST`` benchmark processes are timing at once (a
  barrier through files: it fails unless configurations run side by side), 6 answers the
  sum of the first tensor argument as its time (the tensors really travelled), 7 answers
  ``COST`` after sleeping 50 ms (time enough for other processes to take the rest), 8
  answers ``COST`` to a short timing and raises when timed in full.
  With ``STAND_IN_START_GATE`` set, a process's start waits until that file exists.
"""

from __future__ import annotations

import ctypes
import os
import time

from aiocompile._tuning.inputs import rebuild, resolve
from aiocompile._tuning.timing import Timing

OK, ERROR, FAULT, CRASH, HANG, BARRIER, SUM, SLOW, FULL_FAILS = range(9)


class StandInDriver:
    """What Triton's JIT asks of a driver before it launches."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)
        self.device = 0

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.device

    def set_current_device(self, device):
        self.device = device

    def get_current_stream(self, device=None):
        return 0


class StandInTiming(Timing):
    timer = "tuning_stand_in:StandInTimer"
    loads_in_parent = False

    def __init__(self, count=1, names=None, current=0):
        self._count = count
        self._names = names or ["Stand-in GPU"] * count
        self._current = current

    def count(self):
        return self._count

    def device_name(self, device):
        return self._names[device]

    def env(self, device):
        return {"STAND_IN_DEVICE": str(device)}

    def current_device(self):
        return self._current


class StandInTimer:
    def __init__(self):
        self.poisoned = False
        self.device = None

    def open(self, device):
        if os.environ.get("STAND_IN_FAIL_START"):
            raise RuntimeError("no device answers here")
        assert os.environ["STAND_IN_DEVICE"] == str(device)
        gate = os.environ.get("STAND_IN_START_GATE")
        if gate:  # a slow start (importing torch), over when the test says so
            deadline = time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        self.device = device
        return "Stand-in GPU"

    def load_inputs(self, inputs):
        return inputs

    def healthy(self):
        return not self.poisoned

    def time(self, task, inputs):
        mode, cost = task.config.get("MODE", OK), task.config.get("COST", 1)
        assert task.kernel.startswith(b"AIOCOMPILE-TRITON")  # a compiled binary came
        if mode == ERROR:
            raise RuntimeError("out of resource: shared memory, Required: 300000, Hardware limit: 232448")
        if mode == FAULT:
            self.poisoned = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if mode == CRASH:
            ctypes.string_at(0)
        if mode == HANG:
            time.sleep(3600)
        if mode == BARRIER:
            _barrier(os.environ["STAND_IN_BARRIER"], cost)
        if mode == SUM:
            tensors = rebuild(inputs, "cpu")
            first = next(ref for ref in task.args if ref[0] == "view")
            return [float(resolve(first, tensors).sum())] * 3
        if mode == SLOW:
            time.sleep(0.05)
        if mode == FULL_FAILS and task.screen is None:
            raise RuntimeError("out of resource: only when timed in full")
        return [cost / 1000.0] * 3


def _barrier(directory, parties, timeout=60.0):
    mine = os.path.join(directory, str(os.getpid()))
    open(mine, "w").close()
    deadline = time.monotonic() + timeout
    while len(os.listdir(directory)) < parties:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(os.listdir(directory))} of {parties} benchmark processes ever ran at once")
        time.sleep(0.01)
