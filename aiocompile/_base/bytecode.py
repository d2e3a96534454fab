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

Two more uses of the same directory. ``prepare``: as a fork server starts, on a machine
with CPUs to spare, helper processes (``pyc``) compile ahead, several at once, the sources
the fork server and its workers are about to import, so that a host's first start does not
compile them one after another. ``PackageImports``: under ``install()``, the program's own
imports of Inductor's packages read it too (``torch.compile`` imports them in the calling
thread); every other import of the program is left to Python.

And one more: a large module's bytecode (``pieces.PIECES_FROM`` bytes or more, Python's own
beside the source or ours) imported by the serving process's threads that stand aside for
calls being served is loaded from pieces kept in the same directory (:mod:`.pieces`): many
short C calls, each preceded by a look for a call being served, rather than one
``marshal.loads`` of the whole file that holds the interpreter lock (Inductor's ``ir.py``:
4 ms in a quiet process, 8 to 15 ms on 2 busy CPUs). Those threads keep the pieces of
what they loaded whole, for the next process.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import marshal
import os
import sys
import threading
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import CodeType
from typing import Any

from aiocompile._base import aside, paths, pieces, pyc

__all__ = ["CachedSourceLoader", "PackageImports", "directory", "find_spec_after", "install_for_process", "prepare",
           "seed"]

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


_SEEDS: dict[str, dict[str, Any]] = {}


def seed(name: str, **values: Any) -> None:
    """Names put in module ``name``'s namespace before its code runs, when aiocompile's
    threads or processes import it (through a :class:`CachedSourceLoader`): a name its
    code looks up there before the builtins (``generated`` gives ``exec`` so)."""
    _SEEDS.setdefault(name, {}).update(values)


class CachedSourceLoader(importlib.machinery.SourceFileLoader):
    """Python's loader for a module's source, but where the module has no bytecode file
    beside it (where Python itself would look) and Python will write none there (it may
    not, ``PYTHONDONTWRITEBYTECODE``, or cannot), the code comes from ``root``'s copy,
    written there by the first process that compiled it. A module :func:`seed` names
    gets its names first."""

    def __init__(self, fullname: str, path: str, root: str) -> None:
        super().__init__(fullname, path)
        self.root = root

    def exec_module(self, module: Any) -> None:
        for key, value in _SEEDS.get(module.__name__, {}).items():
            module.__dict__.setdefault(key, value)
        super().exec_module(module)

    def get_code(self, fullname: str) -> CodeType | None:
        source_path = self.get_filename(fullname)
        try:
            beside = importlib.util.cache_from_source(source_path)
        except NotImplementedError:  # an interpreter that keeps no bytecode
            return super().get_code(fullname)
        if os.path.exists(beside) or pyc.writes_beside(beside, sys.dont_write_bytecode):
            return self._beside(fullname, source_path, beside)
        try:
            stat = os.stat(source_path)
        except OSError:
            return super().get_code(fullname)
        header = pyc.header(stat)
        ours = pyc.target(self.root, source_path, beside)
        try:
            with open(ours, "rb") as file:
                data = file.read()
        except OSError:
            data = b""
        if data[:16] == header:
            in_pieces = len(data) >= pieces.PIECES_FROM and aside.attached()
            if in_pieces:
                made = _in_pieces(ours, pieces.made_from(header, len(data)), source_path)
                if made is not None:
                    return made
            aside.before_holding()  # the read let the lock go; the unmarshalling holds it
            try:
                code = marshal.loads(memoryview(data)[16:])
            except (EOFError, ValueError, TypeError):
                code = None  # damaged: compiled again, and written again
            if isinstance(code, CodeType):
                if in_pieces:
                    _keep_pieces(ours, pieces.made_from(header, len(data)), code)
                return code
        code = self.source_to_code(self.get_data(source_path), source_path)
        pyc.write(ours, header + marshal.dumps(code))
        return code

    def _beside(self, fullname: str, source_path: str, beside: str) -> CodeType | None:
        """Python's own bytecode beside the source, loaded in pieces (:mod:`.pieces`) where it
        is large, current and this thread stands aside for calls being served (only the
        serving process's threads: a fork server's and a worker's imports are Python's)."""
        if not aside.attached():
            return super().get_code(fullname)
        try:
            size = os.stat(beside).st_size
            if size < pieces.PIECES_FROM:
                return super().get_code(fullname)
            header = pyc.header(os.stat(source_path))
            with open(beside, "rb") as file:
                current = file.read(16) == header
        except OSError:
            return super().get_code(fullname)
        if not current:  # stale, or checked by hash: Python's own way
            return super().get_code(fullname)
        path = pyc.target(self.root, source_path, beside)
        made = _in_pieces(path, pieces.made_from(header, size), source_path)
        if made is not None:
            return made
        code = super().get_code(fullname)
        if isinstance(code, CodeType):
            _keep_pieces(path, pieces.made_from(header, size), code)
        return code


_PIECES_SUFFIX = ".pieces"


def _in_pieces(target: str, made: bytes, source_path: str) -> CodeType | None:
    """The module's code from its pieces beside ``target`` (our bytecode's path for it),
    where they were made from this bytecode; else None."""
    blobs = pieces.read(target + _PIECES_SUFFIX, made)
    if blobs is None:
        return None
    try:
        code = pieces.join(blobs, aside.before_holding)
    except (ValueError, EOFError, TypeError, IndexError):
        return None
    import _imp

    _imp._fix_co_filename(code, source_path)  # type: ignore[attr-defined]  # as Python's own loader does
    return code


def _keep_pieces(target: str, made: bytes, code: CodeType) -> None:
    """Keep the module's code in pieces beside ``target`` for the next process, unless they
    are there already. Called only where the pieces would have been read (the serving
    process's standing-aside threads): only what the serving process needs is kept (with a
    floor of 96 KB a fork server's imports would have kept 132 modules, 29 MB, splitting
    each as it starts; a CPU model's load imports kept 96, 22 MB, and 27, 10 MB, at 256 KB)."""
    path = target + _PIECES_SUFFIX
    if pieces.current(path, made):
        return
    blobs = pieces.split(code)
    if blobs:
        pieces.write(path, made, blobs)



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


class PackageImports:
    """A finder first on ``sys.meta_path`` of the program's own process: imports of the
    named packages' modules there read (and write) aiocompile's bytecode, as its own
    processes' imports do; every other import is Python's alone. ``install()`` puts one
    there for Inductor's packages: ``torch.compile`` imports hundreds of their modules in
    the program's thread, each compiled from its source where the installation has no
    bytecode, and ``prepare`` has compiled most of them by then."""

    def __init__(self, packages: Sequence[str]) -> None:
        self.names = frozenset(packages)
        self.prefixes = tuple(f"{name}." for name in packages)

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> ModuleSpec | None:
        if name in self.names or name.startswith(self.prefixes):
            return find_spec_after(self, name, path, target)
        return None

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def install_for_process() -> None:
    """Every import of this process from now on reads aiocompile's bytecode where a module
    has none of its own (a fork server's, a worker's); its children forked later too."""
    if not any(isinstance(finder, _EveryImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EveryImport())


# Helpers are started only on machines with this many CPUs at least (a fork server and the
# program itself run beside them), only for this many sources lacking bytecode at least,
# and one per this many CPUs, up to the most.
PREPARE_MIN_CPUS = 8
PREPARE_MIN_SOURCES = 64
PREPARE_CPUS_PER_HELPER = 2
PREPARE_MAX_HELPERS = 8


def prepare(packages: Sequence[str] = ()) -> threading.Thread | None:
    """Start compiling, in processes of their own and without waiting, the sources that
    lack bytecode of every module this process has imported and of every module in the
    packages named (their parents imported, if need be), into aiocompile's directory, in
    the order this process imported them: a fork server about to start, which imports them
    again, then finds most of them compiled. This process only lists the modules and
    folders: looking for what lacks bytecode, and compiling it, is the helpers' work
    (``pyc``), the first of which a thread here starts and feeds. That thread, or None
    when there is nothing to do: no directory, too few CPUs."""
    root = directory()
    cpus = os.cpu_count() or 1
    if root is None or cpus < PREPARE_MIN_CPUS:
        return None
    lines = [f"S\t{origin}" for origin in map(_source_of, list(sys.modules.values())) if origin]
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)  # not imported: only its parent, if need be
        except (ImportError, ValueError):
            continue
        lines.extend(f"P\t{folder}" for folder in getattr(spec, "submodule_search_locations", None) or ())
    command = [sys.executable, "-I", "-S", os.path.join(os.path.dirname(os.path.abspath(pyc.__file__)), "pyc.py"),
               root, str(sys.flags.optimize), "1" if sys.dont_write_bytecode else "0", sys.pycache_prefix or "",
               str(min(PREPARE_MAX_HELPERS, cpus // PREPARE_CPUS_PER_HELPER)), str(PREPARE_MIN_SOURCES)]
    thread = threading.Thread(target=_hand_out, args=(command, "\n".join(lines).encode("utf-8", "surrogateescape")),
                              name="aiocompile-bytecode", daemon=True)
    thread.start()
    return thread


def _source_of(module: Any) -> str | None:
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None)
    if isinstance(origin, str) and origin.endswith(".py") and getattr(spec, "has_location", False):
        return origin
    return None


def _hand_out(command: list[str], listed: bytes) -> None:
    import subprocess  # here, in the thread: importing it costs the program's import 3 ms

    try:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return
    try:
        proc.communicate(listed)
    except OSError:
        proc.kill()
        proc.wait()
