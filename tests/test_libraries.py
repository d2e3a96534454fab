"""``_base.libraries``: an extension module imported by aiocompile's threads has its shared
library opened without the interpreter lock first, then imported as Python would."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import subprocess_env

from aiocompile._base import libraries

SCRIPT = textwrap.dedent("""
    import sys
    from aiocompile._base import libraries, threads
    assert "ctypes" not in sys.modules and "_sqlite3" not in sys.modules
    with threads.imports_yielding():
        import sqlite3  # its extension module, _sqlite3: ctypes is imported for it first
    with sqlite3.connect(":memory:") as db:
        assert db.execute("select 6 * 7").fetchone() == (42,)
    import _ctypes, _sqlite3
    opened = libraries._OPENED.paths
    # _sqlite3's library was opened ahead; _ctypes's too (imported for the first), through
    # the same path, without ever waiting for itself.
    print(_sqlite3.__file__ in opened, _ctypes.__file__ in opened, libraries._OPENED.dlopen is not None)
""")


def test_an_extension_module_imported_inside_the_block_has_its_library_opened_first():
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=subprocess_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True"]


def test_a_file_that_is_no_library_is_left_to_the_import(tmp_path):
    broken = tmp_path / "not_a_library.so"
    broken.write_bytes(b"not an ELF file")
    libraries.open_unlocked(str(broken))  # nothing raised: the import would say what is wrong
    libraries.open_unlocked(str(tmp_path / "missing.so"))
    assert str(broken) in libraries._OPENED.paths
