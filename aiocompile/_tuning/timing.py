"""Where configurations are timed: the devices a tuning may use and the timer a benchmark
process makes. ``GpuTiming`` is the real one (CUDA devices, Triton's own benchmarking);
``_torch.autotune`` has one for the host, and the tests a stand-in."""

from __future__ import annotations

import os
import sys


class Timing:
    """Where configurations are timed (see ``GpuTiming``, the real one): the timer a
    benchmark process makes (``module:name``), and the devices."""

    timer: str = "aiocompile._tuning.gpu_timer:TritonTimer"
    loads_in_parent = True
    """Whether this process can load the chosen binary (prime Triton's JIT with it loaded)."""

    def count(self) -> int:
        raise NotImplementedError

    def count_early(self) -> int:
        """The device count, asked without what ``count`` may need to import (for
        starting the processes while the program is still starting)."""
        return self.count()

    def device_name(self, device: int) -> str:
        raise NotImplementedError

    def env(self, device: int) -> dict[str, str]:
        return {}

    def current_device(self) -> int:
        return 0


class GpuTiming(Timing):
    """The visible CUDA devices, asked of torch (which this process has loaded already when
    it launches kernels); each benchmark process sees only its own device."""

    def count(self) -> int:
        try:
            import torch
        except ImportError:
            return 0
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0

    def count_early(self) -> int:
        """Asked of the CUDA driver itself (``CUDA_VISIBLE_DEVICES`` applies): importing
        torch takes seconds, and the program may be importing it in another thread
        right now; 0 where there is no driver or no device."""
        import ctypes

        try:
            libcuda = ctypes.CDLL("libcuda.so.1")
            if libcuda.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            if libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
        except (OSError, AttributeError):
            return 0
        return int(count.value)

    def device_name(self, device: int) -> str:
        import torch

        return str(torch.cuda.get_device_name(device))

    def env(self, device: int) -> dict[str, str]:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip():
            entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
            return {"CUDA_VISIBLE_DEVICES": entries[device]}
        return {"CUDA_VISIBLE_DEVICES": str(device)}

    def current_device(self) -> int:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
        return 0
