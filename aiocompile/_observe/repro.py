"""Repro bundles: a directory per failed compile, with what it takes to look at the
failure and to make it happen again alone.

A bundle is a directory under a root (``SchedulerConfig.repro_dir``), named
``<UTC time>-<kind>-<name>-<random>``, holding at least:

- ``bundle.json``: what failed (``kind``, ``name``, ``stage``), when, the error's type and
  message, the versions and the environment it failed in, and the list of files;
- ``error.txt``: the error and its traceback (the worker's, where it failed there);
- ``repro.py``: a script that reproduces the failure alone (``python repro.py`` from
  anywhere), written by whoever knows how the compile ran (see
  ``aiocompile._torch.bundles``).

A bundle is written whole or not at all: into a hidden directory of the root first,
renamed into place once complete, so a reader never sees half of one. The root is bounded
(``repro_keep`` bundles, ``repro_dir_bytes`` bytes): after each write the oldest bundles
are removed until both bounds hold, but the newest one is always kept. Writers in several
processes may prune at once; a bundle already gone is simply gone.

Nothing here imports torch or Triton: a worker and the ``aiocompile report`` command use
it as well as the scheduler.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiocompile._cache.disk import make_private_dir, write_private

__all__ = ["BundleInfo", "ReproRoot", "environment", "format_bundles", "list_bundles", "root_of", "versions"]

MANIFEST = "bundle.json"
# bundle.json holds an error's message and the environment: a few KiB, never megabytes.
_LARGEST_MANIFEST = 4 * 1024 * 1024
# A creation time past this (the year 2100) is none a bundle was written at.
_LATEST = 4102444800.0

# Environment variables worth knowing to reproduce a compile, by prefix; names that look
# like secrets are left out whatever their prefix.
_ENV_PREFIXES = ("TORCH", "TRITON", "AIOCOMPILE", "CUDA", "NVIDIA", "HIP", "ROCM", "OMP_", "MKL_", "CXX", "CC",
                 "CFLAGS", "LD_LIBRARY_PATH", "PYTHONPATH")
_SECRET_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "CREDENTIAL")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


@dataclass(frozen=True)
class ReproRoot:
    """Where bundles go and how many the root keeps (``SchedulerConfig.repro_*``)."""

    path: str
    keep: int = 50
    max_bytes: int | None = 1024 * 1024 * 1024

    def write(
        self,
        kind: str,
        name: str,
        files: Mapping[str, bytes | str],
        info: Mapping[str, Any],
    ) -> str:
        """Write a bundle of ``files`` (relative path -> content) and ``bundle.json``
        (``info`` plus the time, versions and environment); returns its directory. Then
        prunes the root. Raises ``OSError`` when the root cannot be written."""
        root = Path(self.path)
        make_private_dir(root)
        created = time.time()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(created))
        final = root / f"{stamp}-{_safe(kind)}-{_safe(name)[:48]}-{secrets.token_hex(3)}"
        staging = root / f".writing-{final.name}"
        make_private_dir(staging)
        try:
            for relative, content in files.items():
                target = staging / relative
                if target.parent != staging:
                    make_private_dir(target.parent)
                write_private(target, content.encode("utf-8") if isinstance(content, str) else content)
            manifest = {
                "kind": kind, "name": name, "created": created,
                "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                **info,
                "versions": versions(), "environment": environment(),
                "files": sorted([*files, MANIFEST]),
            }
            write_private(staging / MANIFEST, json.dumps(manifest, indent=2, default=str).encode("utf-8"))
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.prune(keep_newest=final)
        return str(final)

    def prune(self, keep_newest: Path | None = None) -> list[str]:
        """Remove the oldest bundles until the root holds at most ``keep`` of them and at
        most ``max_bytes`` bytes (``keep_newest`` is never removed). Returns the removed
        directories."""
        bundles = list_bundles(self.path)  # oldest first
        sizes = {bundle.path: bundle.size for bundle in bundles}
        total = sum(sizes.values())
        removed: list[str] = []
        for bundle in bundles:
            over_count = len(bundles) - len(removed) > self.keep
            over_bytes = self.max_bytes is not None and total > self.max_bytes
            if not (over_count or over_bytes):
                break
            if keep_newest is not None and Path(bundle.path) == keep_newest:
                continue
            shutil.rmtree(bundle.path, ignore_errors=True)
            total -= sizes[bundle.path]
            removed.append(bundle.path)
        return removed


def root_of(config: Any) -> ReproRoot | None:
    """The bundle root a ``SchedulerConfig`` asks for, or None where bundles are off."""
    if config.repro_dir is None:
        return None
    return ReproRoot(config.repro_dir, config.repro_keep, config.repro_dir_bytes)


@dataclass(frozen=True)
class BundleInfo:
    """What ``bundle.json`` says about one bundle."""

    path: str
    kind: str
    name: str
    created: float
    stage: str | None
    error_type: str | None
    error: str | None
    size: int

    @property
    def headline(self) -> str:
        """The error's first line."""
        text = (self.error or "").strip()
        first = text.splitlines()[0] if text else ""
        return f"{self.error_type}: {first}" if self.error_type else first


def list_bundles(root: str | os.PathLike[str]) -> list[BundleInfo]:
    """The bundles under ``root``, oldest first; a directory without a readable
    ``bundle.json`` (being written, or not a bundle) is passed over. A missing root has
    none."""
    found = []
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        data = _read_manifest(os.path.join(entry.path, MANIFEST))
        if data is None:
            continue
        created = data.get("created")
        found.append(BundleInfo(
            path=entry.path,
            kind=str(data.get("kind", "?")),
            name=str(data.get("name", "?")),
            created=float(created) if isinstance(created, (int, float)) and 0 <= created < _LATEST else 0.0,
            stage=data.get("stage") if isinstance(data.get("stage"), str) else None,
            error_type=data.get("error_type") if isinstance(data.get("error_type"), str) else None,
            error=data.get("error") if isinstance(data.get("error"), str) else None,
            size=_tree_size(entry.path),
        ))
    found.sort(key=lambda bundle: (bundle.created, bundle.path))
    return found


def _read_manifest(path: str) -> dict[str, Any] | None:
    """A bundle's ``bundle.json``, or None for what is not one. Only a regular file of at
    most ``_LARGEST_MANIFEST`` bytes is read, opened without waiting: a FIFO or a device
    left in a root (which others may share) would otherwise hold the listing, and the
    pruning after every bundle written, forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_size > _LARGEST_MANIFEST:
            return None
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = json.loads(file.read(_LARGEST_MANIFEST + 1).decode("utf-8"))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else None


def format_bundles(bundles: Iterable[BundleInfo], root: str) -> str:
    """A plain-text table of bundles, newest first, for ``aiocompile report --repro``."""
    rows = sorted(bundles, key=lambda bundle: bundle.created, reverse=True)
    if not rows:
        return f"no repro bundles in {root}\n"
    lines = [f"{len(rows)} repro bundle(s) in {root}, newest first:", ""]
    for bundle in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(bundle.created))
        stage = f" at {_shown(bundle.stage)}" if bundle.stage else ""
        lines.append(f"{when}  {_shown(bundle.kind)}{stage}  {_shown(bundle.name)}  ({_size(bundle.size)})")
        if bundle.headline:
            lines.append(f"    {_shown(bundle.headline[:200])}")
        lines.append(f"    {bundle.path}")
        lines.append(f"    python {os.path.join(bundle.path, 'repro.py')}")
    return "\n".join(lines) + "\n"


def versions() -> dict[str, str | None]:
    """Python, the platform, and the versions of the packages a compile depends on (read
    from their metadata: nothing is imported)."""
    from importlib import metadata

    from aiocompile._base.version import VERSION as __version__

    found: dict[str, str | None] = {
        "python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine(),
        "aiocompile": __version__,
    }
    for dist in ("torch", "triton", "numpy"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment variables that bear on compiling (torch, Triton, CUDA, compilers,
    threads), secrets left out."""
    return {
        name: value for name, value in sorted(environ.items())
        if name.startswith(_ENV_PREFIXES) and not any(word in name.upper() for word in _SECRET_WORDS)
    }


def _safe(text: str) -> str:
    cleaned = "".join(c if c in _NAME_CHARS else "_" for c in text).strip("._-")
    return cleaned or "unnamed"


def _shown(text: str) -> str:
    # What a bundle says is printed on a terminal: no control characters (escape
    # sequences) from a file anyone with access to the root may have written.
    return "".join(c if c.isprintable() else "?" for c in text)


def _tree_size(path: str) -> int:
    total = 0
    for directory, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                pass
    return total


def _size(n: int) -> str:
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024 / 1024:.1f} MiB"
