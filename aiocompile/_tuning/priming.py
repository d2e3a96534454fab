"""This process's side of a tuning: what it loads and primes, and what it pays ahead.

The chosen binary goes into Triton's JIT cache (loaded, launcher built) and the choice
into the autotuner's cache, so that the ordinary launch neither compiles nor benchmarks;
the one-time costs of loading (Triton's GPU driver, the kernel's launcher) are paid while
configurations compile or while the benchmark processes start, not after the decision.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import sys
import threading
import time
from typing import Any

from aiocompile._tuning import plan as _plan
from aiocompile._tuning.decisions import Decision

_log = logging.getLogger("aiocompile")
_PRIME_LOCK = threading.Lock()


def build_launcher(loading: cf.Future[None], kernel: Any) -> None:
    """Build the launcher of ``kernel`` (a compiled configuration) here, once ``loading``
    is done, so that it is in Triton's cache when a benchmark process needs it: Triton up
    to 3.6 compiles one per signature with the C compiler, the same for every
    configuration."""
    try:
        loading.result()
        from triton.runtime import driver

        from aiocompile.backends.triton._kernel import rebuild_compiled_kernel

        compiled = rebuild_compiled_kernel(kernel)  # as a benchmark process rebuilds it
        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:  # built again where it is needed
        _log.debug("the launcher was not built ahead", exc_info=True)


def imported(name: str, within: float) -> bool:
    """Whether module ``name`` is, or within ``within`` seconds becomes, fully imported
    (by whichever thread imports it)."""
    deadline = time.monotonic() + within
    while True:
        module = sys.modules.get(name)
        if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def prime_parent_loading() -> None:
    """This process's one-time costs of loading a binary on the GPU (Triton's driver, the
    device's context), paid ahead of the decision; a failure is paid again later."""
    from aiocompile.backends.triton import _kernel

    try:
        _kernel.prime_loading("cuda")
    except Exception:  # paid again, or failing, when the chosen binary is loaded
        _log.debug("loading was not primed ahead of a tuning", exc_info=True)


def warmup_prime(plan: _plan.TuningPlan, chosen: _plan.ConfigPlan, kernel: Any, decision: Decision | None,
                 load: bool) -> None:
    """Prime Triton with ``chosen``: its binary in the JIT's cache for the launch's
    specialisation (loaded where ``load``), and the choice (with the decision's timings)
    in the autotuner's cache under the launch's key."""
    from aiocompile.backends.triton import _warmup

    _warmup.prime(chosen.spec, kernel, load=load)
    if plan.key is None:
        return
    tuner = plan.chain.tuner
    by_label = {planned.label: planned.config for planned in plan.configs}
    inf = float("inf")
    with _PRIME_LOCK:
        # A launch that tuned it meanwhile keeps its own choice, as a primed JIT keeps its
        # own compile.
        tuner.cache.setdefault(plan.key, chosen.config)
        tuner.best_config = tuner.cache[plan.key]
        if decision is not None:
            tuner.configs_timings = {by_label[label]: ([ms, ms, ms] if ms is not None else [inf, inf, inf])
                                     for label, ms, _ in decision.timings if label in by_label}
