"""Admission in bounded slices of an event loop's time.

Admitting a request (checking it, pickling its job, handing it to the pool) costs tens of
microseconds in the event loop's thread. Two thousand requests arriving together, say
``gather`` over two thousand ``run()`` calls, would all be admitted in one iteration of the
loop: the loop would be held for the whole burst, every timer and socket of the
application waiting.

A :class:`Gate` per event loop lets requests through for at most ``budget`` seconds of one
iteration, counted from the first admission in it. Requests past that wait, first come
first served; the loop then lets its timers and sockets have their turn, and the gate lets
the next batch through, sized from the rate it measured so that a batch again takes about
``budget``, and so on until nobody waits. A request alone, or a trickle of them, never
waits: the gate only ever holds back what would have run in the same iteration.

The gate learns that an iteration is over from a callback the loop runs in the next one,
scheduled at the second admission of a slice: a request admitted alone needs no watching.
Such a request that then waits for its job closes its slice itself (``Gates.waited``): the
loop has gone round meanwhile. A caller awaiting one request after another thus never
makes the loop turn once more only to tell the gate so (a tenth of a trivial job's round
trip went to that turn).

Cancelling a waiting request drops it before anything about it was counted or started.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

from aiocompile._base.bridge import running_loop

# Long enough to admit dozens of requests at once, short enough that the application's
# timers run about a millisecond late at most; a longer slice lengthens a burst's longest
# tick at the same wall time for the burst (docs/benchmarks.md, bench_loop_lag.py).
BUDGET = 0.001
_MAX_BATCH = 4096


class Gate:
    """One event loop's admission gate. ``soon(callback)`` must run ``callback`` in a
    later iteration of that loop, after what is ready now (``loop.call_soon``, trio's
    ``TrioToken.run_sync_soon``). Used from that loop's thread only."""

    def __init__(self, soon: Callable[[Callable[[], None]], Any], budget: float | None = None) -> None:
        self._soon = soon
        self.budget = BUDGET if budget is None else budget
        self._slice_started: float | None = None
        self._admitted = 0  # in the current slice
        self._marked = False  # _next_slice is scheduled
        self._waiting: collections.deque[Any] = collections.deque()
        self._batch = 0  # how many the next batch lets through (0: not measured yet)
        self._batch_started = 0.0
        self.held = 0  # requests that had to wait, ever (for tests and curiosity)

    def open(self) -> bool:
        """Whether a request may be admitted now, without waiting."""
        if self._waiting:
            return False  # first come, first served
        now = time.perf_counter()
        if self._slice_started is None:
            self._slice_started = now  # alone so far: nothing to watch
            self._admitted = 1
            return True
        if not self._marked:
            # A second admission, perhaps in the first one's iteration: from here on the
            # loop says when its iteration is over. The slice's clock starts again: the
            # first admission may be from an iteration long gone.
            self._marked = True
            self._soon(self._next_slice)
            self._slice_started = now
        if now - self._slice_started >= self.budget:
            if not self._batch:
                # The rate this slice showed: as many as fitted in it.
                self._batch = max(1, self._admitted)
            return False
        self._admitted += 1
        return True

    def close_lone(self) -> None:
        """A request admitted alone in its slice has since waited for its job: the loop
        has gone round since, so the slice is over without its callback."""
        if not self._marked and not self._waiting:
            self._slice_started = None

    def wait(self, waiter: Any) -> None:
        """Queue ``waiter`` (anything with ``wake()`` and ``cancelled``) for a later batch."""
        self.held += 1
        self._waiting.append(waiter)

    def _next_slice(self) -> None:
        # A later iteration: the loop's timers and sockets have had their turn.
        now = time.perf_counter()
        self._slice_started = None
        self._marked = False
        if not self._waiting:
            self._batch = 0
            return
        if self._batch_started:
            # The last batch ran between then and now: size the next one to the budget.
            took = max(now - self._batch_started, 1e-6)
            self._batch = max(1, min(_MAX_BATCH, int(self._batch * self.budget / took)))
        woken = 0
        while self._waiting and woken < self._batch:
            waiter = self._waiting.popleft()
            if not waiter.cancelled:
                waiter.wake()
                woken += 1
        # The woken run in the next iteration, before this (scheduled after them), which
        # then measures them and wakes the next batch; what arrives meanwhile queues.
        self._batch_started = time.perf_counter() if self._waiting else 0.0
        self._slice_started = now
        self._admitted = woken
        self._marked = True
        self._soon(self._next_slice)


class _AsyncioWaiter:
    __slots__ = ("future",)

    def __init__(self, loop: Any) -> None:
        self.future = loop.create_future()

    @property
    def cancelled(self) -> bool:
        return bool(self.future.done())

    def wake(self) -> None:
        self.future.set_result(None)


class _TrioWaiter:
    __slots__ = ("event", "cancelled")

    def __init__(self, trio: Any) -> None:
        self.event = trio.Event()
        self.cancelled = False

    def wake(self) -> None:
        self.event.set()


class Gates:
    """The gates of one scheduler, one per event loop it is used from (held weakly)."""

    def __init__(self) -> None:
        import weakref

        self._gates: weakref.WeakKeyDictionary[Any, Gate] = weakref.WeakKeyDictionary()
        # The loop used last and its gate, looked up without the weak dictionary; a weak
        # reference to the loop, so that this keeps no closed loop alive.
        self._last: tuple[weakref.ref[Any], Gate] | None = None

    def enter_now(self) -> bool:
        """Whether this request may be admitted at once, without an await: the fast way in
        for the usual case (asyncio, the gate open). False: await ``enter()``."""
        loop = running_loop()
        if loop is None:
            return False
        return self._gate(loop).open()

    def _gate(self, loop: Any) -> Gate:
        last = self._last
        if last is not None and last[0]() is loop:
            return last[1]
        import weakref

        found = self._gates.get(loop)
        if found is None:
            found = self._gates[loop] = Gate(loop.call_soon)
        self._last = (weakref.ref(loop), found)
        return found

    def waited(self) -> None:
        """The request admitted last has since waited for its job (its task was suspended,
        so the loop went round): see ``Gate.close_lone``."""
        loop = running_loop()
        if loop is not None:
            self._gate(loop).close_lone()

    async def enter(self) -> None:
        """Return when this request may be admitted: at once, or after waiting its turn."""
        loop = running_loop()
        if loop is None:
            await self._enter_trio()
            return
        gate = self._gate(loop)
        if gate.open():
            return
        waiter = _AsyncioWaiter(loop)
        gate.wait(waiter)
        try:
            await waiter.future
        except BaseException:
            waiter.future.cancel()
            raise

    async def _enter_trio(self) -> None:
        import trio

        token = trio.lowlevel.current_trio_token()
        gate = self._gates.get(token)
        if gate is None:
            gate = self._gates[token] = Gate(token.run_sync_soon)
        if gate.open():
            return
        waiter = _TrioWaiter(trio)
        gate.wait(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            waiter.cancelled = True
            raise
