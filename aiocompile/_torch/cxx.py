"""Which C++ compiler builds an AOTInductor package that a process with torch can load.

A package's wrapper (``wrapper.so``) is loaded into a process that already holds torch,
and with it the shared C++ library (``libstdc++.so``). A compiler that has only the static
archive of its C++ library (``libstdc++.a``: ``g++ -print-file-name=libstdc++.so``
answers a bare name instead of a path) links a private copy of that library into every
shared object it builds. The wrapper then uses two C++ libraries at once: AOTInductor's
model constructor parses its device string with ``std::regex``, whose locale lookups go
by facet numbers that each copy hands out on its own, so the lookup returns another
facet. Seen for real:

- with ``CXX=/opt/gcc/bin/g++``, a GCC 13.3 built without a shared ``libstdc++``, every
  CUDA package died with SIGSEGV in ``aoti_load_package``, torch
  alone included (``std::codecvt<char16_t>::do_unshift`` called in place of
  ``std::collate<char>::transform`` under ``torch::aot_inductor::parse_device_str``); the
  same model built with ``/usr/bin/g++`` of the same host loaded and matched eager;
- on a CPU machine, a package linked with ``-static-libstdc++`` fails to load with
  ``std::bad_cast`` from the same constructor.

So before a background compile builds its package, the compiler Inductor would use by
default (``CXX``, else ``g++``) is asked where its shared C++ library is; one without it
is replaced by the first compiler on this machine that has one (``g++`` and ``c++`` on
``PATH``, then ``/usr/bin``), and the reason is kept with the compile's status. A
compiler the caller names itself (``options={"cpp.cxx": ...}``) is used as given: the
worker's trial load still keeps a package that cannot load out of the serving process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

# Compilers tried, in order, when the default one has no shared C++ library.
_CANDIDATES = ("g++", "c++", "/usr/bin/g++", "/usr/bin/c++")

# A compiler answers -print-file-name at once; one that does not is left as it is.
_ASK_TIMEOUT = 10.0


@dataclass(frozen=True)
class Choice:
    """The compiler a package is built with."""

    cxx: str
    """The compiler, as Inductor's ``cpp.cxx`` gets it."""
    replaced: str | None = None
    """The default compiler it stands in for, when it does."""
    reason: str | None = None
    """Why the default was not used."""

    def describe(self) -> str:
        if self.replaced is None:
            return self.cxx
        return f"{self.cxx} (in place of {self.replaced}: {self.reason})"


def shared_libstdcxx(cxx: str) -> str | None | bool:
    """Where ``cxx`` finds its shared C++ library: a path; ``None`` when it has none (it
    answers a bare name); ``False`` when it cannot be asked (missing, failing, silent)."""
    try:
        done = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                              timeout=_ASK_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    answer = done.stdout.strip()
    if done.returncode != 0 or not answer:
        return False
    if os.path.isabs(answer) and os.path.exists(answer):
        return answer
    return None


def default_compiler() -> str:
    """The compiler Inductor uses when told nothing: ``CXX``, else ``g++``."""
    return os.environ.get("CXX") or "g++"


def choose() -> Choice:
    """The compiler for a package when the caller named none: Inductor's default, or a
    stand-in for it when it has no shared C++ library.

    Raises :class:`RuntimeError` when the default has none and no other compiler here
    has one: a package built by it would not load beside torch."""
    cxx = default_compiler()
    if shared_libstdcxx(cxx) is not None:  # has one, or cannot be asked (Inductor then says what is wrong)
        return Choice(cxx)
    reason = (f"{cxx} has no shared libstdc++ (-print-file-name=libstdc++.so answers a bare name), so every "
              "shared object it builds carries its own copy of the C++ library, and a package built by it fails "
              "to load beside torch's")
    own = shutil.which(cxx) or cxx
    for candidate in _CANDIDATES:
        path = shutil.which(candidate)
        if path is None or os.path.realpath(path) == os.path.realpath(own):
            continue
        if shared_libstdcxx(path) not in (None, False):
            return Choice(path, replaced=cxx, reason=reason)
    raise RuntimeError(f"{reason}; no other C++ compiler here ({', '.join(_CANDIDATES)}) has a shared libstdc++. "
                       "Set CXX to one that has, or pass options={'cpp.cxx': ...}")
