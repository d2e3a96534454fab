"""Loading a shared library held in memory into this process, through ctypes.

``dlopen`` wants a file. The library's bytes go to an anonymous in-memory file
(``memfd_create``, opened as ``/proc/self/fd/N``): private to this process, never on a
disk, and never on a ``noexec`` ``/tmp``. Where there is no such thing, to a private
temporary file (0600) that is deleted as soon as it is loaded: the loader keeps its own
mapping. Either way nothing is left behind, and each load is a library of its own (the
loader tells libraries apart by file, not by name).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import threading
from typing import Any

__all__ = ["Library", "load_library"]


def load_library(data: bytes, name: str) -> ctypes.CDLL:
    """``ctypes.CDLL`` of the shared library ``data``. Blocking: call it in a thread."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None and os.path.isdir("/proc/self/fd"):
        try:
            fd = memfd_create(f"aiocompile-{name}"[:200], getattr(os, "MFD_CLOEXEC", 0))
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                _write_all(fd, data)
                return ctypes.CDLL(f"/proc/self/fd/{fd}")
            except OSError:
                pass  # a kernel that refuses to map it executable: try a file
            finally:
                os.close(fd)
    fd, path = tempfile.mkstemp(prefix="aiocompile-", suffix=".so")
    try:
        _write_all(fd, data)
        os.close(fd)
        fd = -1
        return ctypes.CDLL(path)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_UNSET: Any = object()


class Library:
    """A shared library's bytes, loaded into this process once, on first use."""

    def __init__(self, data: bytes, name: str) -> None:
        self._data = data
        self._name = name
        self._lock = threading.Lock()
        self._handle: ctypes.CDLL | None = None

    @property
    def loaded(self) -> bool:
        return self._handle is not None

    def handle(self) -> ctypes.CDLL:
        handle = self._handle
        if handle is None:
            with self._lock:
                if self._handle is None:
                    self._handle = load_library(self._data, self._name)
                handle = self._handle
        return handle

    def symbol(self, symbol: str, restype: Any = _UNSET, argtypes: Any = None) -> Any:
        """The function (or variable) ``symbol`` exports, as a ctypes function; ``restype``
        and ``argtypes`` as ctypes takes them (``restype=None`` for ``void``)."""
        try:
            function = self.handle()[symbol]
        except AttributeError:
            raise AttributeError(
                f"{self._name} exports no symbol {symbol!r} (a C++ function's name is mangled unless it is "
                "declared extern \"C\")") from None
        if restype is not _UNSET:
            function.restype = restype
        if argtypes is not None:
            function.argtypes = tuple(argtypes)
        return function
