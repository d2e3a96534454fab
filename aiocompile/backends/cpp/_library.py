"""NativeLibrary: a shared library compiled from C++ source, its byte form, and calling it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiocompile.backends._native import _artifact
from aiocompile.backends._native._load import _UNSET, Library

__all__ = ["NativeLibrary"]

_KIND = "cpp-library"


class NativeLibrary:
    """A shared library built from C++ source by ``compile_cpp``: the ``.so`` itself
    (``binary``), how it was built (``command``, the compiler, its flags) and how long it
    took.

    ``lib.symbol("f")`` returns the library's function ``f`` through ctypes, loading the
    library into this process on first use (or ahead of it, in a thread, with ``await
    lib.load()``). A function not declared ``extern "C"`` has a mangled name.

    It pickles, and ``to_bytes()`` / ``NativeLibrary.from_bytes()`` give a versioned,
    checksummed byte form; neither carries the loaded library.
    """

    binary_ext = "so"

    def __init__(
        self,
        *,
        name: str,
        key: str,
        target: str,
        binary: bytes,
        command: str,
        compiler: str,
        compiler_version: str,
        compiler_identity: str,
        compile_time: float,
        stages: Sequence[tuple[str, float]] = (),
        diagnostics: str = "",
        dependencies: Sequence[str] = (),
        flags: Sequence[str] = (),
        include_dirs: Sequence[str] = (),
        libraries: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.key = key
        self.target = target
        self.binary = bytes(binary)
        self.command = command
        self.compiler = compiler
        self.compiler_version = compiler_version
        self.compiler_identity = compiler_identity
        self.compile_time = compile_time
        self.stages = tuple((str(stage), float(seconds)) for stage, seconds in stages)
        self.diagnostics = diagnostics
        self.dependencies = tuple(dependencies)
        self.flags = tuple(flags)
        self.include_dirs = tuple(include_dirs)
        self.libraries = tuple(libraries)
        self._library = Library(self.binary, name)

    def __repr__(self) -> str:
        return f"<NativeLibrary {self.name} {self.target} key={self.key[:12]} so:{len(self.binary)}B>"

    @property
    def size(self) -> int:
        """Bytes of the library."""
        return len(self.binary)

    # -- serialisation ------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        fields = {
            "name": self.name, "key": self.key, "target": self.target, "command": self.command,
            "compiler": self.compiler, "compiler_version": self.compiler_version,
            "compiler_identity": self.compiler_identity, "compile_time": self.compile_time,
            "stages": [list(stage) for stage in self.stages], "diagnostics": self.diagnostics,
            "dependencies": list(self.dependencies), "flags": list(self.flags),
            "include_dirs": list(self.include_dirs), "libraries": list(self.libraries),
        }
        return _artifact.pack(_KIND, fields, {"so": self.binary})

    @classmethod
    def from_bytes(cls, data: bytes) -> NativeLibrary:
        """Rebuild a library from :meth:`to_bytes`; ``ValueError`` if the bytes are not
        such a library, or are truncated or corrupted."""
        fields, sections = _artifact.unpack(data, _KIND)
        try:
            return cls(binary=sections["so"], **fields)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the library's header is incomplete or malformed ({type(exc).__name__}: {exc})") from exc

    def __reduce__(self) -> tuple[Any, ...]:
        return (NativeLibrary.from_bytes, (self.to_bytes(),))

    # -- loading and calling ------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self._library.loaded

    async def load(self) -> NativeLibrary:
        """Load the library into this process (``dlopen``, which runs its static
        initialisers) in a thread, so that the event loop keeps running. Returns the
        library itself. Cancelling the await does not stop the load."""
        from aiocompile._base.threads import LOADS

        await LOADS.run(self._library.handle)
        return self

    def symbol(self, name: str, *, restype: Any = _UNSET, argtypes: Sequence[Any] | None = None) -> Any:
        """The library's function (or variable) ``name`` as a ctypes function, with
        ``restype`` and ``argtypes`` set where given (``restype=None`` for ``void``;
        ctypes' default is ``int``). Loads the library in the calling thread if
        ``load()`` has not. ``AttributeError`` if it exports no such symbol."""
        from aiocompile._base import checks

        checks.SYMBOL.check("name", name)
        return self._library.symbol(name, restype, argtypes)
