"""What a cache directory says it was built with, against what this process runs.

A Triton kernel's key holds the Triton build (``triton_key()``), so a directory built by
another Triton version is no use to this one: every one of its Triton kernels is missed and
compiled again. That happens quietly after an install moves Triton (``pip install
"aiocompile[torch]"`` installs the Triton that torch pins), so the scheduler says so once,
as it opens the directory. What it goes by is ``manifest.json``, which ``aiocompile build``
writes beside the kernels with the Triton version of each; a directory filled by servers
has none, and is not judged.

Only package metadata is read here: Triton is not imported.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from typing import Any

__all__ = ["other_triton", "triton_version"]

MANIFEST = "manifest.json"
# A manifest lists every kernel of a build: large builds make megabytes, never more.
_LARGEST = 64 * 1024 * 1024
# The names Triton is installed under (its own wheel, and the builds PyTorch ships).
_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-rocm", "pytorch-triton-xpu")


def triton_version() -> str | None:
    """The installed Triton's version, as its package says; None without one."""
    for name in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def other_triton(directory: str | os.PathLike[str]) -> str | None:
    """A warning, when the manifest of ``directory`` says its Triton kernels were built by
    another Triton than the one installed here; None otherwise (no manifest, no Triton
    kernel in it, the same version, or a manifest that cannot be read)."""
    built = _built_with(os.path.join(os.fspath(directory), MANIFEST))
    here = triton_version()
    if not built or here is None or _release(here) in {_release(version) for version in built}:
        return None
    return (f"the cache directory {os.fspath(directory)} was built by Triton {', '.join(sorted(built))} "
            f"(its {MANIFEST} says so), and this is Triton {here}: a Triton kernel's key holds its Triton "
            "version, so none of its Triton kernels is found and each compiles again. Build the directory again "
            f"with this Triton, or install the Triton it was built with")


def _built_with(path: str) -> set[str]:
    try:
        if os.path.getsize(path) > _LARGEST:
            return set()
        with open(path, encoding="utf-8") as file:
            manifest: Any = json.load(file)
    except (OSError, ValueError):
        return set()
    kernels = manifest.get("kernels") if isinstance(manifest, dict) else None
    if not isinstance(kernels, list):
        return set()
    return {entry["triton"] for entry in kernels
            if isinstance(entry, dict) and isinstance(entry.get("triton"), str) and entry["triton"]}


def _release(version: str) -> str:
    # "3.9.0+git1234abcd" (a nightly or a vendor's build) is the release 3.9.0.
    return version.split("+", 1)[0]
