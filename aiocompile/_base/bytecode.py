"""Bytecode of aiocompile's own for the modules its threads and processes import, where
the installation has none beside them and Python will write none.

An import of a module without bytecode compiles its source, and ``compile()`` holds the
interpreter lock throughout: 20 to 120 ms for one of Inductor's larger modules. A
container image built with ``PYTHONDONTWRITEBYTECODE=1`` (or packages installed where
this user may not write) has none and writes none, so every process compiles every module
again, each time. In the serving process, the thread that imports what loading a compiled
version needs then holds the event loop that long, module after module; the fork server
and the workers start seconds later.

So the imports of aiocompile's own threads in the serving process (those inside
``threads.imports_yielding``) and every import of its fork server and workers
(:func:`install_for_process`) read, for a module with no bytecode beside its source, the
bytecode this module wrote for it in a directory of aiocompile's, unless Python will
write it beside the source itself: the first process to import it writes it, the ones
after read it. It is checked against its source as Python
checks its own (the source's modification time and size, the interpreter's magic number),
and written whole or not at all. A module with bytecode of its own is imported as Python
would. The directory is ``aiocompile/bytecode`` in the user's cache directory, or
``AIOCOMPILE_BYTECODE_DIR`` (``off`` for none).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import marshal
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import CodeType
from typing import Any

from aiocompile._base import paths

__all__ = ["CachedSourceLoader", "directory", "find_spec_after", "install_for_process"]

_OFF = ("off", "0", "false", "no", "none")


def directory() -> str | None:
    """Where the bytecode goes: ``AIOCOMPILE_BYTECODE_DIR``, else ``aiocompile/bytecode``
    in the user's cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``); None when
    the variable says ``off``."""
    value = os.environ.get("AIOCOMPILE_BYTECODE_DIR", "").strip()
    if value.lower() in _OFF:
        return None
    if value:
        return os.path.abspath(os.path.expanduser(value))
    return paths.user_cache("bytecode")


class _Made:
    """The directories made (or found) in this process, so each is made once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.directories: set[str] = set()


_MADE = _Made()


class CachedSourceLoader(importlib.machinery.SourceFileLoader):
    """Python's loader for a module's source, but where the module has no bytecode file
    beside it (where Python itself would look) and Python will write none there (it may
    not, ``PYTHONDONTWRITEBYTECODE``, or cannot), the code comes from ``root``'s copy,
    written there by the first process that compiled it."""

    def __init__(self, fullname: str, path: str, root: str) -> None:
        super().__init__(fullname, path)
        self.root = root

    def get_code(self, fullname: str) -> CodeType | None:
        source_path = self.get_filename(fullname)
        try:
            beside = importlib.util.cache_from_source(source_path)
        except NotImplementedError:  # an interpreter that keeps no bytecode
            return super().get_code(fullname)
        if os.path.exists(beside) or _writes_beside(beside):
            return super().get_code(fullname)
        try:
            stat = os.stat(source_path)
        except OSError:
            return super().get_code(fullname)
        header = _header(stat)
        ours = self._ours(source_path, beside)
        try:
            with open(ours, "rb") as file:
                data = file.read()
        except OSError:
            data = b""
        if data[:16] == header:
            try:
                code = marshal.loads(memoryview(data)[16:])
            except (EOFError, ValueError, TypeError):
                code = None  # damaged: compiled again, and written again
            if isinstance(code, CodeType):
                return code
        code = self.source_to_code(self.get_data(source_path), source_path)
        _write(ours, header + marshal.dumps(code))
        return code

    def _ours(self, source_path: str, beside: str) -> str:
        folder = os.path.dirname(os.path.abspath(source_path))
        # The same file name Python would give it (its interpreter tag, its optimisation level).
        return os.path.join(self.root, folder.lstrip(os.sep), os.path.basename(beside))


def _writes_beside(beside: str) -> bool:
    """Whether Python writes a module's bytecode at ``beside`` itself (it may, and can)."""
    if sys.dont_write_bytecode:
        return False
    folder = os.path.dirname(beside)
    while not os.path.isdir(folder):  # __pycache__ (or a prefix's folders) not made yet
        parent = os.path.dirname(folder)
        if parent == folder:
            return False
        folder = parent
    return os.access(folder, os.W_OK)


def _header(stat: os.stat_result) -> bytes:
    """A timestamp-checked pyc's header for a source with this ``stat``, as Python writes it."""
    return (importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
            + (int(stat.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
            + (stat.st_size & 0xFFFFFFFF).to_bytes(4, "little"))


def _write(path: str, data: bytes) -> None:
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


def find_spec_after(finder: object, name: str, path: Sequence[str] | None, target: Any = None) -> ModuleSpec | None:
    """What the finders after ``finder`` on ``sys.meta_path`` find for ``name`` (None when
    they find nothing), with a :class:`CachedSourceLoader` where the module would be loaded
    from its source by Python's own loader and there is a bytecode directory."""
    finders = sys.meta_path
    try:
        after = finders.index(finder) + 1  # type: ignore[arg-type]
    except ValueError:
        return None
    for other in finders[after:]:
        find = getattr(other, "find_spec", None)
        if find is None:
            continue
        spec = find(name, path, target)
        if spec is None:
            continue
        loader = spec.loader
        if type(loader) is importlib.machinery.SourceFileLoader:
            root = directory()
            if root is not None:
                spec.loader = CachedSourceLoader(loader.name, loader.path, root)
        return spec
    return None


class _EveryImport:
    """A finder first on ``sys.meta_path`` of one of aiocompile's processes: every import
    there reads (and writes) aiocompile's bytecode (:func:`find_spec_after`)."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> ModuleSpec | None:
        return find_spec_after(self, name, path, target)


def install_for_process() -> None:
    """Every import of this process from now on reads aiocompile's bytecode where a module
    has none of its own (a fork server's, a worker's); its children forked later too."""
    if not any(isinstance(finder, _EveryImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EveryImport())
