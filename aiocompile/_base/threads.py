"""Threads for the blocking work the parent process does itself: computing keys, loading
binaries, restoring Inductor kernels.

Why not ``anyio.to_thread.run_sync`` for each call: it starts a new thread whenever none
is idle, so thirty-two requests arriving together start thirty-two threads from the event
loop's thread. ``Thread.start()`` waits until the new thread has run, and for that the
new thread needs the GIL, which a busy thread (hashing a kernel source, building a
launcher) gives up only at the interpreter's switch interval. The loop sat through those
waits one after the other, one per request of the burst. A lane is a few long-lived
threads, started once per process; work waits in its queue instead.

A new thread, a lane's or one of :func:`start`'s, first goes without the GIL for a
moment: otherwise the starting thread, which ``start()`` makes wait until the new one
runs, waits again for the lock until the switch interval runs out (the new thread runs
Python at once).

A lane's executor belongs to the process that made it: after ``fork()`` the child gets a
fresh one (the parent's threads do not exist there, but its executor would believe they
do and never start one).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from importlib.machinery import ExtensionFileLoader, ModuleSpec
from typing import Any, Callable, TypeVar

from aiocompile._base import aside, bridge, bytecode, libraries

T = TypeVar("T")


class Lane:
    """A named pool of ``threads`` threads, created on first use in each process."""

    def __init__(self, name: str, threads: int) -> None:
        self.name = name
        self.threads = threads
        self._lock = threading.Lock()
        self._executor: cf.ThreadPoolExecutor | None = None
        self._pid = -1

    def submit(self, fn: Callable[[], T]) -> cf.Future[T]:
        """``fn()`` in one of the lane's threads; in the calling thread where none can
        take it (the interpreter is exiting: its thread pools take no new work), so that
        work handed over then, such as a compile's end met while its scheduler closes at
        exit, is done all the same."""
        try:
            return self._get().submit(_then_yield, fn)
        except RuntimeError:
            future: cf.Future[T] = cf.Future()
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the future's waiter meets it
                future.set_exception(exc)
            return future

    def prestart(self) -> None:
        """Start a thread of the lane now, where none is (called from a thread of
        aiocompile's): a first :meth:`submit` from an event loop's thread then hands its
        work to a thread waiting for it, rather than starting one and waiting for it to
        start (1 ms in a quiet process, 10 ms on 2 busy CPUs)."""
        self.submit(_nothing)

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in one of the lane's threads, awaited without holding the loop.

        Cancelling the await does not stop ``fn``: it runs to its end and its result is
        dropped (what runs here is keys and loads, harmless to finish)."""
        return await bridge.wait(self.submit(fn))

    def _get(self) -> cf.ThreadPoolExecutor:
        pid = os.getpid()
        executor = self._executor
        if executor is None or self._pid != pid:
            with self._lock:
                if self._executor is None or self._pid != pid:
                    self._executor = cf.ThreadPoolExecutor(self.threads, thread_name_prefix=self.name,
                                                           initializer=_let_the_starter_go)
                    self._pid = pid
                executor = self._executor
        return executor


def start(fn: Callable[[], T], name: str, *, daemon: bool = False) -> cf.Future[T]:
    """``fn()`` in a thread of its own, started; its result (or exception) in the future
    returned. ``start()`` returns without waiting for the GIL that the new thread would
    otherwise hold for a switch interval."""
    future: cf.Future[T] = cf.Future()

    def run() -> None:
        _let_the_starter_go()
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - the future's waiter meets it
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=daemon).start()
    return future


def _nothing() -> None:
    return None


def _let_the_starter_go() -> None:
    # A moment without the GIL, not just a release: a thread that only lets go (sleep(0))
    # can take the lock back before the starter, woken by the kernel, gets to it; the
    # starter then waits out a switch interval after all. In a millisecond it has taken
    # the lock, finished what it was doing and, in a loop's thread, gone back to the loop.
    time.sleep(0.001)


class _YieldingFinder:
    """A finder first on ``sys.meta_path``, for the threads inside :func:`imports_yielding`
    only: it lets go of the GIL before each module they import, has a module without
    bytecode of its own loaded from aiocompile's (:mod:`.bytecode`) rather than compiled
    from its source, holding the lock, again, and an extension module's library opened
    without the lock first (:mod:`.libraries`)."""

    def __init__(self) -> None:
        self.inside: dict[int, int] = {}  # thread ident -> how deep inside

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> ModuleSpec | None:
        if threading.get_ident() not in self.inside:
            return None
        time.sleep(IMPORT_PAUSE)
        spec = bytecode.find_spec_after(self, name, path, target)
        if spec is not None and type(spec.loader) is ExtensionFileLoader and spec.origin:
            libraries.open_unlocked(spec.origin)  # its library's start-up, without the lock
        return spec


IMPORT_PAUSE = 0.0001
"""How long a thread inside :func:`imports_yielding` goes without the GIL before each
module: long enough for a thread waiting for the lock, woken by the kernel, to take it (a
bare release, ``sleep(0)``, is often taken back first); a package's worth of modules
costs the importing thread about 10 ms more."""


_FINDER = _YieldingFinder()
_finder_lock = threading.Lock()


@contextlib.contextmanager
def imports_yielding() -> Iterator[None]:
    """Imports made by this thread inside the block let go of the GIL before each module,
    and the interpreter hands the lock over often meanwhile (:func:`handing_over`).

    A thread that imports a package's worth of modules (a scheduler's stack) runs Python
    for tens of milliseconds; a loop's thread that wants the GIL meanwhile gets it only
    when the switch interval (5 ms) runs out, each time, and a third thread's turn can
    double that. Let go at every module, the loop waits at most for one module's import.

    The finder stays on ``sys.meta_path`` once put there: taking it off could make an
    import running meanwhile in another thread skip the finder after it."""
    ident = threading.get_ident()
    with _finder_lock:
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
        _FINDER.inside[ident] = _FINDER.inside.get(ident, 0) + 1
    try:
        with handing_over():
            yield
    finally:
        with _finder_lock:
            depth = _FINDER.inside.pop(ident) - 1
            if depth:
                _FINDER.inside[ident] = depth


HANDOVER_INTERVAL = 0.0002
"""The interpreter's switch interval while :func:`handing_over` blocks run (its default is
5 ms)."""


class _Handover:
    """The switch interval this process had before the first :func:`handing_over` block
    that is still running, and how many are."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.saved = 0.0


_HANDOVER = _Handover()


@contextlib.contextmanager
def handing_over() -> Iterator[None]:
    """Lower the interpreter's switch interval to ``HANDOVER_INTERVAL`` while the block
    runs (in any number of threads at once), then put back what was there. (0.2 ms: on a
    GPU host, beside a background compile's load imports, eager calls of a small conv net
    had a p99 of 11.3 ms with it, 16.6 and 22.7 ms with 0.5 ms, 20.6 to 132.7 ms with the
    default.)

    Work that runs Python in a thread of the serving process for seconds (the modules a
    compiled version's load needs, the load itself) holds the GIL until a thread that
    waits for it has waited the whole switch interval. A model's eager call lets the lock
    go at each of its operators and waits for it again after each, so with such work
    beside it, a call of a small network waited out the interval dozens of times: 50 to
    200 ms a call, on a GPU host, where it takes 1 ms alone. The interval is the
    process's own setting: it is put back when the last block ends, unless someone
    changed it meanwhile.

    Inside the block, this thread also stands aside while a call is being served
    (:mod:`.aside`)."""
    with _HANDOVER.lock:
        if _HANDOVER.inside == 0:
            _HANDOVER.saved = sys.getswitchinterval()
            if _HANDOVER.saved > HANDOVER_INTERVAL:
                sys.setswitchinterval(HANDOVER_INTERVAL)
        _HANDOVER.inside += 1
    # And this thread stands aside while a call is being served (``aside.serve_begin``).
    attached = aside.attach()
    try:
        yield
    finally:
        aside.detach(attached)
        with _HANDOVER.lock:
            _HANDOVER.inside -= 1
            if _HANDOVER.inside == 0 and _HANDOVER.saved > HANDOVER_INTERVAL \
                    and abs(sys.getswitchinterval() - HANDOVER_INTERVAL) < 1e-9:
                sys.setswitchinterval(_HANDOVER.saved)


def _then_yield(fn: Callable[[], T]) -> T:
    """``fn()``, then a moment without the interpreter lock. A lane's thread runs Python
    task after task (a burst of keys to hash); an event loop waiting for the lock would
    otherwise get it only when the interpreter's switch interval (5 ms) runs out."""
    try:
        return fn()
    finally:
        time.sleep(0)


# Keys are computed one at a time anyway (a backend's key computation is serialised:
# Triton's hashing is not thread-safe and runs under the GIL), so one thread serves them.
KEYS = Lane("aiocompile-keys", 1)
# Loads wait on the driver and on the host C compiler (Triton <= 3.6 builds a launcher per
# signature), so a few run side by side.
LOADS = Lane("aiocompile-load", min(4, os.cpu_count() or 1))


def preload_async_backend(library: str) -> None:
    """Import, in a lane's thread, the parts of anyio that its first use would otherwise
    import in the event loop's thread, holding the loop for as long as the imports take."""

    def imports() -> None:
        import importlib

        for name in ("anyio.abc", "anyio.to_thread", "anyio.lowlevel", f"anyio._backends._{library}"):
            try:
                importlib.import_module(name)
            except ImportError:  # a private module renamed in some anyio: nothing to warm
                pass

    LOADS.submit(imports)


def preload_for_current_loop() -> bool:
    """``preload_async_backend`` for the library running here; False outside a loop."""
    try:
        library = bridge.current_library()
    except RuntimeError:
        return False
    preload_async_backend(library)
    return True
