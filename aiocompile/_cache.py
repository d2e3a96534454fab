"""The CompiledTritonKernels cache: finished results by key, and single-flight entries.

Concurrent requests for one key share one :class:`Entry` and so one job; later requests
are answered from the finished results. An entry leaves the in-flight table when its job
ends: into the results on success, and nowhere on failure, so a crash, timeout or
cancellation is never remembered.

Thread-safe: requests arrive from any event loop in any thread, and jobs finish in the
pool's supervisor thread.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from aiocompile._pool import Job


@dataclass(eq=False)
class Entry:
    """One job and the requests waiting on it."""

    key: str | None
    future: cf.Future[Any] = field(default_factory=cf.Future)
    job: Job | None = None
    waiters: int = 1
    load_time: float | None = None


class KernelCache:
    def __init__(self, max_entries: int) -> None:
        # Re-entrant: stopping a job (under this lock) runs its done-callbacks in this
        # very thread, and they come back here.
        self._lock = threading.RLock()
        self._max_entries = max_entries
        self._results: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._in_flight: dict[str, Entry] = {}

    def __len__(self) -> int:
        return len(self._results)

    def get(self, key: str) -> tuple[bool, Any]:
        with self._lock:
            if key in self._results:
                self._results.move_to_end(key)
                return True, self._results[key]
        return False, None

    def join_or_start(self, key: str | None, start: Callable[[Entry], None]) -> tuple[str, Any]:
        """("hit", result), ("joined", entry) or ("started", entry).

        ``start(entry)`` submits the job; it runs outside the lock and, if it raises, the
        entry is withdrawn (any request that joined it in between gets the same error).
        """
        if key is None:
            entry = Entry(None)
            start(entry)
            return "started", entry
        with self._lock:
            if key in self._results:
                self._results.move_to_end(key)
                return "hit", self._results[key]
            shared = self._in_flight.get(key)
            if shared is not None:
                shared.waiters += 1
                return "joined", shared
            entry = self._in_flight[key] = Entry(key)
        try:
            start(entry)
        except BaseException as exc:
            self.discard(entry)
            if not entry.future.done():
                entry.future.set_exception(exc)
            raise
        return "started", entry

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

    def complete(self, entry: Entry, result: Any) -> None:
        with self._lock:
            if entry.key is None:
                return
            if self._in_flight.get(entry.key) is entry:
                del self._in_flight[entry.key]
            if self._max_entries:
                self._results[entry.key] = result
                self._results.move_to_end(entry.key)
                while len(self._results) > self._max_entries:
                    self._results.popitem(last=False)

    def discard(self, entry: Entry) -> None:
        with self._lock:
            if entry.key is not None and self._in_flight.get(entry.key) is entry:
                del self._in_flight[entry.key]

    def clear(self) -> None:
        with self._lock:
            self._results.clear()
