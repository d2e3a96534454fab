"""The architectures the installed Triton compiles for, asked of its own backends.

A target Triton does not know is not refused by Triton at once: ``cuda:99`` goes through
LLVM and fails in ptxas, ``cuda:88`` aborts LLVM (a crashed worker, twice), ``hip:gfx9999``
fails in a pass manager. So the parent asks first, without a GPU, and refuses such a target
with a ``ValueError`` that names the architectures this Triton knows:

- **CUDA**: the ``sm_NN`` names that ptxas accepts (``ptxas --help`` lists them), asking
  the ptxas Triton itself runs for each architecture (Triton 3.9 has one for Hopper and
  later, another before), so that an architecture counts only where its own ptxas takes it;
- **HIP**: the ``gfx`` processors that Triton's LLVM knows (Triton's
  ``amd.get_target_triple`` refuses any other), found by asking for each plausible name;
- **the backend itself**: one of Triton's installed backends must take it (``Target("xpu",
  ...)`` has none here).

Where a Triton version offers no way to tell (no ``get_target_triple``, a ptxas that does
not run), nothing is refused here and the compile says what it says. Each answer is worked
out once per process (a ptxas run of a few milliseconds): it is a fact of the installed
Triton. Blocking: called in the key thread, or in a command's own thread.
"""

from __future__ import annotations

import functools
import re
import subprocess
from typing import Any

from aiocompile._base.target import Target

__all__ = ["check_target", "known_architectures"]

_SM = re.compile(r"\bsm_(\d+)[a-z]?\b")


def check_target(target: Target) -> None:
    """``ValueError`` if this Triton cannot compile for ``target``, naming what it can."""
    backends = _target_backends()
    if backends is not None and target.backend not in backends:
        raise ValueError(f"Triton has no backend for target {target}: its backends compile for "
                         f"{', '.join(sorted(backends)) or 'nothing'} (installed: {_installed()})")
    known = known_architectures(target.backend)
    if known is None or str(target) in known:
        return
    kind = {"cuda": "CUDA", "hip": "AMD"}.get(target.backend, target.backend)
    raise ValueError(f"unknown {kind} architecture in target {target}: this Triton ({_triton_version()}) compiles "
                     f"for {', '.join(known)}")


def known_architectures(backend: str) -> tuple[str, ...] | None:
    """The targets of ``backend`` ("cuda" or "hip") this Triton compiles for, as
    ``"cuda:90"`` strings, oldest first; None where it cannot be told."""
    if backend == "cuda":
        return _cuda_architectures()
    if backend == "hip":
        return _hip_architectures()
    return None


def _installed() -> str:
    from triton.backends import backends

    return ", ".join(sorted(backends)) or "none"


def _triton_version() -> str:
    import triton

    return str(getattr(triton, "__version__", "?"))


@functools.cache
def _target_backends() -> frozenset[str] | None:
    """The target backend names ("cuda", "hip") Triton's installed backends take; None
    where one of them takes neither (a plugin's: it may take any name)."""
    try:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
    except Exception:  # noqa: BLE001 - Triton, or this part of it, cannot be had: nothing can be told
        return None
    names: set[str] = set()
    for found in backends.values():
        takes = {name for name in ("cuda", "hip") if _supports(found.compiler, GPUTarget(name, 0, 32))}
        if not takes:
            return None
        names |= takes
    return frozenset(names)


def _supports(compiler: Any, target: Any) -> bool:
    try:
        return bool(compiler.supports_target(target))
    except Exception:  # noqa: BLE001 - a backend that cannot answer takes nothing here
        return False


@functools.cache
def _cuda_architectures() -> tuple[str, ...] | None:
    try:
        from triton import knobs
        from triton.backends.nvidia import compiler as nvidia
    except Exception:  # noqa: BLE001 - Triton, or this part of it, cannot be had: nothing can be told
        return None
    chooser = getattr(nvidia, "get_ptxas", None)
    tools = [knobs.nvidia.ptxas] + ([knobs.nvidia.ptxas_blackwell] if hasattr(knobs.nvidia, "ptxas_blackwell") else [])
    try:
        everything = set().union(*(_ptxas_architectures(tool.path) for tool in tools))
        if chooser is not None:
            # Only where the ptxas Triton runs for that architecture takes it.
            everything = {capability for capability in everything
                          if capability in _ptxas_architectures(chooser(capability).path)}
    except Exception:  # noqa: BLE001 - no ptxas that runs: the compile will say what is wrong
        return None
    return tuple(f"cuda:{capability}" for capability in sorted(everything)) or None


@functools.cache
def _ptxas_architectures(path: str) -> frozenset[int]:
    """The capabilities (``sm_NN``) that the ptxas at ``path`` generates code for."""
    text = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30, check=False).stdout
    return frozenset(int(number) for number in _SM.findall(text))


@functools.cache
def _hip_architectures() -> tuple[str, ...] | None:
    try:
        from triton._C.libtriton import amd
    except Exception:  # noqa: BLE001 - Triton, or this part of it, cannot be had: nothing can be told
        return None
    triple = getattr(amd, "get_target_triple", None)
    if triple is None:
        return None
    known = []
    # Every gfx name of the form LLVM gives AMD processors: major, minor, stepping.
    for major in range(6, 14):
        for minor in range(10):
            for stepping in "0123456789abcdef":
                name = f"gfx{major}{minor}{stepping}"
                try:
                    triple(name)
                except Exception:  # noqa: BLE001 - not a processor this LLVM knows
                    continue
                known.append(f"hip:{name}")
    return tuple(known) or None
