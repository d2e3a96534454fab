"""A worker's answer made into its job's outcome, in whichever thread reads it.

Two rules hold here:

1. *Decoding never raises.* Whatever a job returned or raised, its caller gets a result or
   an exception, and nothing else is touched. An exception that cannot be rebuilt in this
   process (its class lives in a module only the worker could import, its ``__reduce__``
   fails here, it refuses an attribute) becomes a ``CompileError`` carrying its type's
   name, its message and the worker's traceback; it never escapes into the thread that
   read it (the supervisor, which would take every other job down with it, or an event
   loop's callback, which would leave the caller waiting forever).

2. *A large answer never holds the interpreter lock for long.* Copying 200 MB into a
   ``bytes`` object, three times over (read, frame, unpickle), held the lock, and with it
   any event loop of this process, for about 200 ms. A large answer (``STREAM_MIN`` bytes
   or more) arrives as a message of its own, and :class:`Payload` gives it to
   ``pickle.load`` as a file: the unpickler reads small pieces with ``read`` and large
   buffers (a ``bytes`` or ``bytearray`` being rebuilt) with ``readinto`` straight into
   the object's memory, and each ``readv`` lets the lock go while the kernel copies. The
   lock is then held only between reads.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

from aiocompile._pool.child import _Failure
from aiocompile._pool.job import Job
from aiocompile.errors import CompileError, RemoteTraceback

_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")
# At most this much is copied per system call: the lock is taken again between calls, so
# that a waiting thread gets its turn at the end of each one.
_CHUNK = 4 << 20


class Broken(EOFError):
    """The worker's socket ended, or failed, before its whole answer was read: the worker
    died (or was killed) while answering. Not the job's outcome: the worker's end is."""


class Payload:
    """The next message on a worker's socket (``fd``, a descriptor this object owns and
    closes), as a file for ``pickle.load``: exactly the message's bytes, read as asked.

    Framed as ``multiprocessing.connection`` frames a message: a 4-byte length, or -1 and
    an 8-byte length."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.left = 4
        size = _LENGTH.unpack(self.read(4))[0]
        if size == -1:
            self.left = 8
            size = _LONG_LENGTH.unpack(self.read(8))[0]
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


def outcome(job: Job, ok: bool, data: bytes | memoryview | Payload, output: str) -> tuple[bool, Any]:
    """``(True, result)`` or ``(False, exception)`` for a job's answer; raises only
    :class:`Broken` (from a ``Payload``), never for what the answer holds. ``output`` is
    what the job printed, for a failure whose exception has no output of its own."""
    if ok:
        try:
            return True, _load(data)
        except Broken:
            raise
        except Exception as exc:
            return False, TypeError(f"the job's result could not be unpickled here: {exc!r}")
    try:
        failure = _load(data)
        if not isinstance(failure, _Failure):  # pragma: no cover - protocol invariant
            raise TypeError(f"a failure was described as {type(failure).__name__}")
    except Broken:
        raise
    except Exception as exc:  # pragma: no cover - a _Failure holds only strings and bytes
        return False, CompileError(f"the job failed, and its failure could not be read here: {exc!r}",
                                   kernel_name=job.name, key=job.key, output=output)
    return False, rebuild_failure(job, failure, output)


def rebuild_failure(job: Job, failure: _Failure, output: str) -> BaseException:
    """The job's own exception, with the worker's traceback as its cause, where it can be
    rebuilt here; else a ``CompileError`` saying what it was."""
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
        exc = CompileError(f"{failure.type_name}: {failure.message} ({why}; the worker's traceback is the cause)",
                           kernel_name=job.name, key=job.key, output=output)
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
