"""A large module's bytecode loaded in pieces (``_base/pieces.py``, used by
``bytecode.CachedSourceLoader``): the code it makes is the module's code, each piece is
preceded by a look for a call being served, and only the serving process's threads that
stand aside read pieces, and keep them where they had none; other threads and processes load
the bytecode whole.
Real modules, real bytecode written by Python, real imports in fresh processes."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import subprocess_env

from aiocompile._base import pieces


def _large_source(classes: int = 60) -> str:
    """A module of classes, methods, nested functions, lambdas, comprehensions, constants."""
    parts = ["import functools\n", "TABLE = {'a': (1, 2.5, 'x'), 'b': frozenset({3, 4})}\n"]
    for n in range(classes):
        parts.append(textwrap.dedent(f"""
            class Thing{n}:
                LIMIT = {n}

                def __init__(self, value):
                    self.value = value + {n}

                def scaled(self, factor=2):
                    return [self.value * factor + i for i in range({n % 5 + 1})]

                @functools.lru_cache(maxsize=None)
                def name(self):
                    def inner(prefix="thing-{n}"):
                        return prefix + str(self.value)
                    return inner()

                def keyed(self):
                    return sorted({{k: v for k, v in TABLE.items()}}, key=lambda k: (k, {n}))
        """))
    parts.append(f"def total():\n    return sum(Thing{classes - 1}(1).scaled()[0] for _ in [0]) + len(TABLE)\n")
    return "".join(parts)


def test_split_and_join_make_the_modules_own_code_and_look_for_calls_between_pieces() -> None:
    code = compile(_large_source(), "/somewhere/large.py", "exec")
    blobs = pieces.split(code)
    assert blobs is not None and len(blobs) > 60
    asked: list[int] = []
    made = pieces.join(blobs, lambda: asked.append(1))
    assert made == code
    size = sum(len(blob) for blob, _ in blobs)
    assert len(asked) >= size // pieces.PIECE
    space: dict = {}
    exec(made, space)
    assert space["Thing3"](2).scaled() == [10, 11, 12, 13]
    assert space["Thing7"](1).name() == "thing-78"
    assert space["total"]() == space["Thing59"](1).scaled()[0] + 2


def test_code_with_a_constant_like_a_mark_is_not_split() -> None:
    code = compile("X = ('\\x00aiocompile code\\x00', 1)\ndef f():\n    return 1\n", "m.py", "exec")
    assert pieces.split(code) is None


def test_pieces_of_other_bytecode_are_not_read(tmp_path: Path) -> None:
    code = compile(_large_source(5), "m.py", "exec")
    blobs = pieces.split(code)
    assert blobs is not None
    made = pieces.made_from(b"h" * 16, 1234)
    path = str(tmp_path / "m.pieces")
    pieces.write(path, made, blobs)
    assert pieces.current(path, made)
    assert pieces.join(pieces.read(path, made) or [], lambda: None) == code
    assert not pieces.current(path, pieces.made_from(b"h" * 16, 1235))
    assert pieces.read(path, pieces.made_from(b"g" * 16, 1234)) is None
    Path(path).write_bytes(Path(path).read_bytes()[:-10])  # cut short
    assert pieces.read(path, made) is None


IMPORT = textwrap.dedent("""
    import json, sys, threading
    from aiocompile._base import bytecode, pieces, threads
    joined = []
    real_join = pieces.join
    def join(blobs, before):
        joined.append(len(blobs))
        return real_join(blobs, before)
    pieces.join = join
    def load():
        import bigpkg.big as big
        return {"joined": len(joined), "total": big.total(), "file": big.Thing1.scaled.__code__.co_filename,
                "loader": type(big.__spec__.loader).__name__}
    if sys.argv[1] == "serving":
        with threads.imports_yielding():  # the serving process's thread: stands aside
            print(json.dumps(load()))
    else:
        bytecode.install_for_process()  # a fork server's imports
        print(json.dumps(load()))
""")


def test_the_serving_process_keeps_the_pieces_of_what_it_loaded_whole_and_reads_them_next_time(tmp_path: Path) -> None:
    root = tmp_path / "src"
    (root / "bigpkg").mkdir(parents=True)
    (root / "bigpkg" / "__init__.py").write_text("")
    source = root / "bigpkg" / "big.py"
    source.write_text(_large_source(400))
    compiled = py_compile.compile(str(source), doraise=True)  # Python's own bytecode, beside it
    assert os.path.getsize(compiled) >= pieces.PIECES_FROM
    cache = tmp_path / "bytecode"
    env = subprocess_env(AIOCOMPILE_BYTECODE_DIR=str(cache))
    env["PYTHONPATH"] = os.pathsep.join((str(root), env["PYTHONPATH"]))
    env.pop("PYTHONPYCACHEPREFIX", None)

    def run(how: str) -> dict:
        import json

        done = subprocess.run([sys.executable, "-c", IMPORT, how], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    whole = run("fork-server")  # loads Python's bytecode whole, and keeps no pieces
    assert whole["joined"] == 0 and whole["loader"] == "CachedSourceLoader"
    assert not list(cache.rglob("*.pieces"))
    first = run("serving")  # none yet: loads it whole, and keeps the pieces
    kept = list(cache.rglob("*.pieces"))
    assert first["joined"] == 0 and len(kept) == 1, "\n".join(str(path.relative_to(cache)) for path in kept)
    served = run("serving")
    assert served["joined"] == 1
    assert served["total"] == whole["total"]
    assert served["file"] == whole["file"] == str(source)

    # Bytecode written again (another size): the pieces are stale, not read, and kept anew.
    source.write_text(_large_source(401))
    py_compile.compile(str(source), doraise=True)
    assert run("serving")["joined"] == 0
    assert run("serving")["joined"] == 1


def test_aiocompiles_own_bytecode_of_a_large_module_is_read_in_pieces_too(tmp_path: Path) -> None:
    """Where the installation has no bytecode (and Python writes none), aiocompile's own
    bytecode of a large module is kept in pieces the same way."""
    import json

    root = tmp_path / "src"
    (root / "bigpkg").mkdir(parents=True)
    (root / "bigpkg" / "__init__.py").write_text("")
    (root / "bigpkg" / "big.py").write_text(_large_source(400))
    cache = tmp_path / "bytecode"
    env = subprocess_env(AIOCOMPILE_BYTECODE_DIR=str(cache), PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join((str(root), env["PYTHONPATH"]))
    env.pop("PYTHONPYCACHEPREFIX", None)

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", IMPORT, "serving"], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    compiled, whole, joined = run(), run(), run()  # compiled and written; read whole; read in pieces
    assert not (root / "bigpkg" / "__pycache__").exists()
    assert [compiled["joined"], whole["joined"], joined["joined"]] == [0, 0, 1]
    assert compiled["total"] == whole["total"] == joined["total"]
