"""The headers a source reads from the directories it is given, for its key.

A C++ or CUDA source's key covers the contents of every header it includes from its
include directories (``include_dirs=``, and ``-I``, ``-iquote``, ``-isystem``,
``-idirafter``, ``-include`` in its flags), so that editing one compiles anew. The
compiler's own headers and the system's are not read: the compiler's identity and version
stand for them.

They are found by a scan, in the parent, before the compile: each ``#include "..."`` and
``#include <...>`` line of the source, then of each header found, resolved the way GCC
resolves it (a quoted name first in the including file's directory, then the ``-iquote``
directories; then, for both kinds, the ``-I``, ``-isystem`` and ``-idirafter`` directories
in command-line order). A line inside a comment or an ``#if 0`` counts too: a header read
for nothing makes a key change for nothing, never the other way round. An
``#include_next`` takes every match. A header's digest and its include lines are kept
per file and stat (inode, size, modification and change times), so a request seen before
costs a ``stat`` per header.

The directories of ``CPATH`` are searched after the ``-I`` ones, those of
``C_INCLUDE_PATH``, ``CPLUS_INCLUDE_PATH`` and ``OBJC_INCLUDE_PATH`` after the
``-isystem`` ones, as GCC and Clang search them.

What a scan cannot follow is an include computed by the preprocessor (``#include
HEADER_MACRO``; ``Scan.complete`` is False). Then the compiler's own dependency output
(``-MM``) is asked, in a worker (``_run.dependencies``), and every header it names is
keyed too.

Files are opened without blocking and read only when they are regular files: a FIFO or a
device where a header (or a library, a response file) is expected is not read, rather
than holding the thread that keys every request.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

__all__ = ["HeaderIndex", "Scan", "SearchPath", "absolute_paths", "digest_regular", "make_dependencies", "read_regular"]

# Options that take a path, and what the path is for: "quote"/"angle" directories of the
# include search, a "forced" include, or another path ("other": made absolute only).
# GCC and Clang spell them as the first group; nvcc and hipcc take these too, and nvcc its
# long forms.
_PATH_OPTIONS = {
    "-I": "angle", "-isystem": "angle", "-idirafter": "angle", "-iquote": "quote",
    "-include": "forced", "-imacros": "forced", "-L": "other",
    "--include-path": "angle", "--system-include": "angle", "--pre-include": "forced", "--library-path": "other",
    "-ccbin": "other", "--compiler-bindir": "other",
}
# Those of them that may be glued to their path ("-Iinclude").
_JOINABLE = ("-idirafter", "-isystem", "-iquote", "-I", "-L")
# The order in which the directories of the angle-bracket search are searched: options,
# and the environment variables that add to them.
_RANK = {"-I": 0, "--include-path": 0, "CPATH": 1, "-isystem": 2, "--system-include": 2, "C_INCLUDE_PATH": 3,
         "CPLUS_INCLUDE_PATH": 3, "OBJC_INCLUDE_PATH": 3, "-idirafter": 4}

_DIRECTIVE = re.compile(r"^[ \t]*#[ \t]*(include_next|include|import)\b[ \t]*(.*)$", re.M)
_NAME = re.compile(r'"([^"\n]+)"|<([^>\n]+)>')


def _split(argv: Sequence[str]) -> Iterable[tuple[int, str, str]]:
    """(index of the path's token, option, path) for each path-taking option in ``argv``;
    the index points at the joined token where the path is glued to its option."""
    index = 0
    while index < len(argv):
        token = argv[index]
        if token in _PATH_OPTIONS and index + 1 < len(argv):
            yield index + 1, token, argv[index + 1]
            index += 2
            continue
        if token.startswith("--") and "=" in token and token.split("=", 1)[0] in _PATH_OPTIONS:
            option, _, path = token.partition("=")
            yield index, option, path
        else:
            glued = next((o for o in _JOINABLE if token.startswith(o) and len(token) > len(o)), None)
            if glued is not None:
                yield index, glued, token[len(glued):]
        index += 1


def absolute_paths(argv: Sequence[str], cwd: str | None = None) -> tuple[str, ...]:
    """``argv`` with the paths of its path-taking options made absolute. A compile runs in
    a scratch directory of its worker, where a relative path would point elsewhere."""
    cwd = cwd or os.getcwd()
    out = list(argv)
    for index, option, path in _split(argv):
        if os.path.isabs(path) or not path:
            continue
        absolute = os.path.normpath(os.path.join(cwd, path))
        token = out[index]
        if token == path:
            out[index] = absolute
        elif token.startswith("--"):
            out[index] = f"{option}={absolute}"
        else:
            out[index] = f"{option}{absolute}"
    return tuple(out)


@dataclass(frozen=True)
class SearchPath:
    """Where a compiler looks for included files, as its command line says."""

    quote: tuple[str, ...] = ()
    angle: tuple[str, ...] = ()
    forced: tuple[str, ...] = ()

    @classmethod
    def from_argv(cls, argv: Sequence[str], environment: Iterable[tuple[str, str | None]] = ()) -> SearchPath:
        """The search of a command line (less its compiler), with the include path
        variables of ``environment`` (``_compiler.environment``)."""
        found: dict[str, list[str]] = {"quote": [], "angle": [], "forced": [], "other": []}
        for _, option, path in _split(argv):
            found[_PATH_OPTIONS[option]].append(path)
        # GCC searches -I, then CPATH, then -isystem, then C_INCLUDE_PATH and its kin,
        # then -idirafter, whatever their order on the line; within each, in order.
        angle = [(_RANK[option], n, path) for n, (_, option, path) in enumerate(_split(argv)) if option in _RANK]
        for name, value in environment:
            if value and name in _RANK:
                angle += [(_RANK[name], n, path) for n, path in enumerate(value.split(os.pathsep)) if path]
        return cls(tuple(found["quote"]), tuple(path for _, _, path in sorted(angle)), tuple(found["forced"]))

    @property
    def empty(self) -> bool:
        return not (self.quote or self.angle or self.forced)


@dataclass(frozen=True)
class Scan:
    headers: tuple[tuple[str, str], ...]
    """(absolute path, SHA-256 of its contents) of each header found, sorted."""
    complete: bool
    """False where a computed ``#include`` was met: the scan alone may have missed some."""


@dataclass(frozen=True)
class _File:
    digest: str
    includes: tuple[tuple[str, str], ...]
    computed: bool


def _parse(text: str) -> tuple[tuple[tuple[str, str], ...], bool]:
    """The include lines of a file (kind "quote", "angle" or "next", and the name), and
    whether any of them names its file through a macro."""
    text = text.replace("\\\r\n", "").replace("\\\n", "")
    includes: list[tuple[str, str]] = []
    computed = False
    for directive, argument in _DIRECTIVE.findall(text):
        name = _NAME.match(argument)
        if name is None:
            computed = True
            continue
        kind = "next" if directive == "include_next" else ("quote" if name.group(1) is not None else "angle")
        includes.append((kind, name.group(1) or name.group(2)))
    return tuple(includes), computed


class HeaderIndex:
    """What is known of each header file, by path and stat. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[tuple[object, ...], _File] = {}

    def file(self, path: str) -> _File | None:
        """The header at ``path`` (None if it is not a regular file that can be read)."""
        return self._known(path, parse=True)

    def digest(self, path: str) -> str | None:
        """SHA-256 of the file at ``path`` (None if it is not a regular file that can be
        read); its include lines are not looked for (a library, a linker script)."""
        found = self._known(path, parse=False)
        return None if found is None else found.digest

    def _known(self, path: str, parse: bool) -> _File | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        stamp = (path, parse, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with self._lock:
            known = self._files.get(stamp)
        if known is not None:
            return known
        if parse:
            data = read_regular(path)
            if data is None:
                return None
            includes, computed = _parse(data.decode("latin-1"))
            found = _File(hashlib.sha256(data).hexdigest(), includes, computed)
        else:
            digest = digest_regular(path)
            if digest is None:
                return None
            found = _File(digest, (), False)
        with self._lock:
            if len(self._files) > 100_000:  # stale stats of edited files pile up in a long-lived process
                self._files.clear()
            self._files[stamp] = found
        return found

    def scan(self, source: str, search: SearchPath, extra: Iterable[str] = ()) -> Scan:
        """The headers ``source`` reads from ``search``'s directories, and ``extra`` files
        (a compiler's dependency output) with what they include."""
        includes, computed = _parse(source)
        pending: list[tuple[str | None, str, str]] = [(None, kind, name) for kind, name in includes]
        pending += [(None, "path", path) for path in (*search.forced, *extra)]
        found: dict[str, str] = {}
        complete = not computed
        while pending:
            origin, kind, name = pending.pop()
            for path in self._resolve(origin, kind, name, search):
                if path in found:
                    continue
                header = self.file(path)
                if header is None:
                    continue
                found[path] = header.digest
                complete = complete and not header.computed
                directory = os.path.dirname(path)
                pending.extend((directory, k, n) for k, n in header.includes)
        return Scan(tuple(sorted(found.items())), complete)

    @staticmethod
    def _resolve(origin: str | None, kind: str, name: str, search: SearchPath) -> list[str]:
        if kind == "path" or os.path.isabs(name):
            return [name] if os.path.isfile(name) else []
        directories = list(search.angle)
        if kind == "quote":
            directories = ([origin] if origin else []) + list(search.quote) + directories
        matches = []
        for directory in directories:
            path = os.path.normpath(os.path.join(directory, name))
            if os.path.isfile(path):
                if kind != "next":
                    return [path]
                matches.append(path)
        return matches


def read_regular(path: str) -> bytes | None:
    """The contents of ``path`` if it is a regular file that can be read, else None. Opened
    without blocking, so that a FIFO there does not wait for a writer."""
    pieces = _pieces(path)
    try:
        return None if pieces is None else b"".join(pieces)
    except OSError:
        return None


def digest_regular(path: str) -> str | None:
    """SHA-256 of ``path`` as ``read_regular`` reads it, read in pieces (an archive or a
    library may be large)."""
    pieces = _pieces(path)
    if pieces is None:
        return None
    digest = hashlib.sha256()
    try:
        for piece in pieces:
            digest.update(piece)
    except OSError:
        return None
    return digest.hexdigest()


def _pieces(path: str) -> Iterator[bytes] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        os.close(fd)
        return None
    return _read_all(fd)


def _read_all(fd: int) -> Iterator[bytes]:
    with os.fdopen(fd, "rb") as f:
        yield from iter(lambda: f.read(1 << 20), b"")


def make_dependencies(text: str) -> list[str]:
    """The prerequisites of the first rule of a make-style dependency file (``-MD``,
    ``-MM``), unescaped."""
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")
    first = text.split("\n", 1)[0]
    _, _, prerequisites = first.partition(": ")
    words = re.findall(r"(?:\\.|[^\s\\])+", prerequisites)
    return [re.sub(r"\\(.)", r"\1", word).replace("$$", "$") for word in words]
