"""Loading a shared library held in memory into this process, through ctypes.

``dlopen`` wants a file. The library's bytes go to an anonymous in-memory file
(``memfd_create``): private to this process, never on a disk, and never on a ``noexec``
``/tmp`` (the loader maps the memory file itself). It is opened through a symbolic link
of a name used once (``/proc/self/fd/N`` would do, but the loader takes a library whose
path it has loaded before for that library, and descriptor numbers are reused: the
second library would be the first). Where there are no memory files, a private temporary
file (0600) is used instead. Either way what was made is removed as soon as the library
is loaded (the loader keeps its own mapping), so nothing is left behind and each load is
a library of its own.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import tempfile
import threading
from typing import Any

__all__ = ["Library", "load_library"]

_loads = itertools.count()
"""Numbers the libraries loaded in this process, so that no two have the same path."""
_UNSAFE = re.compile(r"[^\w.-]")


def load_library(data: bytes, name: str) -> ctypes.CDLL:
    """``ctypes.CDLL`` of the shared library ``data``. Blocking: call it in a thread."""
    safe = _UNSAFE.sub("_", name)[:64]
    unique = f"aiocompile-{os.getpid()}-{next(_loads)}-{safe}"
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None and os.path.isdir("/proc/self/fd"):
        try:
            fd = memfd_create(unique, getattr(os, "MFD_CLOEXEC", 0))
        except OSError:
            fd = -1
        if fd >= 0:
            scratch = tempfile.mkdtemp(prefix="aiocompile-load-")
            try:
                _write_all(fd, data)
                link = os.path.join(scratch, f"{unique}.so")
                os.symlink(f"/proc/self/fd/{fd}", link)
                return ctypes.CDLL(link)
            except OSError:
                pass  # a kernel that refuses to map it executable: try a file
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
                os.close(fd)
    fd, path = tempfile.mkstemp(prefix=f"{unique}-", suffix=".so")
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
