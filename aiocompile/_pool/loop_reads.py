"""Answers read by an asyncio event loop itself.

A job sent from an event loop's thread to an idle worker, when its caller asks for it
(``direct=True``: small answers, as ``Scheduler.run`` gets), has its answer read by that
event loop (``add_reader`` on a duplicate of the worker's socket), which spares the answer
a hop through the supervisor thread. The supervisor still owns the worker: it watches the
deadline, kills on timeout, and takes back the socket the moment the loop sees anything
but one whole, small answer (the worker's end, a partial or large message), or when the
loop does not read a waiting answer within ``LOOP_GRACE`` seconds (a loop that is
blocked, stopped or closed).

Right after such a job is sent, the task that awaits it looks at the socket for up to
``LINGER`` seconds before it sleeps (``linger``, through ``Job.look_for_answer``), and
reads the answer there if it came: a trivial job's answer comes back in a few tens of
microseconds, and a loop that was already asleep then waits for the kernel to wake its
thread as well (one that goes through its selector once more only to find the answer, and
once more to resume the task, costs a turn each). Jobs that take longer cost the loop
``LINGER`` once each.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Protocol

from aiocompile._pool.handle import LoopReader, Worker
from aiocompile._pool.protocol import Done, read_answer

logger = logging.getLogger("aiocompile")

# An answer an event loop was to read, still unread after this long (the loop is blocked,
# stopped or closed), is read by the supervisor instead; it looks this often.
LOOP_GRACE = 1.0
AUDIT_PERIOD = 0.25
# Larger answers are never read in an event loop: unpickling them is the supervisor's work.
LOOP_READ_MAX = 64 * 1024
# How long a loop looks for an answer it is to read, right after the job is sent, before it
# sleeps in its selector (a trivial job's worker answers in 25 to 45 microseconds).
LINGER = 50e-6


class Answers(Protocol):
    """Where a loop's reads go: the roster its workers are in (``roster.Roster``)."""

    lock: threading.Lock

    def wake(self) -> None:
        """Wake the supervisor (to read what the loop would not)."""

    def answered(self, worker: Worker, done: Done, *, in_loop: bool) -> bool: ...


class LoopReads:
    """The event loops that read a pool's answers, and the supervisor's audit of them."""

    def __init__(self, answers: Answers) -> None:
        self._answers = answers

    def reader_for(self, worker: Worker, loop: Any) -> LoopReader | None:
        """The registration through which ``loop`` reads ``worker``'s answer (under the
        pool's lock): the one it already has, or a new duplicate of the socket registered
        with it; None if that cannot be. A registration stays while the same loop keeps
        using the worker: adding and removing a reader cost as much as the rest of reading."""
        registered = worker.registration
        if registered is not None:
            if registered.loop is loop:
                registered.waiting_since = None
                return registered
            if registered.loop.is_closed():
                # A closed loop's selector is closed: nothing refers to the descriptor.
                registered.close()
            # Otherwise it stays registered in that loop, which drops it the next time the
            # socket is readable (see on_readable).
            worker.registration = None
        try:
            fd = worker.proc.conn.fileno()
            if worker.peek is None:
                worker.peek = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, os.dup(fd))
            reader = LoopReader(loop, os.dup(fd))
        except (OSError, ValueError):
            return None
        try:
            loop.add_reader(reader.fd, self.on_readable, worker, reader)
        except (NotImplementedError, RuntimeError, OSError, ValueError):
            reader.close()
            return None
        worker.registration = reader
        return reader

    def linger(self, worker: Worker, reader: LoopReader) -> None:
        """In the loop's thread, right after a job this loop is to read was sent (the
        job's ``look``): look at the worker's socket until the answer is there, for
        ``LINGER`` seconds at most, and read it at once if it came (as ``on_readable``
        would, a turn of the loop later: that turn, a pass through the selector, cost more
        than the whole look on the machines measured); else the selector finds it when it
        comes."""
        if worker.reader is not reader:
            return  # answered already, or taken back by the supervisor
        try:
            poll = reader.poller().poll
        except (OSError, ValueError):  # pragma: no cover - a closed descriptor
            return
        clock = time.perf_counter
        end = clock() + LINGER
        while not poll(0):
            if clock() >= end:
                return
        self.on_readable(worker, reader)

    def on_readable(self, worker: Worker, reader: LoopReader) -> None:
        """The loop's callback: the worker's socket is readable. Reads one whole, small
        answer to a job this loop holds. Anything else unregisters: the worker's end, a
        partial or large message (the supervisor is woken to read those), or an answer to
        a job someone else reads (the supervisor, another loop)."""
        answers = self._answers
        data: bytes | memoryview | None = None
        with answers.lock:
            mine = worker.reader is reader
            if mine:
                data = None if worker.peek is None else whole_message(worker.peek)
                if data is _NOTHING_YET:
                    return  # readiness seen for an earlier answer, already read
                if data is None:
                    worker.reader = None
            elif worker.registration is reader and worker.peek is not None and nothing_there(worker.peek):
                return  # readiness seen for an answer ``linger`` has read meanwhile
            if data is None and worker.registration is reader:
                worker.registration = None
        if data is None:
            try:
                reader.loop.remove_reader(reader.fd)
            except (RuntimeError, OSError, ValueError):  # pragma: no cover - a closing loop
                pass
            reader.close()
            if mine:
                answers.wake()
            return
        message = read_answer(data)
        if isinstance(message, Done):
            answers.answered(worker, message, in_loop=True)

    def audit(self, workers: list[Worker]) -> None:
        """In the supervisor: take back the sockets of answers an event loop has left
        unread for ``LOOP_GRACE`` seconds, and at once those of a closed loop."""
        now = time.monotonic()
        for worker in workers:
            reader = worker.reader
            if reader is None:
                continue
            closed = reader.loop.is_closed()
            if not closed:
                if not readable_now(worker.proc.conn):
                    reader.waiting_since = None
                    continue
                if reader.waiting_since is None:
                    reader.waiting_since = now
                if now - reader.waiting_since < LOOP_GRACE:
                    continue
            with self._answers.lock:
                if worker.reader is not reader:
                    continue  # the loop has just read it
                worker.reader = None
                if closed and worker.registration is reader:
                    worker.registration = None
                    reader.close()  # a closed loop's selector is closed: nothing refers to it
            if not closed:
                logger.debug("aiocompile: an event loop left an answer unread for %.1f s; the supervisor reads it",
                             now - (reader.waiting_since or now))


def readable_now(conn: Any) -> bool:
    """Whether reading ``conn`` would return at once (data, or its end)."""
    try:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True  # closed: reading it fails at once


_HEADER = struct.Struct("!i")
_NOTHING_YET = b""
# Or-ing the flags anew costs a Python-level call of IntFlag.__or__ per answer.
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
_FIRST_LOOK = 4096
_WAITALL = int(socket.MSG_WAITALL)


def nothing_there(peek: socket.socket) -> bool:
    """Whether a worker's socket has nothing to read now (not even its end)."""
    try:
        peek.recv(1, _PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def whole_message(peek: socket.socket) -> bytes | memoryview | None:
    """One message from a worker's socket, through its duplicate ``peek``, if all of it
    has arrived and it is at most ``LOOP_READ_MAX`` bytes long, read without blocking;
    else None, and nothing is read; ``_NOTHING_YET`` if nothing at all is there.
    (``multiprocessing.connection`` frames a message with
    its length: 4 bytes, or -1 and 8 more.) Two system calls, a peek then the read; three
    for an answer of more than a few kilobytes."""
    try:
        # A first look of a few kilobytes: most answers fit, and a buffer of the largest
        # size allowed costs its allocation on every answer.
        head = peek.recv(_FIRST_LOOK, _PEEK)
        if len(head) >= 4:
            size = _HEADER.unpack_from(head)[0]
            if len(head) == _FIRST_LOOK and _FIRST_LOOK < 4 + size <= 4 + LOOP_READ_MAX:
                head = peek.recv(4 + size, _PEEK)
    except BlockingIOError:
        return _NOTHING_YET
    except OSError:
        return None  # a broken socket
    if len(head) < 4:
        return None  # the worker's end, or not yet a whole header
    size = _HEADER.unpack_from(head)[0]
    if size < 0 or size > LOOP_READ_MAX or 4 + size > len(head):
        return None  # large, or not all there yet
    try:
        data = peek.recv(4 + size, _WAITALL)
    except OSError:  # pragma: no cover - all of it was there
        return None
    return memoryview(data)[4:]
