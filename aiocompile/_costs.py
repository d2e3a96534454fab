"""How long kernels took to compile, remembered so that a batch can start its longest
compiles first.

A batch of compiles on W workers ends when its last compile ends. Started in the order
given, a long compile that happens to come last runs alone at the end while the other
workers idle; started longest first, the short ones fill in around the long ones (the
classic longest-processing-time rule, within 4/3 of the best order). That needs each
compile's cost before it runs, so the scheduler notes every compile's run time (worker
time, from the timing record) by key, and by family: the kernel's name, backend and
target, which is what a new configuration of a known kernel has in common with the old
ones. A key seen before is estimated by its own time; a new key by its family's mean.

The history lives in memory for the scheduler's life and, given a path, in a JSON file
that later processes read: ``{"version": 1, "costs": {key: [seconds, name, backend,
target, when]}}``. Writes merge with what the file holds (another process may have written
it meanwhile), keep the newest ``limit`` entries and replace the file atomically.
Compiles Triton answered from its own disk cache are not noted: their time says nothing
about the compile.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from typing import Any

_VERSION = 1
Family = tuple[str, str, str]


class CostHistory:
    def __init__(self, path: str | None = None, limit: int = 20000, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        """Read the file, never write it (it is in a directory this process may not write)."""
        self.limit = limit
        self._lock = threading.Lock()
        self._costs: dict[str, list[Any]] = {}
        self._families: dict[Family, list[float]] = {}  # [sum, count]
        self._loaded = path is None
        self._dirty = False
        self._save_lock = threading.Lock()  # one write at a time; a later save waits

    def __len__(self) -> int:
        with self._lock:
            return len(self._costs)

    # -- reading -----------------------------------------------------------------------------

    def load(self) -> None:
        """Read the file once (blocking: call it off the event loop). A missing or
        unreadable file is an empty history, never an error: it only orders work."""
        if self._loaded:
            return
        entries = self._read()
        with self._lock:
            if self._loaded:
                return
            for key, entry in entries.items():
                self._costs.setdefault(key, entry)
            self._rebuild_families()
            self._loaded = True

    def estimate(self, key: str | None, name: str, backend: str, target: str | None) -> float | None:
        """Seconds the compile of ``key`` is expected to take, or None if nothing like it
        has been seen."""
        with self._lock:
            entry = self._costs.get(key) if key is not None else None
            if entry is not None:
                return float(entry[0])
            total = self._families.get((name, backend, str(target)))
            return total[0] / total[1] if total else None

    # -- writing -----------------------------------------------------------------------------

    def note(self, key: str | None, name: str, backend: str, target: str | None, seconds: float) -> None:
        """A compile of ``key`` ran for ``seconds`` of worker time."""
        if key is None or not seconds > 0:
            return
        family = (name, backend, str(target))
        with self._lock:
            old = self._costs.get(key)
            if old is not None:
                self._forget(old)
            self._costs[key] = [float(seconds), name, backend, str(target), time.time()]
            total = self._families.setdefault(family, [0.0, 0])
            total[0] += seconds
            total[1] += 1
            self._dirty = True

    def save(self) -> None:
        """Write the history to its file, merged with what the file holds now (blocking)."""
        if self.path is None or self.read_only:
            return
        with self._save_lock:
            self._save(self.path)

    def _save(self, path: str) -> None:
        with self._lock:
            if not self._dirty:
                return
            mine = dict(self._costs)
            self._dirty = False
        merged = self._read()
        for key, entry in mine.items():
            if key not in merged or merged[key][4] <= entry[4]:
                merged[key] = entry
        if len(merged) > self.limit:
            newest = sorted(merged.items(), key=lambda item: item[1][4])[-self.limit:]
            merged = dict(newest)
        directory = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".costs-", dir=directory)
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _VERSION, "costs": merged}, f, separators=(",", ":"))
            os.replace(tmp, path)
        except OSError:
            # Ordering is an optimisation: a read-only or full disk must not fail a compile.
            with self._lock:
                self._dirty = True

    # -- inside ------------------------------------------------------------------------------

    def _read(self) -> dict[str, list[Any]]:
        if self.path is None:
            return {}
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != _VERSION or not isinstance(data.get("costs"), dict):
            return {}
        good: dict[str, list[Any]] = {}
        for key, entry in data["costs"].items():
            if (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[0], (int, float)) and entry[0] > 0
                    and all(isinstance(part, str) for part in entry[1:4])
                    and isinstance(entry[4], (int, float))):
                good[str(key)] = entry
        return good

    def _rebuild_families(self) -> None:
        self._families.clear()
        for entry in self._costs.values():
            total = self._families.setdefault((entry[1], entry[2], entry[3]), [0.0, 0])
            total[0] += entry[0]
            total[1] += 1

    def _forget(self, entry: list[Any]) -> None:
        total = self._families.get((entry[1], entry[2], entry[3]))
        if total is not None:
            total[0] -= entry[0]
            total[1] -= 1
            if total[1] <= 0:
                del self._families[(entry[1], entry[2], entry[3])]


def longest_first(estimates: list[float | None]) -> list[int]:
    """Indexes in the order to start them: longest estimate first. A job with no estimate
    counts as the median of the others (a neutral guess); with no estimates at all the
    order given is kept. The sort is stable, so equal estimates keep their order."""
    known = sorted(e for e in estimates if e is not None)
    if not known:
        return list(range(len(estimates)))
    median = known[len(known) // 2]
    filled = [median if estimate is None else estimate for estimate in estimates]
    return sorted(range(len(filled)), key=lambda i: -filled[i])
