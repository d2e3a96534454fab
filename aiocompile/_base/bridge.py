"""Awaiting a ``concurrent.futures.Future`` from asyncio (uvloop too) or trio.

One interface, one implementation per event loop, chosen by the loop that is running.
The future's done-callback runs in the pool's supervisor thread; it only schedules a
wake-up in the waiting loop (``call_soon_threadsafe`` / ``run_sync_soon``), never blocks,
and tolerates a loop that has gone away in the meantime.

Cancelling the await does not cancel the future: whether a job stops when its waiter
goes away is the scheduler's decision (other callers may be waiting on the same job).
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def running_loop() -> Any:
    """The asyncio event loop running in this thread, or None (none runs, or trio does).
    Asked without importing asyncio: a process that never imported it runs no loop."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return None
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def current_library() -> str:
    """'asyncio' or 'trio': the async library running the current task."""
    try:
        import asyncio

        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
            return "trio"
        except RuntimeError:
            pass
    raise RuntimeError("aiocompile must be awaited from a running asyncio or trio event loop")


def soon_here(fn: Callable[[], Any]) -> bool:
    """Have the event loop running in this thread call ``fn``, in this thread, once it is
    done with what it runs now (a task's step, a callback); False where none runs here
    (asyncio and loops of its API, such as uvloop's, or trio). Asked without importing
    either: a process that never imported one runs none of its loops."""
    loop = running_loop()
    if loop is not None:
        loop.call_soon(fn)
        return True
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            return False
        token.run_sync_soon(fn)
        return True
    return False


async def wait(future: cf.Future[T]) -> T:
    """The result of ``future``, waiting without blocking the event loop."""
    if not future.done():
        loop = running_loop()
        if loop is not None:
            waiter = loop.create_future()
            future.add_done_callback(_AsyncioWaker(loop, waiter))
            await waiter
        elif current_library() == "trio":  # raises where neither runs
            await _wait_trio(future)
    return settled(future)


def settled(future: cf.Future[T]) -> T:
    """The result of ``future``, which is done, or its exception raised."""
    try:
        return future.result()  # one look under the future's lock, where most answers end
    except BaseException as exc:
        error = exc
    # The same exception object reaches every caller that shared the job; start its
    # traceback afresh here, or each raise would pile its frames onto the last one's.
    raise error.with_traceback(None)


class Turns:
    """Letting an asyncio event loop go now and then, for awaits that often have their
    answer without waiting (``Scheduler.run``'s, whose answer the task looks for itself):
    such an await returns at once, as a stream's read of data already buffered does,
    unless this thread's loop was last let go through here ``HOLD_MAX`` seconds ago or
    more; then it yields once. A task awaiting such answers back to back holds its loop
    for about that long at a time, at most."""

    HOLD_MAX = 0.0005

    def __init__(self) -> None:
        self._last = threading.local()

    def let_go(self) -> None:
        """This thread's loop has just been let go (the task waited)."""
        self._last.time = time.monotonic()

    async def now_and_then(self) -> None:
        last = self._last
        if time.monotonic() - getattr(last, "time", 0.0) >= self.HOLD_MAX:
            await sys.modules["asyncio"].sleep(0)
            last.time = time.monotonic()


class Once:
    """A done-callback ``fn(*args, future)`` that forgets ``fn`` and ``args`` once called.

    A ``concurrent.futures.Future`` keeps its callbacks after it is done. A callback that
    holds what holds the future (a job, its cache entry) would make them a reference cycle,
    freed only by the garbage collector's next full pass: a burst of thousands of requests
    left tens of thousands of objects for it, and the pass that freed them held every
    event loop of the process meanwhile."""

    __slots__ = ("_fn", "_args")

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._fn: Callable[..., Any] | None = fn
        self._args = args

    def __call__(self, future: Any) -> None:
        fn, args = self._fn, self._args
        self._fn, self._args = None, ()
        if fn is not None:
            fn(*args, future)


def _wake(waiter: Any) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _AsyncioWaker:
    """Wakes one asyncio waiter when a concurrent future is done, from whichever thread
    finishes it (one object, where closures cost a function and a cell per variable)."""

    __slots__ = ("loop", "waiter", "thread")

    def __init__(self, loop: Any, waiter: Any) -> None:
        self.loop, self.waiter, self.thread = loop, waiter, threading.get_ident()

    def __call__(self, _: cf.Future[Any]) -> None:
        if threading.get_ident() == self.thread:
            # Resolved in the loop's own thread (the loop read the answer itself): the
            # waiter can be woken now, without the self-pipe or another loop iteration.
            _wake(self.waiter)
            return
        try:
            self.loop.call_soon_threadsafe(_wake, self.waiter)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more


async def _wait_trio(future: cf.Future[Any]) -> None:
    import trio

    token = trio.lowlevel.current_trio_token()
    event = trio.Event()

    def on_done(_: cf.Future[Any]) -> None:
        try:
            token.run_sync_soon(event.set)
        except trio.RunFinishedError:
            pass

    future.add_done_callback(on_done)
    await event.wait()
