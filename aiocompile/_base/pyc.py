"""Bytecode files as aiocompile keeps them for modules that have none of their own
(``bytecode``): their header, their writing, and the compiling of many at once.

Run as a script (``python -I -S pyc.py OPTIMIZE``), it compiles the sources named on its
standard input, one ``SOURCE<tab>TARGET`` per line, each into its bytecode file at
``TARGET``, and exits: the helpers ``bytecode.prepare`` starts, so that a fork server
that is about to import hundreds of modules without bytecode finds most of them compiled
already, by several processes at once. It imports nothing of aiocompile (nor anything
installed): such a process starts in milliseconds.
"""

from __future__ import annotations

import importlib.util
import marshal
import os
import sys
import tempfile
import threading


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
    optimize = int(sys.argv[1]) if len(sys.argv) > 1 else -1
    for line in sys.stdin.buffer.read().decode("utf-8", "surrogateescape").splitlines():
        source, _, target = line.partition("\t")
        if source and target:
            compile_into(source, target, optimize)


if __name__ == "__main__":
    main()
