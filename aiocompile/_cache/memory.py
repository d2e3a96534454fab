"""The memory cache: results by key, in memory, with single-flight entries.

Concurrent requests for one key share one :class:`Entry`, and so one job (or one read of
the disk cache); later requests are answered from the results. An entry leaves the
in-flight table when its job ends: into the results on success; on failure nowhere,
except that a deterministic compile error is remembered for ``error_ttl`` seconds, so
that a loop of bad requests does not keep the pool busy. A crash, a timeout or a
cancellation is never remembered.

The results are a least-recently-used table bounded by a number of entries and by the
bytes the results hold; what falls out is counted in ``evictions``.

Thread-safe: requests arrive from any event loop in any thread, jobs finish in the pool's
supervisor thread, disk reads in the disk cache's threads.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import enum
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from aiocompile._pool.job import Job
from aiocompile.records import Outcome


@dataclass(eq=False)
class Entry:
    """One job and the requests waiting on it."""

    key: str | None
    future: cf.Future[Any] = field(default_factory=cf.Future)
    job: Job | None = None
    waiters: int = 1
    load_time: float | None = None
    source: Outcome = Outcome.COMPILED
    """Where the result came from: a worker (``COMPILED``), ``DISK_HIT`` or ``SHARED_HIT``."""
    details: Mapping[str, Any] | None = None
    """What the backend read from the worker's answer for the record (stage times)."""


class Found(enum.Enum):
    """What the cache made of a request (``KernelCache.join_or_start``)."""

    HIT = "hit"
    """Its result, at once."""
    ERROR = "error"
    """A compile error remembered for its key, at once."""
    JOINED = "joined"
    """The entry of the work already under way for its key."""
    STARTED = "started"
    """A new entry, its work started."""


class Lookup(NamedTuple):
    how: Found
    value: Any
    """The result (``HIT``), the exception (``ERROR``) or the :class:`Entry`."""


class KernelCache:
    def __init__(self, max_entries: int, max_bytes: int | None = None, error_ttl: float = 0.0) -> None:
        # Re-entrant: stopping a job (under this lock) runs its done-callbacks in this
        # very thread, and they come back here.
        self._lock = threading.RLock()
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._error_ttl = error_ttl
        self._results: collections.OrderedDict[str, tuple[Any, int]] = collections.OrderedDict()
        self._bytes = 0
        self._errors: dict[str, tuple[BaseException, float]] = {}
        self._in_flight: dict[str, Entry] = {}
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._results)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> tuple[bool, Any]:
        with self._lock:
            if key in self._results:
                self._results.move_to_end(key)
                return True, self._results[key][0]
        return False, None

    def join_or_start(self, key: str | None, start: Callable[[Entry], None]) -> Lookup:
        """The result, a remembered error, the entry under way, or a new entry started.

        ``start(entry)`` submits the work; it runs outside the lock and, if it raises, the
        entry is withdrawn (any request that joined it in between gets the same error).
        """
        if key is None:
            entry = Entry(None)
            start(entry)
            return Lookup(Found.STARTED, entry)
        with self._lock:
            found = self._results.get(key)
            if found is not None:
                self._results.move_to_end(key)
                return Lookup(Found.HIT, found[0])
            remembered = self._errors.get(key)
            if remembered is not None:
                if remembered[1] > time.monotonic():
                    return Lookup(Found.ERROR, remembered[0])
                del self._errors[key]
            shared = self._in_flight.get(key)
            if shared is not None:
                shared.waiters += 1
                return Lookup(Found.JOINED, shared)
            entry = self._in_flight[key] = Entry(key)
        try:
            start(entry)
        except BaseException as exc:
            self.discard(entry)
            if not entry.future.done():
                entry.future.set_exception(exc)
            raise
        return Lookup(Found.STARTED, entry)

    def leave(self, entry: Entry, stop: Callable[[Entry], bool] | None = None) -> int:
        """A request stops waiting; returns how many still wait.

        When none is left, ``stop(entry)`` may stop the job; if it did, the entry leaves the
        in-flight table at once, so that no new request joins a job that is going away.
        Both happen under the lock, so a request arriving meanwhile either joined before
        (and the job is not stopped) or starts a job of its own.
        """
        with self._lock:
            entry.waiters -= 1
            if entry.waiters == 0 and stop is not None and stop(entry):
                self.discard(entry)
            return entry.waiters

    def abandoned(self, entry: Entry) -> bool:
        """Withdraw ``entry`` if nobody waits for it (before work that is still to start)."""
        with self._lock:
            if entry.waiters > 0:
                return False
            self.discard(entry)
            return True

    def complete(self, entry: Entry, result: Any, size: int = 0) -> None:
        with self._lock:
            if entry.key is None:
                return
            if self._in_flight.get(entry.key) is entry:
                del self._in_flight[entry.key]
            self._errors.pop(entry.key, None)
            if not self._max_entries or (self._max_bytes is not None and size > self._max_bytes):
                return
            old = self._results.pop(entry.key, None)
            if old is not None:
                self._bytes -= old[1]
            self._results[entry.key] = (result, size)
            self._bytes += size
            while len(self._results) > self._max_entries or (
                self._max_bytes is not None and self._bytes > self._max_bytes
            ):
                _, (_, dropped) = self._results.popitem(last=False)
                self._bytes -= dropped
                self.evictions += 1

    def fail(self, entry: Entry, error: BaseException, remember: bool) -> None:
        with self._lock:
            self.discard(entry)
            if remember and entry.key is not None and self._error_ttl > 0:
                self._errors[entry.key] = (error, time.monotonic() + self._error_ttl)

    def discard(self, entry: Entry) -> None:
        with self._lock:
            if entry.key is not None and self._in_flight.get(entry.key) is entry:
                del self._in_flight[entry.key]

    def clear(self) -> None:
        with self._lock:
            self._results.clear()
            self._errors.clear()
            self._bytes = 0
