"""A large module's bytecode kept in pieces, so that loading it is many short C calls
rather than one long one.

Python loads a module's bytecode with one ``marshal.loads`` of the whole file, which holds
the interpreter lock throughout: Inductor's ``ir.py`` (572 KB of bytecode) 4 ms in a quiet
process, and 8 to 15 ms on 2 busy CPUs, where the thread importing it is the serving
process's (the modules a load needs) and the lock is the event loop's.

So, for bytecode of ``PIECES_FROM`` bytes or more, the code objects of the module (the
module's, its classes', its functions') are kept one by one (:func:`split`): each with the
code objects it holds replaced by marks, in the order a tree is built from its leaves,
each marshalled on its own. :func:`join` unmarshals them one at a time, putting each back
in the one that holds it, and before each ``PIECE`` bytes calls ``before`` (the thread
stands aside for a call being served: ``aside.before_holding``). The code it makes is
equal to the module's code.

The file (:func:`write`, :func:`read`) names the bytecode it was made from (its header and
size): bytecode written again leaves it stale, and it is not used.
"""

from __future__ import annotations

import marshal
from collections.abc import Callable, Sequence
from types import CodeType

from aiocompile._base import pyc

__all__ = ["MADE_FROM", "PIECE", "PIECES_FROM", "current", "join", "made_from", "read", "split", "write"]

PIECES_FROM = 256 * 1024
"""Bytecode of this many bytes or more is loaded in pieces (about 1.5 ms of unmarshalling in a
quiet process)."""

PIECE = 32 * 1024
"""About this many bytes of marshalled code between two calls of ``before``."""

MAGIC = b"aiocpc1\n"

_MARK = "\x00aiocompile code\x00"


def split(code: CodeType) -> list[tuple[bytes, bool]] | None:
    """``code``'s code objects marshalled one by one, leaves first, each with those it holds
    replaced by marks (and whether it holds any); None for code that cannot be split so (a
    constant that looks like a mark, a code object inside another constant)."""
    blobs: list[tuple[bytes, bool]] = []

    def walk(one: CodeType) -> int:
        consts = []
        held = False
        for const in one.co_consts:
            if isinstance(const, CodeType):
                consts.append((_MARK, walk(const)))
                held = True
            elif isinstance(const, (tuple, frozenset)) and _odd(const):
                raise ValueError("a constant that cannot be kept apart")
            else:
                consts.append(const)
        blobs.append((marshal.dumps(one.replace(co_consts=tuple(consts)) if held else one), held))
        return len(blobs) - 1

    try:
        walk(code)
    except (ValueError, RecursionError):
        return None
    return blobs


def _odd(const: tuple[object, ...] | frozenset[object]) -> bool:
    return any(isinstance(item, CodeType) or item == _MARK
               or isinstance(item, (tuple, frozenset)) and _odd(item) for item in const)


def join(blobs: Sequence[tuple[memoryview | bytes, bool]], before: Callable[[], None]) -> CodeType:
    """The code :func:`split` kept, unmarshalled blob by blob (``before`` called before the
    first and after each ``PIECE`` bytes)."""
    built: list[CodeType] = []
    since = PIECE
    loads = marshal.loads
    for blob, held in blobs:
        if since >= PIECE:
            before()
            since = 0
        since += len(blob)
        one = loads(blob)
        if held:
            one = one.replace(co_consts=tuple(
                built[const[1]] if type(const) is tuple and len(const) == 2 and const[0] == _MARK else const
                for const in one.co_consts))
        built.append(one)
    if not built or not isinstance(built[-1], CodeType):
        raise ValueError("no code")
    return built[-1]


def write(path: str, made_from: bytes, blobs: list[tuple[bytes, bool]]) -> None:
    """The pieces at ``path``, whole, naming the bytecode they were made from (``MADE_FROM``
    bytes: its header and size)."""
    head = marshal.dumps(([len(blob) for blob, _ in blobs], bytes(held for _, held in blobs)))
    pyc.write(path, b"".join([MAGIC, made_from, len(head).to_bytes(4, "little"), head, *(blob for blob, _ in blobs)]))


MADE_FROM = 24
"""Bytes naming the bytecode the pieces were made from: its 16 bytes of header and its size (8)."""


def made_from(header: bytes, size: int) -> bytes:
    return header + size.to_bytes(8, "little")


def current(path: str, made: bytes) -> bool:
    """Whether the pieces at ``path`` were made from this bytecode (their first bytes only)."""
    try:
        with open(path, "rb") as file:
            return file.read(len(MAGIC) + MADE_FROM) == MAGIC + made
    except OSError:
        return False


def read(path: str, made: bytes) -> list[tuple[memoryview, bool]] | None:
    """The pieces at ``path``, if made from this bytecode; None otherwise (none, stale,
    damaged)."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError:
        return None
    start = len(MAGIC) + MADE_FROM + 4
    if len(data) < start or data[:len(MAGIC) + MADE_FROM] != MAGIC + made:
        return None
    end = start + int.from_bytes(data[start - 4:start], "little")
    try:
        lengths, held = marshal.loads(memoryview(data)[start:end])
        if sum(lengths) != len(data) - end or len(held) != len(lengths):
            return None
    except (ValueError, EOFError, TypeError):
        return None
    view = memoryview(data)
    blobs = []
    for length, holds in zip(lengths, held):
        blobs.append((view[end:end + length], bool(holds)))
        end += length
    return blobs
