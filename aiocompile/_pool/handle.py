"""A worker's life, as an explicit state machine.

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

Every transition goes through :meth:`Worker._move`, which checks it against
``TRANSITIONS``; anything else is a bug and raises :class:`InvalidTransition`. Transitions
happen under the pool's lock (idle workers are taken from several threads); everything
else about a worker belongs to the pool's supervisor thread, or to the thread reading its
answer.
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiocompile._pool.job import Job
    from aiocompile._pool.launch import WorkerProcess


class State(enum.Enum):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    KILLING = "killing"
    RETIRING = "retiring"
    GONE = "gone"


S = State
TRANSITIONS: dict[tuple[State, str], State] = {
    (S.STARTING, "ready"): S.IDLE,
    (S.IDLE, "claim"): S.BUSY,
    (S.BUSY, "release"): S.IDLE,  # claimed for a job that was cancelled before it was sent
    (S.BUSY, "answered"): S.IDLE,
    (S.BUSY, "outgrown"): S.RETIRING,  # answered, and too big to keep
    (S.BUSY, "kill"): S.KILLING,
    (S.KILLING, "answered"): S.KILLING,
    (S.KILLING, "outgrown"): S.KILLING,
    (S.IDLE, "retire"): S.RETIRING,
    **{(state, "ended"): S.GONE for state in State if state is not S.GONE},
}

# Why a worker is being killed, when it is not its job's deadline or its caller: the job
# could not be sent to it (it had died), so the job never ran there.
UNDELIVERED = "undelivered"


class InvalidTransition(RuntimeError):
    """A worker was asked to do what its state does not allow: a bug in the pool."""


@dataclass(eq=False)
class Worker:
    """The pool's handle on one worker process and its place in the state machine."""

    proc: WorkerProcess
    state: State = State.STARTING
    job: Job | None = None
    kill_reason: str | None = None
    """Why it is being killed (KILLING): "timeout", "cancelled", ``UNDELIVERED``, or the
    message its job fails with (the scheduler closing)."""
    retire_reason: str | None = None
    """Why it is being stopped (RETIRING): "idle" or "recycled"."""
    # The environment and import path this worker was last sent: a job that carries the
    # same objects sends None instead (see the protocol in _worker).
    sent_env: dict[str, str] | None = None
    sent_path: list[str] | None = None
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

    def _move(self, event: str) -> None:
        target = TRANSITIONS.get((self.state, event))
        if target is None:
            raise InvalidTransition(f"a {self.state.value} worker (pid {self.proc.pid}) cannot take {event!r}")
        self.state = target

    # -- the transitions (each under the pool's lock) -------------------------------------------

    def ready(self) -> None:
        self._move("ready")

    @property
    def idle(self) -> bool:
        return self.state is State.IDLE

    def claim(self, job: Job) -> None:
        self._move("claim")
        self.job = job

    def release(self) -> None:
        self._move("release")
        self.job = None
        self.deadline = None

    def answered(self, outgrown: bool) -> None:
        """Its job has answered. Idle again, unless it is being killed (it stays so, its
        job's result standing) or has grown too big (``outgrown``: to be replaced)."""
        self._move("outgrown" if outgrown else "answered")
        self.job = None
        self.deadline = None
        self.reader = None
        self.streaming = False
        if self.state is State.RETIRING:
            self.retire_reason = "recycled"

    def kill(self, job: Job, reason: str) -> bool:
        """Decide to kill this worker for ``job``: True if the caller is now to send the
        signal; False if the worker no longer holds that job (it answered, or the kill is
        on its way already), and then nothing may be sent."""
        if self.state is not State.BUSY or self.job is not job:
            return False
        self._move("kill")
        self.kill_reason = reason
        self.deadline = None
        return True

    def retire(self, reason: str) -> None:
        self._move("retire")
        self.retire_reason = reason

    def ended(self) -> tuple[State, Job | None, str | None]:
        """The worker has died. Returns the state it died in, the job it held (if any) and
        why it was being killed (if it was)."""
        before, job, reason = self.state, self.job, self.kill_reason
        self._move("ended")
        self.job = None
        self.deadline = None
        self.reader = None
        self.streaming = False
        return before, job, reason

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


class LoopReader:
    """One job's answer, to be read by an event loop: the loop, and the duplicate of the
    worker's socket (a descriptor) registered with it, which only the loop's thread
    unregisters and closes (or the supervisor, once the loop is closed). Closing the
    worker's own socket thus never leaves a stale registration in a loop's selector."""

    __slots__ = ("loop", "fd", "waiting_since")

    def __init__(self, loop: Any, fd: int) -> None:
        self.loop = loop
        self.fd = fd
        self.waiting_since: float | None = None  # the supervisor's: when it saw an answer unread

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:  # pragma: no cover
            pass
