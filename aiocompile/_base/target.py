"""Compile targets: "cuda:90", "hip:gfx942" and Triton's ``GPUTarget``, without importing Triton."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from aiocompile._base.checks import Choice

__all__ = ["Target", "parse_target"]

_CUDA_ARCH = re.compile(r"^(?:sm_?)?(\d{2,3})a?$")
_HIP_ARCH = re.compile(r"^gfx[0-9a-f]{3,4}$")

_EXAMPLES = '"cuda:80", "cuda:90", "cuda:100", "cuda:120", "hip:gfx942", "hip:gfx1100"'

# NVIDIA warps are 32 threads wide; AMD wavefronts 64 (CDNA) or 32 (RDNA, or CDNA in
# wave32 mode). Other backends a GPUTarget may name are left to Triton.
_WARP_SIZES = {"cuda": Choice((32,)), "hip": Choice((32, 64))}


@dataclass(frozen=True, order=True)
class Target:
    """A GPU architecture to compile for: a plain value that pickles without Triton."""

    backend: str
    arch: int | str
    warp_size: int

    def __post_init__(self) -> None:
        rule = _WARP_SIZES.get(self.backend)
        if rule is not None:
            rule.check(f"the warp size of target {self}", self.warp_size)

    def __str__(self) -> str:
        return f"{self.backend}:{self.arch}"

    def to_gpu_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


def _hip_warp_size(arch: str) -> int:
    # CDNA parts (gfx9xx) run 64-wide wavefronts; RDNA parts (gfx10xx and later) 32-wide.
    return 64 if arch.startswith("gfx9") else 32


def parse_target(value: object) -> Target | None:
    """Turn the ``target=`` argument into a :class:`Target`; ``None`` means "the current
    device", resolved later. Raises ``ValueError``/``TypeError`` for anything else."""
    if value is None:
        return None
    if isinstance(value, Target):
        return value
    if isinstance(value, str):
        return _parse_string(value)
    # A triton GPUTarget, recognised by shape so that Triton need not be imported here.
    backend = getattr(value, "backend", None)
    arch = getattr(value, "arch", None)
    warp_size = getattr(value, "warp_size", None)
    if isinstance(backend, str) and isinstance(arch, (int, str)) and isinstance(warp_size, int):
        return Target(backend, arch, warp_size)
    raise TypeError(
        f"target must be a string such as {_EXAMPLES}, a triton GPUTarget, or None for the "
        f"current device; got {type(value).__name__}"
    )


def _parse_string(text: str) -> Target:
    parts = text.strip().lower().split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"unknown target {text!r}: expected 'backend:arch' such as {_EXAMPLES}")
    backend, arch = parts[0], parts[1]
    explicit_warp = None
    if len(parts) == 3:
        if not parts[2].isdigit():
            raise ValueError(f"unknown target {text!r}: the warp size after the second ':' must be a number")
        explicit_warp = int(parts[2])
    if backend == "cuda":
        match = _CUDA_ARCH.match(arch)
        if not match:
            raise ValueError(f"unknown CUDA architecture {arch!r} in target {text!r}; expected e.g. 'cuda:90'")
        return Target("cuda", int(match.group(1)), 32 if explicit_warp is None else explicit_warp)
    if backend in ("hip", "rocm", "amd"):
        if not _HIP_ARCH.match(arch):
            raise ValueError(f"unknown AMD architecture {arch!r} in target {text!r}; expected e.g. 'hip:gfx942'")
        return Target("hip", arch, _hip_warp_size(arch) if explicit_warp is None else explicit_warp)
    raise ValueError(f"unknown target backend {backend!r} in {text!r}; expected 'cuda' or 'hip', as in {_EXAMPLES}")
