"""How long compiles take: measured, remembered, and predicted before a compile has ever
run, so that a batch can start its longest compiles first.

A batch of compiles on W workers ends when its last compile ends. Started in the order
given, a long compile that happens to come late runs alone at the end while the other
workers idle; started longest first, the short ones fill in around the long ones (the
classic longest-processing-time rule, within 4/3 of the best order). That needs each
compile's cost before it runs. In order of trust:

1. the compile's own key was measured before: that time;
2. its family (the kernel's name, backend and target: what a new configuration of a known
   kernel has in common with the old ones) was measured: the model's prediction corrected
   by how far the model was off for that family (the mean of the log residuals, shrunk
   toward 0 by n/(n+1)), or, for a backend that describes nothing, the family's mean time;
3. otherwise the model, from what the request knows before it runs (``Request.features``),
   corrected likewise by its target's residuals where that target was measured.

The model is a small linear regression of log(seconds), one per backend, on the terms of
``TERMS`` (for Triton: source size, tile, warps, ``tl.dot``, stages; for the others the
source's size), learned from every compile as a ridge regression toward ``PRIORS``
(``PRIOR_WEIGHTS`` say how far); ``CostHistory.model(backend)`` shows it. docs/architecture.md
("Ordering a batch") tells why each term is there.

The history lives in memory and, given a path, in a JSON file later processes read
(``{"version": 2, "costs": {key: [seconds, name, backend, target, when, features]}}``);
writes merge with what the file holds and replace it atomically. With a shared cache
(``cache_url``) it is kept there too, so a fresh machine starts with the fleet's history.
Compiles Triton answered from its own disk cache are not noted: their time says nothing
about the compile.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

_VERSION = 2
_READABLE = (1, 2)
Family = tuple[str, str, str]
Features = Mapping[str, float]

TERMS = ("bias", "source", "tile", "warps", "dot", "dot*tile", "dot*warps", "dot*stages")
"""The model's terms, each a function of the request's features (see ``terms``)."""

# Each feature is measured from a reference: a kernel of 1 KB of source, a tile of 1024
# elements and 4 warps; a matmul's tile from 64x64x32 and its stages from 3. A feature a
# backend does not give counts as the reference, and the bias is then the log time of the
# reference kernel, which the first compiles on a machine correct without tilting the rest.
_CENTRE = {"source": 10.0, "tile": 10.0, "warps": 2.0}
_DOT_CENTRE = {"tile": 17.0, "warps": 2.0, "stages": 3.0}

PRIORS: dict[str, tuple[float, ...]] = {
    # log(seconds) per unit of each term, fitted once to serial compiles of the benchmark
    # kernel sets (benchmarks/_kernel_set.py: vector adds, softmaxes, layer norms and
    # matmuls in many tile, dtype and warp configurations) and rounded; refitted toward
    # this machine's own compiles after each one (PRIOR_WEIGHTS). CostHistory.model()
    # shows the values in use.
    "triton": (-1.4, 0.33, 0.19, -0.21, -0.58, 0.26, -0.43, -0.05),
}
DEFAULT_PRIOR = (-1.4, 0.33, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
"""Other backends: the source's size alone, as for Triton."""
PRIOR_WEIGHTS = (0.01, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
"""How many observations the prior's value of each term counts as. The bias hardly
counts: the first compile on a machine sets how fast the machine is, and the slopes move
only as far as the compiles measured tell them apart."""


def terms(features: Features) -> list[float]:
    """The model's terms (``TERMS``) for a request's features."""
    get = features.get
    source, tile, warps = (float(get(name, centre)) for name, centre in _CENTRE.items())
    dot = float(get("dot", 0.0))
    return [1.0, source - 10.0, tile - 10.0, warps - 2.0, dot,
            dot * (tile - _DOT_CENTRE["tile"]), dot * (warps - _DOT_CENTRE["warps"]),
            dot * (float(get("stages", _DOT_CENTRE["stages"])) - _DOT_CENTRE["stages"])]


class _Sums:
    """Sums over a set of measured compiles: their count, the sum of their log times and
    of their terms. The mean residual of a model over them is then one dot product."""

    __slots__ = ("count", "log_seconds", "terms")

    def __init__(self) -> None:
        self.count = 0
        self.log_seconds = 0.0
        self.terms = [0.0] * len(TERMS)

    def add(self, x: Sequence[float], y: float, sign: int) -> None:
        self.count += sign
        self.log_seconds += sign * y
        for i, value in enumerate(x):
            self.terms[i] += sign * value

    def residual(self, coefficients: Sequence[float]) -> float:
        """The mean of log(measured) - log(predicted), shrunk toward 0 by n / (n + 1)."""
        if self.count <= 0:
            return 0.0
        predicted = sum(c * t for c, t in zip(coefficients, self.terms))
        return (self.log_seconds - predicted) / (self.count + 1)


class _Model:
    """One backend's regression: the sums ridge regression needs (X'X and X'y), solved
    when asked after a change."""

    def __init__(self, prior: tuple[float, ...]) -> None:
        self.prior = prior
        size = len(TERMS)
        self.xtx = [[0.0] * size for _ in range(size)]
        self.xty = [0.0] * size
        self.count = 0
        self._coefficients: list[float] | None = list(prior)

    def add(self, x: Sequence[float], y: float, sign: int) -> None:
        for i, xi in enumerate(x):
            if xi:
                row = self.xtx[i]
                for j, xj in enumerate(x):
                    row[j] += sign * xi * xj
                self.xty[i] += sign * xi * y
        self.count += sign
        self._coefficients = None

    def coefficients(self) -> list[float]:
        if self._coefficients is None:
            # (X'X + W) b = X'y + W prior, W diagonal: the prior's value of term i counts as
            # W[i] observations of it (ridge regression toward the prior).
            size = len(TERMS)
            a = [[self.xtx[i][j] + (PRIOR_WEIGHTS[i] if i == j else 0.0) for j in range(size)] for i in range(size)]
            b = [self.xty[i] + PRIOR_WEIGHTS[i] * self.prior[i] for i in range(size)]
            self._coefficients = _solve(a, b) or list(self.prior)
        return self._coefficients


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (Gauss-Jordan with partial pivoting; a is small and positive definite)."""
    n = len(b)
    rows = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-12:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col and rows[r][col]:
                factor = rows[r][col] / rows[col][col]
                for k in range(col, n + 1):
                    rows[r][k] -= factor * rows[col][k]
    return [rows[i][n] / rows[i][i] for i in range(n)]


class FleetCosts(Protocol):
    """Where a fleet keeps its cost history (a ``SharedCache``). Both calls block, and
    never raise: what cannot be read is nothing, what cannot be written is reported."""

    def read_costs(self) -> dict[str, Any]: ...

    def write_costs(self, entries: dict[str, list[Any]], limit: int) -> bool: ...


class CostHistory:
    def __init__(self, path: str | None = None, limit: int = 20000, read_only: bool = False,
                 fleet: FleetCosts | None = None) -> None:
        self.path = path
        self.fleet = fleet
        """The fleet's history, read with the file and written at each save."""
        self.read_only = read_only
        """Read the file, never write it (it is in a directory this process may not write)."""
        self.limit = limit
        self._lock = threading.Lock()
        self._costs: dict[str, list[Any]] = {}
        self._families: dict[Family, list[float]] = {}  # [sum of seconds, count], every entry
        self._models: dict[str, _Model] = {}
        self._family_sums: dict[Family, _Sums] = {}  # entries with features
        self._target_sums: dict[tuple[str, str], _Sums] = {}
        self._loaded = path is None and fleet is None
        self._dirty = False
        self._unshared: dict[str, list[Any]] = {}  # noted since the last write to the fleet's
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
        if self.fleet is not None:
            for key, entry in _checked(self.fleet.read_costs()).items():
                if key not in entries or entries[key][4] < entry[4]:
                    entries[key] = entry
        with self._lock:
            if self._loaded:
                return
            for key, entry in entries.items():
                if key not in self._costs:
                    self._costs[key] = entry
                    self._count(entry, 1)
            self._loaded = True

    def estimate(self, key: str | None, name: str, backend: str, target: str | None,
                 features: Features | Sequence[tuple[str, float]] = ()) -> float | None:
        """Seconds the compile of ``key`` is expected to take, or None if nothing is known
        about it: neither it, nor its family, nor (without features) anything at all."""
        family = (name, backend, str(target))
        with self._lock:
            entry = self._costs.get(key) if key is not None else None
            if entry is not None:
                return float(entry[0])
            if not features:
                total = self._families.get(family)
                return total[0] / total[1] if total else None
            model = self._model(backend)
            coefficients = model.coefficients()
            x = terms(dict(features))
            log_seconds = sum(c * t for c, t in zip(coefficients, x))
            sums = self._family_sums.get(family)
            if sums is None or sums.count <= 0:
                total = self._families.get(family)
                if total:  # measured, but described by nothing the model can use
                    return total[0] / total[1]
                sums = self._target_sums.get((backend, str(target)))
            if sums is not None:
                log_seconds += sums.residual(coefficients)
            return math.exp(max(-20.0, min(10.0, log_seconds)))

    def model(self, backend: str) -> dict[str, Any]:
        """The model in use for ``backend``: its coefficients by term, the prior's, and how
        many measured compiles it has learnt from."""
        with self._lock:
            model = self._model(backend)
            return {"terms": dict(zip(TERMS, model.coefficients())), "prior": dict(zip(TERMS, model.prior)),
                    "compiles": model.count}

    # -- writing -----------------------------------------------------------------------------

    def note(self, key: str | None, name: str, backend: str, target: str | None, seconds: float,
             features: Features | Sequence[tuple[str, float]] = ()) -> None:
        """A compile of ``key`` ran for ``seconds`` of worker time."""
        if key is None or not seconds > 0:
            return
        entry = [float(seconds), name, backend, str(target), time.time(), dict(features) if features else None]
        with self._lock:
            old = self._costs.get(key)
            if old is not None:
                self._count(old, -1)
            self._costs[key] = entry
            self._count(entry, 1)
            self._dirty = True
            if self.fleet is not None:
                self._unshared[key] = entry

    def save(self) -> None:
        """Write the history to its file, merged with what the file holds now, and what
        was noted since the last save to the fleet's (blocking)."""
        with self._save_lock:
            if self.fleet is not None:
                self._share(self.fleet)
            if self.path is not None and not self.read_only:
                self._save(self.path)

    def _share(self, fleet: FleetCosts) -> None:
        with self._lock:
            entries, self._unshared = self._unshared, {}
        if entries and not fleet.write_costs(entries, self.limit):
            with self._lock:  # sent with the next save, unless noted anew meanwhile
                for key, entry in entries.items():
                    self._unshared.setdefault(key, entry)

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
        if not isinstance(data, dict) or data.get("version") not in _READABLE \
                or not isinstance(data.get("costs"), dict):
            return {}
        return _checked(data["costs"])

    def _model(self, backend: str) -> _Model:
        model = self._models.get(backend)
        if model is None:
            model = self._models[backend] = _Model(PRIORS.get(backend, DEFAULT_PRIOR))
        return model

    def _count(self, entry: list[Any], sign: int) -> None:
        """Add ``entry`` to (sign 1) or take it out of (sign -1) every sum it is part of."""
        seconds, name, backend, target, _, features = entry
        family = (name, backend, target)
        total = self._families.setdefault(family, [0.0, 0])
        total[0] += sign * seconds
        total[1] += sign
        if total[1] <= 0:
            del self._families[family]
        if features:
            x, y = terms(features), math.log(seconds)
            self._model(backend).add(x, y, sign)
            self._family_sums.setdefault(family, _Sums()).add(x, y, sign)
            self._target_sums.setdefault((backend, target), _Sums()).add(x, y, sign)


def _checked(costs: Mapping[str, Any]) -> dict[str, list[Any]]:
    """The well-formed entries of ``costs`` (as a file or the fleet's history holds them),
    in the form kept in memory."""
    good: dict[str, list[Any]] = {}
    for key, entry in costs.items():
        if (isinstance(entry, list) and len(entry) in (5, 6) and _number(entry[0]) and entry[0] > 0
                and all(isinstance(part, str) for part in entry[1:4]) and _number(entry[4])):
            features = entry[5] if len(entry) == 6 else None
            if features is not None and not (isinstance(features, dict)
                                             and all(isinstance(k, str) and _number(v) for k, v in features.items())):
                continue
            good[str(key)] = [*entry[:5], features]
    return good


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
