"""A job handed to a foreign executor: its life, as the pool over that executor sees it.

::

                     clock                    time_out
    WAITING ───────────────────▶ RUNNING ──────────────▶ OVERDUE
       │                            │                       ▲
      kill                         kill                     │
       ▼             clock          ▼         time_out      │
    KILLED_WAITING ──────────▶ KILLED ──────────────────────┘
    any state ──withdraw──▶ GONE
    any state ──ended─────▶ GONE

- ``clock``: a worker is free for the job, by the pool's count (``ForeignPool``'s
  docstring), and its timeout starts. With an executor whose order or number of workers is
  unknown, that is at once, as it is handed over. A job WAITING holds no worker yet.
- OVERDUE: past its timeout; it has failed (``JobTimeout``), but holds its worker until its
  executor future ends: stopped where the executor can stop a job (``kill(future)``),
  running on where it cannot. The count takes it for a job that may never end.
- KILLED: failed on request (``ForeignPool.kill``) and being stopped by the executor. A
  job killed before its clock started (KILLED_WAITING: only with an executor that both
  runs jobs in order and can stop them, which no built-in one does) still takes its clock
  in turn, so that the jobs with a clock stay the first ones sent.
- ``time_out`` from KILLED: the timer fired between ``kill()``'s decision and the job's
  failure. It counts as a timeout, and nothing is sent to stop the job a second time.
- ``withdraw``: ``cancel()`` took the job back before any worker took it. While the
  executor is asked, the pool notes which job it is withdrawing: cancelling a future runs
  its done-callbacks at once, in the cancelling thread, and those must leave the job to
  ``cancel()``. When the executor refuses (the job runs already), nothing has moved.
- ``ended``: its executor future ended (an answer, an error, a break, a lost worker), or
  the pool closed. The pool no longer tracks a GONE job: a re-run is a new one.

Every move is checked against ``TRANSITIONS`` (``aiocompile._pool.state``) and happens
under the pool's lock.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import threading
from dataclasses import dataclass
from typing import Any

from aiocompile._pool.job import Job
from aiocompile._pool.state import Transitions, from_every

__all__ = ["TRANSITIONS", "Move", "Sent", "State"]


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    OVERDUE = "overdue"
    KILLED_WAITING = "killed (waiting)"
    KILLED = "killed"
    GONE = "gone"


class Move(enum.Enum):
    CLOCK = "clock"
    TIME_OUT = "time_out"
    KILL = "kill"
    WITHDRAW = "withdraw"
    ENDED = "ended"


S, M = State, Move
_LIVE = [state for state in State if state is not S.GONE]
TRANSITIONS: Transitions[State, Move] = Transitions("job in a foreign executor", {
    (S.WAITING, M.CLOCK): S.RUNNING,
    (S.KILLED_WAITING, M.CLOCK): S.KILLED,
    (S.RUNNING, M.TIME_OUT): S.OVERDUE,
    (S.KILLED, M.TIME_OUT): S.OVERDUE,
    (S.WAITING, M.KILL): S.KILLED_WAITING,
    (S.RUNNING, M.KILL): S.KILLED,
    **from_every(_LIVE, M.WITHDRAW, S.GONE),
    **from_every(_LIVE, M.ENDED, S.GONE),
})


@dataclass(eq=False)
class Sent:
    """One job handed to the executor: its executor future, the executor's generation
    (``ForeignPool``'s count of rebuilds) and its place in the state machine."""

    job: Job
    future: cf.Future[Any]
    generation: int
    state: State = State.WAITING
    timer: threading.Timer | None = None
    """Its timeout, once its clock runs."""

    def _move(self, move: Move) -> None:
        self.state = TRANSITIONS.after(self.state, move, f"job {self.job.id}")

    # -- what the pool asks ------------------------------------------------------------------

    @property
    def waiting(self) -> bool:
        """Its clock has not started (killed or not)."""
        return (self.state, Move.CLOCK) in TRANSITIONS

    @property
    def overdue(self) -> bool:
        return self.state is State.OVERDUE

    @property
    def killable(self) -> bool:
        """Not failed yet by a timeout or a kill (nor gone)."""
        return (self.state, Move.KILL) in TRANSITIONS

    @property
    def gone(self) -> bool:
        return self.state is State.GONE

    # -- the transitions (each under the pool's lock) -----------------------------------------

    def clock(self) -> None:
        self._move(Move.CLOCK)

    def time_out(self) -> None:
        self._move(Move.TIME_OUT)

    def kill(self) -> None:
        self._move(Move.KILL)

    def ended(self, withdrawn: bool = False) -> None:
        """No longer tracked: withdrawn by ``cancel()``, or ended otherwise. Its timer goes."""
        self._move(Move.WITHDRAW if withdrawn else Move.ENDED)
        self.stop_clock()

    def stop_clock(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
