"""Every frame between the parent, its workers and the fork server, both directions: what
each side writes and how the other reads it.

Between the parent and a worker, jobs go on a pipe and answers come back on a socket
(whose end the parent sees when the worker dies). Each message is framed as
``multiprocessing.connection`` frames it: a 4-byte length, or -1 and an 8-byte length.

::

    worker -> parent   "R", pid (``READY``)                            once, when it can take jobs
    parent -> worker   job_id, len(extra) (``JOB_HEADER``), extra, payload
                         extra: pickled (env, sys_path), or nothing when both are the same
                                objects as the last job this worker was sent carried
                         payload: pickled (fn, args, kwargs)
    worker -> parent   "D", job_id, ok, run_time, output_size, rss, follows (``DONE``), data
                         ok=True:  data = the pickled result
                         ok=False: data = a pickled ``Failure``
                         follows:  0; or, for data of ``STREAM_MIN`` bytes or more, the
                                   data's length: the data then comes as a message of its
                                   own, which the parent unpickles as it reads (``Payload``)

The worker reads its pipe with ``Inbox``, the parent answers with ``read_answer`` (a
streamed one with ``Payload``): headers of fixed layout, so no payload is pickled twice.
Between the parent and the fork server, one pickled dataclass a ``SOCK_SEQPACKET`` packet:
``Init`` -> ``ZygoteReady``; ``Fork`` (with the worker's descriptors attached) ->
``Forked``; ``Kill``; ``Exited`` for each worker reaped.

The messages on a job's way (``JobMessage``, ``Done``, ``Decoded``) are typed named tuples:
immutable like frozen dataclasses, and made at a fraction of their cost on every job.
*Decoding never raises* (``outcome``): an exception the parent cannot rebuild becomes a
``JobError`` with its type's name, its message and the worker's traceback, and never
escapes into the thread that read it (the supervisor, or an event loop's callback). *A
large answer never holds the interpreter lock for long*: it is streamed (``Payload``),
each ``readv`` letting the lock go while the kernel copies into the object rebuilt.
"""

from __future__ import annotations

import os
import pickle
import struct
import traceback
from dataclasses import dataclass
from typing import Any, NamedTuple

from aiocompile.errors import JobError, RemoteTraceback

# A named tuple made straight from its values, without its class's Python-level __new__:
# the messages below are made on every job's way, in the event loop's thread among others.
_make = tuple.__new__

LENGTH = struct.Struct("!i")
LONG_LENGTH = struct.Struct("!Q")


def frame(size: int) -> bytes:
    """The length prefix of a message of ``size`` bytes."""
    return LENGTH.pack(size) if size < 0x7FFFFFFF else LENGTH.pack(-1) + LONG_LENGTH.pack(size)


# -- parent -> worker: jobs ---------------------------------------------------------------------

JOB_HEADER = struct.Struct("!QI")


def encode_job(job_id: int, env: dict[str, str] | None, sys_path: list[str] | None, payload: bytes,
               definition: tuple[bytes, bytes] | None = None,
               buffers: tuple[pickle.PickleBuffer, ...] = ()) -> list[Any]:
    """A job as one framed message, in parts to be written whole, in order (joined for a
    small payload; a large one, and each of the payload's out-of-band ``buffers``, written
    as it is, uncopied). ``env`` and ``sys_path`` are None when the worker has them already
    (``Worker.sent_env``, ``sent_path``); ``definition`` is a __main__ function's, for a
    worker not yet sent it (``serialize``). The buffers follow the payload; their sizes
    are in the message's extra part."""
    if buffers:
        views = [buffer.raw() for buffer in buffers]
        sizes = tuple(view.nbytes for view in views)
    else:  # nearly every job
        views, sizes = [], ()
    extra = b"" if env is None and sys_path is None and definition is None and not sizes else \
        pickle.dumps((env, sys_path, definition, sizes), protocol=pickle.HIGHEST_PROTOCOL)
    size = JOB_HEADER.size + len(extra) + len(payload) + sum(sizes)
    head = (frame(size), JOB_HEADER.pack(job_id, len(extra)), extra)
    if len(payload) < JOINED_MAX:
        return [b"".join((*head, payload)), *views]
    return [b"".join(head), payload, *views]


JOINED_MAX = 256 * 1024
"""A job's payload up to this size is joined to its header, one buffer written at once; a
larger one goes as a part of its own (joining copied it whole, holding the interpreter
lock: a model's weights, several milliseconds)."""


class JobMessage(NamedTuple):
    """A job as the worker reads it."""

    job_id: int
    env: dict[str, str] | None
    """None: the same as the last job's."""
    sys_path: list[str] | None
    payload: memoryview
    """The pickled ``(fn, args, kwargs)``."""
    definition: tuple[bytes, bytes] | None
    """A __main__ function's digest and pickle, to keep before the payload is loaded."""
    buffers: tuple[memoryview, ...]
    """The payload's out-of-band buffers, for ``pickle.loads(payload, buffers=...)``."""


def decode_job(message: memoryview) -> JobMessage:
    job_id, extra = JOB_HEADER.unpack_from(message)
    start = JOB_HEADER.size + extra
    if not extra:
        return _make(JobMessage, (job_id, None, None, message[start:], None, ()))
    env, sys_path, definition, sizes = pickle.loads(message[JOB_HEADER.size:start])
    end = len(message) - sum(sizes)
    buffers = []
    at = end
    for size in sizes:
        buffers.append(message[at:at + size])
        at += size
    return _make(JobMessage, (job_id, env, sys_path, message[start:end], definition, tuple(buffers)))


_FIRST_READ = 4096


class Inbox:
    """The parent's messages on the job pipe ``fd``, read with as few system calls as a
    job allows: one blocking read for a whole small message. (On the pipe, unlike the
    answer socket, nothing wakes that read but a job: the parent reading an answer
    touches only the socket.)"""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._held = b""  # bytes read past the last message (the parent sends one at a time)

    def _more(self, size: int) -> bytes:
        data = os.read(self._fd, size)
        if not data:
            raise EOFError("the parent closed the job pipe")
        return data

    def receive(self) -> bytes | bytearray | memoryview:
        data = self._held
        if not data:
            # A few kilobytes hold most jobs; a larger buffer costs its allocation each time.
            data = self._more(_FIRST_READ)
        while len(data) < 4:
            data += self._more(_FIRST_READ)
        size, start = LENGTH.unpack_from(data)[0], 4
        if size == -1:
            while len(data) < 12:
                data += self._more(_FIRST_READ)
            size, start = LONG_LENGTH.unpack_from(data, 4)[0], 12
        end = start + size
        if len(data) >= end:
            self._held = data[end:]
            return memoryview(data)[start:end]
        # A large message: the rest straight into its buffer.
        body = bytearray(size)
        have = len(data) - start
        body[:have] = data[start:]
        view = memoryview(body)
        while have < size:
            count = os.readv(self._fd, [view[have:have + min(size - have, 1 << 22)]])
            if not count:
                raise EOFError("the parent closed the job pipe")
            have += count
        self._held = b""
        return body


# -- worker -> parent: answers ------------------------------------------------------------------

READY = struct.Struct("!cQ")
DONE = struct.Struct("!cQ?dQQQ")
# Answers this large or larger follow their DONE header as a message of their own, so
# that the parent can rebuild them as it reads them instead of copying them whole.
STREAM_MIN = 1 << 20


class Ready(NamedTuple):
    """The worker can take jobs."""

    pid: int


class Done(NamedTuple):
    """A job's answer."""

    job_id: int
    ok: bool
    data: memoryview | None
    """The pickled result or ``Failure``; None when it ``follows`` as a message of its own."""
    run_time: float
    """Seconds the job ran, measured in the worker."""
    output_size: int
    """Bytes the job printed (its output is in the worker's capture file)."""
    rss: int
    """The worker's resident memory after the job."""
    follows: int


def encode_ready(pid: int) -> bytes:
    return READY.pack(b"R", pid)


def encode_done(job_id: int, ok: bool, run_time: float, output_size: int, rss: int, follows: int) -> bytes:
    return DONE.pack(b"D", job_id, ok, run_time, output_size, rss, follows)


def read_answer(data: bytes | memoryview) -> Ready | Done:
    """A worker's message (without its length prefix); ``data`` is viewed, not copied."""
    if data[:1] == b"D":
        _, job_id, ok, run_time, output_size, rss, follows = DONE.unpack_from(data)
        body = None if follows else memoryview(data)[DONE.size:]
        return _make(Done, (job_id, ok, body, run_time, output_size, rss, follows))
    if data[:1] == b"R":
        return Ready(READY.unpack_from(data)[1])
    raise ValueError(f"not a worker's message: {bytes(data[:16])!r}")


@dataclass
class Failure:
    """A job's exception, described in plain values that any process can unpickle, with
    the exception itself pickled apart (None when it won't pickle): the parent may lack
    what rebuilding it takes (its class's module, say), and must still learn what it was."""

    exc_data: bytes | None
    type_name: str
    message: str
    traceback: str


def describe_failure(exc: BaseException) -> bytes:
    """A job's exception as its caller is sent it (a pickled ``Failure``), by whichever
    worker ran the job: aiocompile's own, or a foreign executor's."""
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        # A job that calls sys.exit() must not take the worker's loop with it.
        exc = RuntimeError(f"the job raised {type(exc).__name__}({exc})")
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    message = str(exc)
    exc_data: bytes | None
    try:
        # Tracebacks do not pickle; keep the cause chain's text in ``traceback`` instead.
        exc.__traceback__ = None
        exc_data = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(exc_data)  # an exception can pickle but fail to unpickle (bad __init__)
    except Exception:
        exc_data = None
    return pickle.dumps(Failure(exc_data, name, message, tb), protocol=pickle.HIGHEST_PROTOCOL)


# -- reading an answer, however large ---------------------------------------------------------

# At most this much is copied per system call: the lock is taken again between calls, so
# that a waiting thread gets its turn at the end of each one.
_CHUNK = 4 << 20


class Broken(EOFError):
    """The worker's socket ended, or failed, before its whole answer was read: the worker
    died (or was killed) while answering. Not the job's outcome: the worker's end is."""


class Payload:
    """The next message on a worker's socket (``fd``, a descriptor this object owns and
    closes), as a file for ``pickle.load``: exactly the message's bytes, read as asked."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.left = 4
        size = LENGTH.unpack(self.read(4))[0]
        if size == -1:
            self.left = 8
            size = LONG_LENGTH.unpack(self.read(8))[0]
        self.size = self.left = size

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self.left)
        done = 0
        while done < wanted:
            try:
                count = os.readv(self._fd, [view[done:done + min(_CHUNK, wanted - done)]])
            except OSError as exc:
                raise Broken(f"the worker's answer broke off: {exc}") from None
            if count == 0:
                raise Broken("the worker's answer broke off")
            done += count
        self.left -= done
        return done

    def read(self, size: int = -1) -> bytes:
        size = self.left if size is None or size < 0 else min(size, self.left)
        buffer = bytearray(size)
        self.readinto(buffer)
        return bytes(buffer)

    def readline(self) -> bytes:
        # Only old pickle protocols ask for lines; one byte at a time is fine for those.
        line = bytearray()
        while self.left and not line.endswith(b"\n"):
            line += self.read(1)
        return bytes(line)

    def drain(self) -> None:
        """Read and drop what is left of the message, so that the socket is at the start
        of the next one (an unpickling that failed halfway leaves the rest unread)."""
        scratch = bytearray(min(self.left, _CHUNK))
        while self.left:
            self.readinto(memoryview(scratch)[:min(self.left, len(scratch))])

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:  # pragma: no cover
            pass


def _load(data: bytes | memoryview | Payload) -> Any:
    if isinstance(data, Payload):
        return pickle.load(data)
    return pickle.loads(data)


class Decoded(NamedTuple):
    """What a job's answer made: its result, or the exception its caller gets."""

    ok: bool
    value: Any
    """The result; or, when not ``ok``, the exception."""


def outcome(ok: bool, data: bytes | memoryview | Payload, output: str, name: str | None,
            key: str | None) -> Decoded:
    """The outcome of a job's answer; raises only :class:`Broken` (from a ``Payload``),
    never for what the answer holds. ``output`` is what the job printed, for a failure
    whose exception has no output of its own; ``name`` and ``key`` say which job, for an
    error made here."""
    if ok:
        try:
            return _make(Decoded, (True, _load(data)))
        except Broken:
            raise
        except Exception as exc:
            return Decoded(False, TypeError(f"the job's result could not be unpickled here: {exc!r}"))
    try:
        failure = _load(data)
        if not isinstance(failure, Failure):  # pragma: no cover - protocol invariant
            raise TypeError(f"a failure was described as {type(failure).__name__}")
    except Broken:
        raise
    except Exception as exc:  # pragma: no cover - a Failure holds only strings and bytes
        return Decoded(False, JobError(f"the job failed, and its failure could not be read here: {exc!r}",
                                       kernel_name=name, key=key, output=output))
    return Decoded(False, rebuild_failure(failure, output, name, key))


def rebuild_failure(failure: Failure, output: str, name: str | None, key: str | None) -> BaseException:
    """The job's own exception, with the worker's traceback as its cause, where it can be
    rebuilt here; else a ``JobError`` saying what it was."""
    exc: BaseException | None = None
    why = "it could not be pickled"
    if failure.exc_data is not None:
        try:
            exc = pickle.loads(failure.exc_data)
            if not isinstance(exc, BaseException):
                raise TypeError(f"it unpickled as {type(exc).__name__}")
        except Exception as error:
            exc, why = None, f"it could not be rebuilt here: {error!r}"
    if exc is None:
        exc = JobError(f"{failure.type_name}: {failure.message} ({why}; the worker's traceback is the cause)",
                       kernel_name=name, key=key, output=output)
    else:
        try:
            if output and hasattr(exc, "output") and not exc.output:
                exc.output = output
        except Exception:
            pass  # a read-only or failing property, say: the exception stays as raised
    try:
        exc.__cause__ = RemoteTraceback(failure.traceback)
    except Exception:  # pragma: no cover - only a very odd exception class refuses a cause
        pass
    return exc


# -- parent <-> fork server ----------------------------------------------------------------------

@dataclass(frozen=True)
class Init:
    """The parent's first message: where the fork server is to stand, and what to load."""

    sys_path: list[str]
    cwd: str
    preload: list[str]


@dataclass(frozen=True)
class ZygoteReady:
    pid: int
    problems: list[str]
    """Preload entries that failed (workers start without them: slower, not wrong)."""


@dataclass(frozen=True)
class Fork:
    """Fork a worker onto the descriptors attached."""

    request_id: int


@dataclass(frozen=True)
class Forked:
    request_id: int
    pid: int


@dataclass(frozen=True)
class Kill:
    """Signal a worker the fork server has not reaped yet (and its process group)."""

    pid: int
    signum: int


@dataclass(frozen=True)
class Exited:
    pid: int
    exitcode: int
    """Negative: killed by that signal."""


ZygoteMessage = Init | ZygoteReady | Fork | Forked | Kill | Exited
CONTROL_MAX = 1 << 20


def encode_control(message: ZygoteMessage) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode_control(data: bytes) -> ZygoteMessage:
    message = pickle.loads(data)
    if not isinstance(message, (Init, ZygoteReady, Fork, Forked, Kill, Exited)):
        raise ValueError(f"not a control message: {type(message).__name__}")
    return message
