"""Tuning decisions: which configuration won, kept in memory and in ``cache_dir``.

A decision is keyed by what makes it valid (``TuningPlan.decision_key``): the kernel as
Triton hashes it (its source and everything it calls), the autotuner's key for the launch,
its list of configurations, the device's model, Triton's version and the environment
variables that change what Triton builds. A server restarted with the same ``cache_dir``
finds its decisions there and tunes nothing; a decision copied to another machine with the
same GPU model (``aiocompile decisions export``/``import``, or ``aiocompile build
--decisions``) serves there too.

On disk a decision is a file of the disk cache's kind, in ``<cache_dir>/tuning/``, under
the same rules: written atomically and privately, read only from a directory nobody else
can write, sealed with ``cache_key`` when one is set (``_cache.disk``, ``_cache.sealed``). Its
bytes carry their own checksum::

    MAGIC  b"AIOCOMPILE-DECISION\\n"
    1 byte version (1)
    32 bytes SHA-256 of the body
    body   JSON: key, kernel, tuning_key, device_name, triton_version, config, timings, tuned_at
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MAGIC = b"AIOCOMPILE-DECISION\n"
_VERSION = 1
SUBDIRECTORY = "tuning"


@dataclass(frozen=True)
class Decision:
    """The configuration chosen for one kernel, launch key and device model."""

    key: str
    kernel: str
    tuning_key: str
    """The autotuner's key for the launch, as text."""
    device_name: str
    triton_version: str
    config: str
    """The chosen configuration, as ``plan.config_id`` writes it."""
    label: str
    """The chosen configuration, as a person reads it."""
    timings: tuple[tuple[str, float | None, str | None], ...] = ()
    """Every configuration timed: (label, median in ms or None, why it failed or None)."""
    tuned_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "kernel": self.kernel, "tuning_key": self.tuning_key, "device_name": self.device_name,
            "triton_version": self.triton_version, "config": self.config, "label": self.label,
            "timings": [list(item) for item in self.timings], "tuned_at": self.tuned_at,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        """Raises ``ValueError`` for what is not a whole decision."""
        try:
            timings = tuple((str(label), None if ms is None else float(ms), None if why is None else str(why))
                            for label, ms, why in data.get("timings", ()))
            decision = cls(
                key=str(data["key"]), kernel=str(data["kernel"]), tuning_key=str(data["tuning_key"]),
                device_name=str(data["device_name"]), triton_version=str(data["triton_version"]),
                config=str(data["config"]), label=str(data["label"]), timings=timings,
                tuned_at=float(data.get("tuned_at", 0.0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a tuning decision ({type(exc).__name__}: {exc})") from None
        if len(decision.key) != 64 or any(c not in "0123456789abcdef" for c in decision.key):
            raise ValueError("not a tuning decision (its key is not a SHA-256 hex digest)")
        return decision

    def to_bytes(self) -> bytes:
        body = json.dumps(self.to_dict(), sort_keys=True).encode()
        return _MAGIC + struct.pack("<B", _VERSION) + hashlib.sha256(body).digest() + body

    @classmethod
    def from_bytes(cls, data: bytes) -> Decision:
        """Raises ``ValueError`` for bytes that are not a whole, intact decision."""
        head = len(_MAGIC)
        if not data.startswith(_MAGIC) or len(data) < head + 33:
            raise ValueError("not an aiocompile tuning decision")
        (version,) = struct.unpack_from("<B", data, head)
        if version != _VERSION:
            raise ValueError(f"unsupported decision format version {version}")
        digest, body = data[head + 1:head + 33], data[head + 33:]
        if hashlib.sha256(body).digest() != digest:
            raise ValueError("the decision's bytes are corrupted (checksum mismatch)")
        try:
            return cls.from_dict(json.loads(body))
        except json.JSONDecodeError as exc:
            raise ValueError(f"the decision's body is not JSON: {exc}") from None


class Decisions:
    """Decisions in memory, in front of a disk cache directory (or none)."""

    def __init__(self, disk: Any = None) -> None:
        self.disk = disk
        self._lock = threading.Lock()
        self._memory: dict[str, Decision] = {}

    def remembered(self, key: str) -> Decision | None:
        with self._lock:
            return self._memory.get(key)

    def load(self, key: str) -> Decision | None:
        """From the disk (blocking); kept in memory once found."""
        if self.disk is None:
            return None
        found = self.disk.load(key, Decision.from_bytes)
        if found is None:
            return None
        decision: Decision = found[0]
        with self._lock:
            self._memory.setdefault(key, decision)
        return decision

    def keep(self, decision: Decision) -> None:
        with self._lock:
            self._memory[decision.key] = decision
        if self.disk is not None:
            self.disk.store(decision.key, decision.to_bytes)

    def forget(self, key: str) -> None:
        """A decision that no longer matches the kernel's configurations."""
        with self._lock:
            self._memory.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._memory)


# -- carrying decisions between machines (``aiocompile decisions``) ------------------------------

EXPORT_FORMAT = "aiocompile-decisions/1"


def tuning_directory(cache_dir: str | os.PathLike[str]) -> Path:
    return Path(cache_dir) / SUBDIRECTORY


def read_all(cache_dir: str | os.PathLike[str], secret: bytes | str | None = None) -> tuple[list[Decision], Any]:
    """Every decision kept in ``cache_dir`` that its trust rules let be read (see
    ``_cache.disk``), and the cache that read them."""
    from aiocompile._cache.disk import SUFFIX, DiskCache

    directory = tuning_directory(cache_dir)
    if not directory.is_dir():
        return [], None
    disk = DiskCache(directory, None, secret)
    found = []
    for path in sorted(directory.glob(f"*/*{SUFFIX}")):
        loaded = disk.load(path.name[:-len(SUFFIX)], Decision.from_bytes)
        if loaded is not None:
            found.append(loaded[0])
    disk.close()
    return found, disk


def write_all(cache_dir: str | os.PathLike[str], decisions: list[Decision], secret: bytes | str | None = None) -> Any:
    """Keep ``decisions`` in ``cache_dir`` (sealed with ``secret`` if given); returns the
    cache, whose ``access`` and ``writes`` say what became of them."""
    from aiocompile._cache.disk import DiskCache

    disk = DiskCache(tuning_directory(cache_dir), None, secret)
    for decision in decisions:
        disk.store(decision.key, decision.to_bytes)
    disk.close(wait=True)
    return disk


def export_text(decisions: list[Decision]) -> str:
    return json.dumps({"format": EXPORT_FORMAT, "decisions": [d.to_dict() for d in decisions]}, indent=1,
                      sort_keys=True) + "\n"


def import_text(text: str) -> list[Decision]:
    """Raises ``ValueError`` for text that is not an export of decisions."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT or not isinstance(data.get("decisions"), list):
        raise ValueError(f"not an export of tuning decisions (format {EXPORT_FORMAT!r})")
    return [Decision.from_dict(item) for item in data["decisions"]]
