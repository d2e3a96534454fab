"""A circuit breaker: stops calling a service that keeps failing, and tries it again later.

A shared cache that is down, or slow, must cost compiles nothing. Each call to it is
bounded by a short timeout, and after a few failures in a row the breaker *opens*: calls
are refused at once (a read is a miss, a write is dropped) instead of each waiting out its
timeout. After ``cooldown`` seconds one call goes through as a probe; its outcome closes
the breaker again or keeps it open for another ``cooldown``.

======================  =======================  ==================================
state                   a call                   the machine moves on when
======================  =======================  ==================================
``closed``              goes through             ``failures`` calls in a row fail:
                                                 -> ``open``
``open``                is refused               ``cooldown`` seconds have passed and
                                                 a call asks: it is the probe,
                                                 -> ``half-open``
``half-open``           is refused, but the      the probe succeeds -> ``closed``;
                        probe's                  it fails -> ``open``; it was not
                                                 sent after all -> ``open``, and the
                                                 next call is the probe
======================  =======================  ==================================

Every call that ``allow()`` lets through must be followed by ``succeeded()``,
``failed()`` or, when it was not sent after all, ``dropped()``; everything else asks the
machine rather than keeping flags of its own.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"

# (state, event) -> the next state; an event not listed leaves the state as it is.
_TRANSITIONS = {
    (CLOSED, "too_many_failures"): OPEN,
    (OPEN, "cooled_down"): HALF_OPEN,
    (HALF_OPEN, "succeeded"): CLOSED,
    (HALF_OPEN, "failed"): OPEN,
    (HALF_OPEN, "dropped"): OPEN,
}


class Breaker:
    """The state machine above; thread-safe."""

    def __init__(self, failures: int = 3, cooldown: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = failures
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self.state = CLOSED
        self._in_a_row = 0
        self._retry_at = 0.0
        self.opened = 0
        """How many times the breaker opened."""

    def _move(self, event: str) -> None:
        following = _TRANSITIONS.get((self.state, event))
        if following is None:
            return
        self.state = following
        if event == "dropped":
            # Nothing was learnt about the service: not another opening, and no cooldown
            # before the next probe.
            self._retry_at = self._clock()
        elif following == OPEN:
            self.opened += 1
            self._retry_at = self._clock() + self.cooldown
        elif following == CLOSED:
            self._in_a_row = 0

    def allow(self) -> bool:
        """Whether a call may go now (see the table)."""
        with self._lock:
            if self.state == OPEN and self._clock() >= self._retry_at:
                self._move("cooled_down")
                return True  # the probe
            return self.state == CLOSED

    def succeeded(self) -> None:
        with self._lock:
            self._in_a_row = 0
            self._move("succeeded")

    def dropped(self) -> None:
        """A call that ``allow()`` let through was not sent after all. Only the probe's
        matters: without it, the breaker would wait for an outcome forever."""
        with self._lock:
            self._move("dropped")

    def failed(self) -> None:
        with self._lock:
            self._in_a_row += 1
            if self.state == HALF_OPEN:
                self._move("failed")
            elif self._in_a_row >= self.failures:
                self._move("too_many_failures")
