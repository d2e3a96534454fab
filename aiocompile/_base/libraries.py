"""Shared libraries opened without the interpreter lock, ahead of their import.

Python opens an extension module's shared library (``dlopen``) holding the interpreter
lock, and the library's own start-up runs meanwhile: Triton's ``libtriton`` (476 MB, LLVM
and MLIR inside) held it 20 to 23 ms on two CPUs, a stall of the serving loop each time
aiocompile's load thread imported it. Opened first through the C library's ``dlopen`` as
a foreign function (``ctypes`` lets go of the lock around such a call), the library is
loaded and started without the lock; the import's own ``dlopen`` then finds it loaded and
only the module's initialisation runs under the lock (the loop's longest wait beside that
import: 2.0 to 2.7 ms).

Used for the extension modules imported by aiocompile's threads inside
``threads.imports_yielding``; a library that cannot be opened so is left to the import,
which reports whatever is wrong with it.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

__all__ = ["open_unlocked"]


class _Opened:
    """The libraries opened (or tried) in this process, and the ``dlopen`` to open them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.paths: set[str] = set()
        self.dlopen: Callable[[bytes, int], Any] | None = None
        self.looked = False


_OPENED = _Opened()


def _dlopen() -> Callable[[bytes, int], Any] | None:
    """The C library's ``dlopen``, callable without the interpreter lock; None where
    there is none."""
    if not _OPENED.looked:
        _OPENED.looked = True  # first: the import below comes back through open_unlocked
        if sys.platform.startswith(("linux", "darwin", "freebsd")):
            try:
                import ctypes

                dlopen = ctypes.CDLL(None).dlopen
                dlopen.restype = ctypes.c_void_p
                dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
                _OPENED.dlopen = dlopen
            except (OSError, AttributeError, ImportError):
                pass
    return _OPENED.dlopen


def open_unlocked(path: str) -> None:
    """Open the shared library at ``path`` with the flags Python's imports use, without
    the interpreter lock, once per process; nothing when that cannot be done."""
    with _OPENED.lock:
        if path in _OPENED.paths:
            return
        _OPENED.paths.add(path)
    # Not under the lock: the first call imports ctypes, whose own extension module comes
    # back here (and finds no dlopen yet: it is imported as Python would).
    dlopen = _dlopen()
    if dlopen is not None:
        # The handle is kept open for good, as Python keeps every extension module's.
        dlopen(os.fsencode(path), sys.getdlopenflags())
