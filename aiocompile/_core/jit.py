"""What the scheduler does for Triton's JIT and for PyTorch Inductor's generated kernels:
``Scheduler.warmup`` and ``Scheduler.inductor_triton`` (their docstrings say what each
does). Each ends in the engine's request path, so crashes, timeouts, caching and
cancellation are the same as for any compile; what Triton's JIT or Inductor needs in this
process afterwards (a kernel primed, launchers built) is done in a thread.
"""

from __future__ import annotations

from typing import Any

from aiocompile._base import checks, threads
from aiocompile._core.engine import Engine
from aiocompile.backends.triton._kernel import TritonKernel


async def warmup(engine: Engine, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, grid: Any,
                 target: Any, timeout: float | None) -> TritonKernel:
    from aiocompile.backends.triton import _warmup as triton_warmup

    checks.CALL_TIMEOUT.check("timeout", timeout)
    if grid is not None and not (callable(grid) or isinstance(grid, (tuple, list, int))):
        raise TypeError(f"grid must be a tuple of ints or a callable, as for a launch; got {grid!r}")
    engine.check_open()
    plan = await threads.LOADS.run(lambda: triton_warmup.plan(kernel, args, kwargs, target))
    compiled = await engine.compile_triton(plan.fn, timeout=timeout, **plan.request())
    if plan.device is not None:
        await threads.LOADS.run(lambda: triton_warmup.prime(plan, compiled))
    return compiled


async def inductor_triton(engine: Engine, kernel_name: str, source_code: str, *, device_str: str,
                          timeout: float | None) -> Any:
    from aiocompile.backends import inductor

    checks.CALL_TIMEOUT.check("timeout", timeout)
    request = await inductor.prepare(engine, kernel_name, source_code, device_str)
    artifact: inductor.InductorArtifact = await engine.execute(request, timeout)
    return await threads.LOADS.run(artifact.ready)
