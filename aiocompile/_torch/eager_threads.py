"""How many of torch's intra-op threads an eager call gets while its model compiles in the
background (``compile_in_background``'s ``eager_threads``).

Torch runs an operator on up to ``torch.get_num_threads()`` threads, OpenMP's, one per core
by default. Between two parallel regions those threads do not sleep at once: OpenMP spins
them a while (libgomp's default: 300,000 turns, milliseconds) so that the next region
starts sooner. A model called every few milliseconds keeps every one of them on a CPU all
the time. On 2 CPUs, a conv1d + MLP called every 5 ms used 1.2 CPUs with torch's two
threads and 0.2 with one, each call as fast. A background compile's processes run behind
the serving process's threads (``SCHED_IDLE`` for a model on the CPU), and had only what the
spinning left: compiled answers 2.3x later than stock ``torch.compile``'s first call,
against 1.3x with one thread. At the same priority as the serving process they took the
spinning threads' CPUs instead, and the eager calls waited for their own threads (p99 27
to 36 times the p99 alone).

So, while one of the wrapper's compiles runs (and for the call that starts one), an eager
call whose thread would run more threads than the CPUs leave (``"auto"``: where the calling
thread's count fills every CPU this process may use, one fewer, at least one) runs with
fewer: ``torch.set_num_threads`` before the call, the caller's count put back after. With
OpenMP, torch's count is the calling thread's own (the other threads keep theirs), and the
threads no region asks for sleep once their spin is over. Torch also notes the count as
the one new threads start with; putting it back puts that back to the caller's count too.
Where torch's threads are not OpenMP's (a build with its own pool, whose size can be set
only once), nothing changes.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

__all__ = ["AUTO", "EagerThreads", "check", "limit_for"]

AUTO = "auto"


def check(value: Any) -> None:
    """``eager_threads`` checked: ``"auto"``, None, or a number of threads (1 or more)."""
    if value is None or value == AUTO and isinstance(value, str):
        return
    if isinstance(value, str):
        raise ValueError(f"eager_threads must be 'auto', None or a number of threads, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"eager_threads must be 'auto', None or a number of threads, got {value!r} "
                        f"({type(value).__name__})")
    if value < 1:
        raise ValueError(f"eager_threads must be 1 or more threads, got {value}")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def limit_for(setting: int | str | None, device: str, threads: int, cpus: int) -> int | None:
    """The threads an eager call gets while compiling, or None to leave the caller's
    ``threads``: ``setting`` where it is a number; for ``"auto"``, on the CPU, one fewer than
    ``cpus`` where ``threads`` would fill them all (at least one)."""
    if setting is None:
        return None
    if isinstance(setting, int):
        return setting if setting < threads else None
    if device != "cpu" or threads < cpus:
        return None
    limit = max(1, cpus - 1)
    return limit if limit < threads else None


@functools.cache
def _openmp(torch: Any) -> bool:
    """Whether torch's intra-op threads are OpenMP's, whose count is per thread."""
    try:
        return "parallel backend: OpenMP" in torch.__config__.parallel_info()
    except Exception:  # noqa: BLE001 - not known: leave the threads as they are
        return False


class EagerThreads:
    """The wrapper's side of it: how many of its compiles run (:meth:`began`, and the
    entry's ``done`` future for its end), and :meth:`call`, which runs an eager call with
    fewer threads while any does."""

    def __init__(self, torch: Any, setting: int | str | None, device: str) -> None:
        self._torch = torch
        self._setting = setting
        self._device = device
        self._cpus = usable_cpus()
        self._running = 0
        self._lock = threading.Lock()

    def began(self, done: Any) -> None:
        """A compile began; ``done`` (a future) resolves when it ends."""
        if self._setting is None:
            return
        with self._lock:
            self._running += 1
        done.add_done_callback(self._ended)

    def _ended(self, _done: Any) -> None:
        with self._lock:
            self._running -= 1

    def call(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], starts: bool = False) -> Any:
        """``fn(*args, **kwargs)``, with fewer of torch's threads while a compile runs (or
        when the call ``starts`` one: its making is under way here meanwhile) and the
        caller's count would leave it no CPU."""
        if not (self._running or starts and self._setting is not None):
            return fn(*args, **kwargs)
        torch = self._torch
        threads = torch.get_num_threads()
        limit = limit_for(self._setting, self._device, threads, self._cpus)
        if limit is None or not _openmp(torch):
            return fn(*args, **kwargs)
        torch.set_num_threads(limit)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
