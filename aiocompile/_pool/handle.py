"""The parent's handle on one worker process: its life, as an explicit state machine.

::

                 ready              claim(J)
    STARTING ──────────▶ IDLE ──────────────▶ BUSY(J) ──answered──▶ IDLE
                          │  ◀────release──────  │  └──answered, outgrown──▶ RETIRING
                          │                      │
                          └──retire──▶ RETIRING  └──kill(J)──▶ KILLING(J) ──answered──▶ KILLING
    any state ──ended──▶ GONE

- A kill is addressed to a job, not to a process: ``kill(J)`` moves a worker only while it
  is busy with J. A worker being killed never becomes idle again, even when J's answer
  arrives before the signal lands (the result then stands): so a kill can never reach a
  job that the worker would otherwise have taken next.
- ``ended`` is the worker's death, whatever its cause; what the pool makes of it depends on
  the state it was in: STARTING (a failed start), IDLE (a crash that cost no job), BUSY (a
  crash of its job), KILLING (a death on purpose: never counted as a crash), RETIRING (a
  worker stopped on purpose).

Every transition is checked against ``TRANSITIONS`` (see ``state``); anything else is a
bug and raises ``InvalidTransition``. Transitions happen under the roster's lock (idle
workers are taken from several threads); everything else about a worker belongs to the
pool's supervisor thread, or to the thread reading its answer.
"""

from __future__ import annotations

import enum
import os
import select
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiocompile._pool.job import Stop
from aiocompile._pool.serialize import Definitions
from aiocompile._pool.state import InvalidTransition, Label, Transitions, from_every

if TYPE_CHECKING:
    from aiocompile._pool.job import Job
    from aiocompile._pool.launch import WorkerProcess

__all__ = ["TRANSITIONS", "Death", "InvalidTransition", "LoopReader", "Move", "Retire", "State", "Worker"]


class State(Label):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    KILLING = "killing"
    RETIRING = "retiring"
    GONE = "gone"


class Retire(enum.Enum):
    """Why a worker is stopped on purpose (RETIRING)."""

    IDLE = "idle"
    """It went unused for ``idle_timeout`` seconds."""
    RECYCLED = "recycled"
    """It grew past ``max_worker_rss`` (compilers leak)."""


class Move(Label):
    READY = "ready"
    CLAIM = "claim"
    RELEASE = "release"
    """Claimed for a job that was cancelled before it was sent."""
    ANSWERED = "answered"
    OUTGROWN = "outgrown"
    """Answered, and too big to keep."""
    KILL = "kill"
    RETIRE = "retire"
    ENDED = "ended"


S, M = State, Move
TRANSITIONS: Transitions[State, Move] = Transitions("worker", {
    (S.STARTING, M.READY): S.IDLE,
    (S.IDLE, M.CLAIM): S.BUSY,
    (S.BUSY, M.RELEASE): S.IDLE,
    (S.BUSY, M.ANSWERED): S.IDLE,
    (S.BUSY, M.OUTGROWN): S.RETIRING,
    (S.BUSY, M.KILL): S.KILLING,
    (S.KILLING, M.ANSWERED): S.KILLING,
    (S.KILLING, M.OUTGROWN): S.KILLING,
    (S.IDLE, M.RETIRE): S.RETIRING,
    **from_every([state for state in State if state is not S.GONE], M.ENDED, S.GONE),
})


@dataclass(eq=False)
class Worker:
    """The pool's handle on one worker process and its place in the state machine."""

    proc: WorkerProcess
    state: State = State.STARTING
    job: Job | None = None
    stop: Stop | None = None
    """Why it is being killed (KILLING)."""
    retire_reason: Retire | None = None
    """Why it is being stopped (RETIRING): "idle" or "recycled"."""
    # The environment and import path this worker was last sent: a job that carries the
    # same objects sends None instead (see ``protocol``).
    sent_env: dict[str, str] | None = None
    sent_path: list[str] | None = None
    definitions: Definitions = field(default_factory=Definitions)
    """The __main__ functions this worker was sent (``serialize``)."""
    deadline: float | None = None
    warmed: bool = False
    jobs_run: int = 0
    rss: int = 0
    last_used: float = field(default_factory=time.monotonic)
    # Who reads this worker's answer when it is not the supervisor: an event loop (set only
    # while busy; see _pool's loop reads), or a thread streaming a large answer. Changed
    # only under the pool's lock.
    reader: Any = None
    streaming: bool = False
    # A duplicate of the socket, kept for peeking at an answer's length (recv MSG_PEEK):
    # made the first time a loop reads for this worker, used and closed under the lock.
    peek: Any = None
    # The duplicate registered with the loop that last read for this worker (kept while
    # that loop keeps using it). Changed under the lock.
    registration: Any = None
    watched: bool = False  # in the supervisor's current wait (written under the lock)

    def _move(self, move: Move) -> None:
        self.state = TRANSITIONS.after(self.state, move, self.proc.pid)

    # -- the transitions (each under the pool's lock) -------------------------------------------

    def ready(self) -> None:
        self._move(Move.READY)

    @property
    def idle(self) -> bool:
        return self.state is State.IDLE

    def claim(self, job: Job) -> None:
        self._move(Move.CLAIM)
        self.job = job

    def release(self) -> None:
        self._move(Move.RELEASE)
        self.job = None
        self.deadline = None

    def answered(self, outgrown: bool) -> None:
        """Its job has answered. Idle again, unless it is being killed (it stays so, its
        job's result standing) or has grown too big (``outgrown``: to be replaced)."""
        self._move(Move.OUTGROWN if outgrown else Move.ANSWERED)
        self.job = None
        self.deadline = None
        self.reader = None
        self.streaming = False
        if self.state is State.RETIRING:
            self.retire_reason = Retire.RECYCLED

    def kill(self, job: Job, stop: Stop) -> bool:
        """Decide to kill this worker for ``job``: True if the caller is now to send the
        signal; False if the worker no longer holds that job (it answered, or the kill is
        on its way already), and then nothing may be sent."""
        if self.state is not State.BUSY or self.job is not job:
            return False
        self._move(Move.KILL)
        self.stop = stop
        self.deadline = None
        return True

    def retire(self, reason: Retire) -> None:
        self._move(Move.RETIRE)
        self.retire_reason = reason

    def ended(self) -> Death:
        """The worker has died: the state it died in, the job it held and why it was being
        killed."""
        death = Death(self.state, self.job, self.stop)
        self._move(Move.ENDED)
        self.job = None
        self.deadline = None
        self.reader = None
        self.streaming = False
        return death

    # -- descriptors ---------------------------------------------------------------------------

    def drop_peek(self) -> None:
        """Close this process's own duplicates of the socket (under the lock): the peek,
        and a registration whose loop is closed. One in a live loop is that loop's to drop:
        the socket reads as ended once the worker is gone, and the loop drops it then."""
        if self.peek is not None:
            self.peek.close()
            self.peek = None
        if self.registration is not None and self.registration.loop.is_closed():
            self.registration.close()
            self.registration = None


@dataclass(frozen=True, slots=True)
class Death:
    """A worker's end, as its handle knew it."""

    state: State
    """The state it died in: what its death means (see the module's docstring)."""
    job: Job | None
    stop: Stop | None
    """Why it was being killed, if it was."""


class LoopReader:
    """One job's answer, to be read by an event loop: the loop, and the duplicate of the
    worker's socket (a descriptor) registered with it, which only the loop's thread
    unregisters and closes (or the supervisor, once the loop is closed). Closing the
    worker's own socket thus never leaves a stale registration in a loop's selector."""

    __slots__ = ("loop", "fd", "waiting_since", "_poller")

    def __init__(self, loop: Any, fd: int) -> None:
        self.loop = loop
        self.fd = fd
        self.waiting_since: float | None = None  # the supervisor's: when it saw an answer unread
        self._poller: Any = None

    def poller(self) -> Any:
        """A ``select.poll`` object for the descriptor, made once: the loop looks at it
        after every job it sends (``loop_reads.LoopReads.linger``)."""
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self.fd, select.POLLIN)
        return poller

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:  # pragma: no cover
            pass
