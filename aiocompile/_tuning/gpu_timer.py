"""The real timer of a benchmark process: Triton's own benchmarking, on a GPU.

Each configuration is timed as ``Autotuner._bench`` times it: a call that runs the
configuration's pre-hook, the autotuner's pre-hook (which zeroes ``reset_to_zero`` and
copies ``restore_value``), the launch, then the post-hook (which restores), handed to the
benchmarker the autotuner would use (the driver's, ``triton.testing.do_bench``: its
warm-up and repetition times, and the L2 cache cleared before each run), with the
quantiles it asks for (0.5, 0.2, 0.8). The launch is the compiled kernel's own, as
``JITFunction.run`` makes it: every argument in order, on the device's current stream.
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

from aiocompile._tuning.inputs import Inputs, rebuild, resolve
from aiocompile._tuning.task import BenchTask

_QUANTILES = (0.5, 0.2, 0.8)


class TritonTimer:
    """Times configurations on the one GPU this process sees (device 0 here)."""

    def __init__(self) -> None:
        self._torch: Any = None
        self._kernels: dict[bytes, Any] = {}
        self.startup: dict[str, float] = {}
        """Seconds each step of ``open`` took (for profiles)."""
        self.last_phases: dict[str, float] = {}
        """Seconds the last configuration spent loading (0 when loaded before) and timing."""

    def open(self, device: int) -> str:
        began = time.perf_counter()
        import torch

        imported = time.perf_counter()
        if not torch.cuda.is_available():
            raise RuntimeError("this benchmark process sees no CUDA device")
        # Triton's driver (its modules, and its C helper, which the C compiler builds
        # where Triton's cache lacks it) is set up in a thread while this one creates the
        # device's context: one waits on the compiler, the other on the GPU's driver.
        failed: list[BaseException] = []
        driver_time: list[float] = []

        def driver_up() -> None:
            started = time.perf_counter()
            try:
                from triton.runtime import driver

                driver.active.utils  # noqa: B018 - built on first use
            except BaseException as exc:  # raised again below, in the caller's thread
                failed.append(exc)
            driver_time.append(time.perf_counter() - started)

        helper = threading.Thread(target=driver_up, name="aiocompile-triton-driver", daemon=True)
        helper.start()
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")  # the context, now rather than in the first timing
        context = time.perf_counter()
        helper.join()
        if failed:
            raise failed[0]
        from triton.runtime import driver

        joined = time.perf_counter()
        driver.active.get_current_stream(0)
        self._torch = torch
        name = str(torch.cuda.get_device_name(0))
        self.startup = {"import_torch_s": imported - began, "context_s": context - imported,
                        "triton_driver_s": driver_time[0] if driver_time else 0.0,
                        "driver_wait_s": joined - context, "open_s": time.perf_counter() - began}
        return name

    def load_inputs(self, inputs: Inputs) -> list[Any]:
        tensors = rebuild(inputs, "cuda")
        self._torch.cuda.synchronize()
        return tensors

    def healthy(self) -> bool:
        torch = self._torch
        torch.cuda.synchronize()
        return bool(torch.ones(1, device="cuda").add_(1).item() == 2.0)

    def _compiled(self, task: BenchTask) -> Any:
        from aiocompile.backends.triton._kernel import TritonKernel

        compiled = self._kernels.get(task.kernel)
        if compiled is None:
            # Loading checks the kernel's shared memory and registers against the device:
            # a configuration that does not fit raises OutOfResources here.
            compiled = TritonKernel.from_bytes(task.kernel).ensure_loaded()
            if len(self._kernels) > 64:
                self._kernels.clear()
            self._kernels[task.kernel] = compiled
        return compiled

    def time(self, task: BenchTask, tensors: list[Any]) -> list[float]:
        from triton.runtime import driver

        began = time.perf_counter()
        compiled = self._compiled(task)
        loaded = time.perf_counter()
        args = [resolve(ref, tensors) for ref in task.args]
        nargs = {name: resolve(ref, tensors) for name, ref in task.hook_args}
        hooks = task.hooks
        config_pre_hook = None if task.config_pre_hook is None else pickle.loads(task.config_pre_hook)
        pre_hook, post_hook = default_hooks(hooks)
        if hooks.pre_hook is not None:
            pre_hook = pickle.loads(hooks.pre_hook)
        if hooks.post_hook is not None:
            post_hook = pickle.loads(hooks.post_hook)
        launch = compiled[task.grid]
        stream = driver.active.get_current_stream(0)

        def kernel_call() -> None:
            if config_pre_hook is not None:
                config_pre_hook(nargs)
            pre_hook(nargs)
            try:
                launch(*args, stream=stream)
            except Exception as exc:
                post_hook(nargs, exception=exc)
                raise
            post_hook(nargs, exception=None)

        timing = hooks.timing if task.screen is None else ("do_bench", *task.screen)
        timings = _benchmarker(timing)(kernel_call, quantiles=_QUANTILES)
        self._torch.cuda.synchronize()  # a fault shows here, against this configuration
        self.last_phases = {"load_s": loaded - began, "bench_s": time.perf_counter() - loaded}
        return [float(t) for t in timings]


def default_hooks(hooks: Any) -> tuple[Any, Any]:
    """The autotuner's own pre- and post-hook for ``reset_to_zero`` and ``restore_value``:
    zero the first before each run; copy the second before it and put it back after."""
    copies: dict[str, Any] = {}

    def pre_hook(nargs: dict[str, Any], reset_only: bool = False) -> None:
        for name in hooks.reset_to_zero:
            if nargs.get(name) is not None:
                nargs[name].zero_()
        if not reset_only:
            copies.clear()
            copies.update({name: nargs[name].clone() for name in hooks.restore_value if nargs.get(name) is not None})

    def post_hook(nargs: dict[str, Any], exception: Any) -> None:
        for name, value in copies.items():
            nargs[name].copy_(value)
        copies.clear()

    return pre_hook, post_hook


def _benchmarker(timing: tuple[Any, ...]) -> Any:
    from triton.runtime import driver

    kind = timing[0]
    if kind == "default":
        return driver.active.get_benchmarker()
    if kind == "do_bench":
        import triton.testing

        return lambda fn, quantiles: triton.testing.do_bench(fn, warmup=timing[1], rep=timing[2], quantiles=quantiles)
    if kind == "cudagraph":
        from triton.testing import do_bench_cudagraph

        return lambda fn, quantiles: do_bench_cudagraph(fn, rep=timing[1], quantiles=quantiles)
    return pickle.loads(timing[1])
