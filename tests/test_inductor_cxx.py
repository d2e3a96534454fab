"""Which C++ compiler builds a background compile's AOTInductor package
(``aiocompile/_torch/cxx.py``): Inductor's default, unless it has no shared C++
library, in which case another compiler on this machine that has one stands in for it.

The compiler without a shared library is a real one: this machine's ``g++`` behind a script
that answers as a GCC built without ``libstdc++.so`` does (a bare name for
``-print-file-name=libstdc++.so``) and links the static library into every shared object,
as such a GCC does. ``tests/test_background.py`` builds and loads packages with it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from aiocompile._torch import cxx

STATIC_GXX = """#!/bin/sh
for a in "$@"; do [ "$a" = "-print-file-name=libstdc++.so" ] && { echo libstdc++.so; exit 0; }; done
for a in "$@"; do [ "$a" = "-shared" ] && exec g++ "$@" -static-libstdc++; done
exec g++ "$@"
"""

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def static_gxx(directory: Path) -> str:
    """A g++ whose C++ library is only the static archive (see the module docstring)."""
    path = directory / "static-g++"
    path.write_text(STATIC_GXX)
    path.chmod(0o755)
    return str(path)


@needs_gxx
def test_a_compiler_with_a_shared_library_says_where_it_is():
    found = cxx.shared_libstdcxx("g++")
    assert isinstance(found, str) and os.path.isabs(found) and os.path.exists(found)
    assert os.path.basename(found).startswith("libstdc++.so")


def test_a_compiler_with_only_the_static_library_answers_a_bare_name(tmp_path):
    assert cxx.shared_libstdcxx(static_gxx(tmp_path)) is None


def test_a_compiler_that_cannot_be_asked_is_told_apart(tmp_path):
    assert cxx.shared_libstdcxx(str(tmp_path / "no-such-g++")) is False
    failing = tmp_path / "failing-g++"
    failing.write_text("#!/bin/sh\nexit 1\n")
    failing.chmod(0o755)
    assert cxx.shared_libstdcxx(str(failing)) is False


@needs_gxx
def test_the_default_compiler_is_kept_when_its_library_is_shared(monkeypatch):
    monkeypatch.setenv("CXX", "g++")
    choice = cxx.choose()
    assert choice == cxx.Choice("g++") and choice.describe() == "g++"


@needs_gxx
def test_a_default_compiler_without_a_shared_library_is_stood_in_for(tmp_path, monkeypatch):
    static = static_gxx(tmp_path)
    monkeypatch.setenv("CXX", static)
    choice = cxx.choose()
    assert choice.replaced == static
    assert choice.cxx == shutil.which("g++")
    assert cxx.shared_libstdcxx(choice.cxx)
    assert "no shared libstdc++" in choice.reason and f"in place of {static}" in choice.describe()


def test_with_no_compiler_to_stand_in_the_choice_fails_saying_why(tmp_path, monkeypatch):
    static = static_gxx(tmp_path)
    monkeypatch.setenv("CXX", static)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(cxx, "_CANDIDATES", ("g++", "c++"))
    with pytest.raises(RuntimeError, match="no shared libstdc.*Set CXX"):
        cxx.choose()


def test_an_unanswerable_default_is_left_to_inductor(tmp_path, monkeypatch):
    # Inductor itself then says the compiler is not usable (InvalidCxxCompiler).
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    assert cxx.choose() == cxx.Choice(str(tmp_path / "no-such-g++"))
