"""A benchmark process's life, as an explicit state machine, and starting one.

::

                 ready              claim(T)
    STARTING ──────────▶ IDLE ──────────────▶ BUSY(T) ──answered──▶ IDLE
       │                  │                    │  ├──faulted──▶ EXITING   (its device is
       │                  └──stop──▶ EXITING   │  │                       unusable: it exits)
       └──kill──▶ KILLING                      │  └──kill(T)──▶ KILLING  (T ran past its time)
    any state ──ended──▶ GONE

- Every move is checked against ``TRANSITIONS`` (``aiocompile._pool.state``, as a pool
  worker's are). Only the thread that drives a process (one per device, see ``benchpool``)
  moves it, so the state needs no lock; closing the pool only kills, and the driver then
  sees it end.
- ``ended`` is the process's death, whatever its cause; what it means depends on the state
  it died in: STARTING (a failed start), IDLE (a crash that cost no configuration), BUSY
  (its configuration crashed it), KILLING or EXITING (a death that was expected).

A process is started as a fresh interpreter (never forked: this process may hold a CUDA
context), leading a process group of its own in this session (a Ctrl-C meant for the
application does not reach it), with the read end of an "alive" pipe whose only writer is
this process: it dies with this process.
"""

from __future__ import annotations

import enum
import os
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

from aiocompile._pool.procs import child_env, file_tail, group_of_its_own, kill_group
from aiocompile._pool.state import Transitions, from_every
from aiocompile._tuning.task import FromProcess, Stop, ToProcess

_OUTPUT_TAIL = 4096


class State(enum.Enum):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    KILLING = "killing"
    EXITING = "exiting"
    GONE = "gone"


class Move(enum.Enum):
    READY = "ready"
    CLAIM = "claim"
    ANSWERED = "answered"
    FAULTED = "faulted"
    """Its configuration left the device unusable: it exits."""
    KILL = "kill"
    STOP = "stop"
    ENDED = "ended"


S, M = State, Move
TRANSITIONS: Transitions[State, Move] = Transitions("benchmark process", {
    (S.STARTING, M.READY): S.IDLE,
    (S.STARTING, M.KILL): S.KILLING,
    (S.IDLE, M.CLAIM): S.BUSY,
    (S.IDLE, M.STOP): S.EXITING,
    (S.BUSY, M.ANSWERED): S.IDLE,
    (S.BUSY, M.FAULTED): S.EXITING,
    (S.BUSY, M.KILL): S.KILLING,
    **from_every([state for state in State if state is not S.GONE], M.ENDED, S.GONE),
})


class Lost(Exception):
    """The process ended (or could not be reached) while waiting for its answer."""


class BenchProcess:
    """The parent's handle on one benchmark process."""

    def __init__(self, device: int, popen: subprocess.Popen[bytes], conn: Connection, alive_w: int,
                 output_fd: int) -> None:
        self.device = device
        self.popen = popen
        self.conn = conn
        self.alive_w = alive_w
        self.output_fd = output_fd
        self.state = State.STARTING
        self.task: Any = None
        self.device_name: str | None = None
        self.sessions: set[int] = set()
        self.started_at = time.monotonic()
        self.exitcode: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _move(self, move: Move) -> None:
        self.state = TRANSITIONS.after(self.state, move, self.pid)

    # -- the transitions ---------------------------------------------------------------------

    def ready(self, device_name: str) -> None:
        self._move(Move.READY)
        self.device_name = device_name

    def claim(self, task: Any) -> None:
        self._move(Move.CLAIM)
        self.task = task

    def answered(self) -> None:
        self._move(Move.ANSWERED)
        self.task = None

    def faulted(self) -> None:
        self._move(Move.FAULTED)

    def kill(self) -> None:
        """Move to KILLING and send the signal (to its whole process group)."""
        self._move(Move.KILL)
        kill_group(self.pid)

    def stop(self) -> None:
        self._move(Move.STOP)
        try:
            self.conn.send(Stop())
        except OSError:
            pass

    def ended(self, timeout: float = 30.0) -> tuple[State, int | None]:
        """Reap the process (killing it if it has not gone within ``timeout`` seconds) and
        close this side; returns the state it ended in and its exit status."""
        before = self.state
        self._move(Move.ENDED)
        try:
            self.exitcode = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.pid)
            self.exitcode = self.popen.wait()
        self.task = None
        self.close()
        return before, self.exitcode

    # -- talking to it -----------------------------------------------------------------------

    def send(self, message: ToProcess) -> None:
        try:
            self.conn.send(message)
        except (OSError, EOFError) as exc:
            raise Lost(str(exc)) from exc

    def receive(self, deadline: float | None) -> FromProcess | None:
        """The next message, or None once ``deadline`` (``time.monotonic()``) passes;
        raises ``Lost`` when the process is gone."""
        try:
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self.conn.poll(remaining if remaining is None else min(remaining, 1.0)):
                    message: FromProcess = self.conn.recv()
                    return message
                if self.popen.poll() is not None and not self.conn.poll(0):
                    raise Lost("the process exited")
                if deadline is not None and time.monotonic() >= deadline:
                    return None
        except (EOFError, OSError) as exc:
            raise Lost(str(exc) or "the process closed its pipe") from exc

    def output_tail(self, limit: int = _OUTPUT_TAIL) -> str:
        """The end of what the process printed (stdout and stderr)."""
        return file_tail(self.output_fd, limit).strip()

    def close(self) -> None:
        for close in (self.conn.close, lambda: os.close(self.alive_w), lambda: os.close(self.output_fd)):
            try:
                close()
            except OSError:
                pass


def describe_exit(code: int | None) -> str:
    if code is None:
        return "ended"
    if code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def launch(device: int, env: dict[str, str]) -> BenchProcess:
    """Start a benchmark process for ``device`` (not yet told what to run: ``Init``)."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    alive_r, alive_w = os.pipe()
    with tempfile.TemporaryFile(prefix="aiocompile-bench-") as capture:
        output_fd = os.dup(capture.fileno())
    fds = (child_sock.fileno(), alive_r)
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", "from aiocompile._tuning.bench_main import main; main()", *(str(fd) for fd in fds)],
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
            stdout=output_fd,
            stderr=output_fd,
            env={**child_env(), **env},
            cwd=os.getcwd(),
            # A group of its own (a Ctrl-C does not reach it; the group is killed whole),
            # in this session, as the pool's processes are (procs.group_of_its_own).
            **group_of_its_own(),
        )
    except OSError:
        parent_sock.close()
        for fd in (alive_w, output_fd):
            os.close(fd)
        raise
    finally:
        child_sock.close()
        os.close(alive_r)
    return BenchProcess(device, popen, Connection(parent_sock.detach()), alive_w, output_fd)
