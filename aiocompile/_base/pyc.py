"""Bytecode files as aiocompile keeps them for modules that have none of their own
(``bytecode``): where they go, their header, their writing, and the compiling of many at
once.

Run as a script (``python -I -S pyc.py ROOT OPTIMIZE DONT_WRITE PREFIX PROCESSES MINIMUM``),
it reads source files (``S<tab>path``) and package folders (``P<tab>path``) on its
standard input, finds those sources (and the folders' modules) that have no bytecode of
their own nor current in ``ROOT``, and, if there are ``MINIMUM`` at least, compiles them
into ``ROOT`` in ``PROCESSES`` processes (itself and forks of itself), then exits. That is
``bytecode.prepare``: a fork server about to import hundreds of modules without bytecode
finds most of them compiled already. All of that work is done here, none in the program
that started it, and nothing of aiocompile (nor anything installed) is imported: such a
process starts in milliseconds, and its forks are cheap.
"""

from __future__ import annotations

import importlib.util
import marshal
import os
import sys
import threading
from collections.abc import Iterable, Iterator


class _Made:
    """The directories made (or found) in this process, so each is made once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.directories: set[str] = set()


_MADE = _Made()


def header(stat: os.stat_result) -> bytes:
    """A timestamp-checked pyc's header for a source with this ``stat``, as Python writes it."""
    return (importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
            + (int(stat.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
            + (stat.st_size & 0xFFFFFFFF).to_bytes(4, "little"))


def current(target: str, stat: os.stat_result) -> bool:
    """Whether ``target`` holds bytecode for a source with this ``stat`` (its header says so)."""
    try:
        with open(target, "rb") as file:
            return file.read(16) == header(stat)
    except OSError:
        return False


def write(path: str, data: bytes) -> None:
    """``data`` at ``path``, whole (a temporary file renamed over it); a directory that
    cannot be written is left alone: the code was compiled, and the import goes on."""
    import tempfile  # here: a program importing aiocompile may never write one

    folder = os.path.dirname(path)
    try:
        if folder not in _MADE.directories:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            with _MADE.lock:
                _MADE.directories.add(folder)
        descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=".writing-")
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError:
        pass


def beside(source: str) -> str:
    """Where Python itself keeps the bytecode of ``source`` (``NotImplementedError`` where
    it keeps none)."""
    return importlib.util.cache_from_source(source)


def target(root: str, source: str, python_own: str) -> str:
    """Where ``root`` keeps the bytecode of ``source`` (``python_own`` is where Python would
    keep it): the same file name, its interpreter tag and optimisation level."""
    folder = os.path.dirname(os.path.abspath(source))
    return os.path.join(root, folder.lstrip(os.sep), os.path.basename(python_own))


def writes_beside(python_own: str, dont_write: bool) -> bool:
    """Whether Python writes a module's bytecode at ``python_own`` itself (it may, and can)."""
    if dont_write:
        return False
    folder = os.path.dirname(python_own)
    while not os.path.isdir(folder):  # __pycache__ (or a prefix's folders) not made yet
        parent = os.path.dirname(folder)
        if parent == folder:
            return False
        folder = parent
    return os.access(folder, os.W_OK)


# Folders of a package that its imports do not reach.
NOT_IMPORTED = frozenset(("__pycache__", "tests", "test", "testing", "benchmarks", "examples"))


def modules_in(folder: str) -> Iterator[str]:
    """The source files of a package folder's modules, its subpackages' too."""
    for where, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in NOT_IMPORTED)
        yield from (os.path.join(where, name) for name in sorted(files) if name.endswith(".py"))


def lacking(root: str, sources: Iterable[str], dont_write: bool) -> Iterator[tuple[str, str]]:
    """(source, where its bytecode goes) for each source with no bytecode of its own (nor
    written by Python) and none current in ``root``, once each."""
    seen: set[str] = set()
    writable: dict[str, bool] = {}
    for source in sources:
        if source in seen:
            continue
        seen.add(source)
        try:
            python_own = beside(source)
            stat = os.stat(source)
        except (NotImplementedError, ValueError, OSError):
            continue
        if os.path.exists(python_own):
            continue
        folder = os.path.dirname(python_own)
        if folder not in writable:
            writable[folder] = writes_beside(python_own, dont_write)
        if writable[folder]:
            continue
        ours = target(root, source, python_own)
        if not current(ours, stat):
            yield source, ours


def compile_into(source: str, target: str, optimize: int) -> bool:
    """Compile ``source`` into ``target`` unless it is there already; whether it was
    compiled here. A source that does not compile is left to its import, which says why."""
    try:
        stat = os.stat(source)
        if current(target, stat):
            return False
        with open(source, "rb") as file:
            code = compile(file.read(), source, "exec", dont_inherit=True, optimize=optimize)
    except (OSError, SyntaxError, ValueError):
        return False
    write(target, header(stat) + marshal.dumps(code))
    return True


def main() -> None:
    root, optimize, dont_write, prefix, processes, minimum = sys.argv[1:7]
    # As the program has them: ``-I`` left out its environment's settings.
    sys.pycache_prefix = prefix or None
    sources: list[str] = []
    for line in sys.stdin.buffer.read().decode("utf-8", "surrogateescape").splitlines():
        kind, _, path = line.partition("\t")
        if kind == "S":
            sources.append(path)
        elif kind == "P":
            sources.extend(modules_in(path))
    todo = list(lacking(root, sources, dont_write == "1"))
    if len(todo) < int(minimum):
        return
    count = max(1, int(processes))
    children = []
    for index in range(1, count):
        pid = os.fork()
        if pid == 0:
            try:
                _compile_share(todo, index, count, int(optimize))
            finally:
                os._exit(0)
        children.append(pid)
    _compile_share(todo, 0, count, int(optimize))
    for pid in children:
        os.waitpid(pid, 0)


def _compile_share(todo: list[tuple[str, str]], index: int, count: int, optimize: int) -> None:
    # Every count-th source, so that all the processes work near the front of the list,
    # where the fork server's imports are.
    for source, ours in todo[index::count]:
        compile_into(source, ours, optimize)


if __name__ == "__main__":
    main()
