"""The C++ backend: ``compile_cpp`` arguments -> a shared library built in a worker -> a
``NativeLibrary``.

- ``_backend``: checking a request, its command line and its key;
- ``_worker``: what a worker runs (the compiler, in a scratch directory);
- ``_library``: ``NativeLibrary``, the artifact: bytes, loading and calling through ctypes.

What it shares with the CUDA backend (finding the compiler, scanning headers, running the
compiler, the byte form) is in ``backends._native``.
"""

from aiocompile.backends.cpp._backend import CppBackend, CppSpec
from aiocompile.backends.cpp._library import NativeLibrary

__all__ = ["CppBackend", "CppSpec", "NativeLibrary"]
