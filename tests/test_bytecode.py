"""``_base.bytecode``: modules without bytecode of their own, imported by aiocompile's
threads and processes, compiled once and read from aiocompile's directory after that."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import subprocess_env

import aiocompile

IMPORT = textwrap.dedent("""
    import sys, threading
    from aiocompile._base import bytecode, threads
    if "--no-compile" in sys.argv:
        # Every module must come from aiocompile's bytecode: compiling one fails the import.
        def refuse(self, data, path):
            raise AssertionError(f"compiled {path}")
        bytecode.CachedSourceLoader.source_to_code = refuse
    def load():
        import freshpkg.mod
        print(freshpkg.mod.VALUE, type(freshpkg.mod.__spec__.loader).__name__)
    if "--outside" in sys.argv:
        load()
    else:
        with threads.imports_yielding():
            load()
""")


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """A package no process has imported, with no bytecode beside it."""
    root = tmp_path / "src"
    (root / "freshpkg").mkdir(parents=True)
    (root / "freshpkg" / "__init__.py").write_text("")
    (root / "freshpkg" / "mod.py").write_text("VALUE = 1\n")
    return root


def run_import(package: Path, cache: Path | str, *flags: str, dont_write: bool = True) -> str:
    env = subprocess_env(AIOCOMPILE_BYTECODE_DIR=str(cache))
    env["PYTHONPATH"] = os.pathsep.join((str(package), env["PYTHONPATH"]))
    env.pop("PYTHONPYCACHEPREFIX", None)
    if dont_write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    done = subprocess.run([sys.executable, "-c", IMPORT, *flags], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def ours(cache: Path, source: Path) -> Path:
    return cache / str(source.parent).lstrip(os.sep) / f"{source.stem}.{sys.implementation.cache_tag}.pyc"


def test_a_module_without_bytecode_is_compiled_once_then_read(package: Path, tmp_path: Path) -> None:
    cache = tmp_path / "bytecode"
    assert run_import(package, cache) == "1 CachedSourceLoader"
    written = ours(cache, package / "freshpkg" / "mod.py")
    assert written.is_file()
    assert ours(cache, package / "freshpkg" / "__init__.py").is_file()
    assert not (package / "freshpkg" / "__pycache__").exists()  # nothing beside the source
    # A second process compiles nothing.
    assert run_import(package, cache, "--no-compile") == "1 CachedSourceLoader"


def test_a_changed_source_is_compiled_again(package: Path, tmp_path: Path) -> None:
    cache = tmp_path / "bytecode"
    run_import(package, cache)
    (package / "freshpkg" / "mod.py").write_text("VALUE = 22\n")  # another size
    assert run_import(package, cache) == "22 CachedSourceLoader"
    assert run_import(package, cache, "--no-compile") == "22 CachedSourceLoader"


def test_damaged_bytecode_is_compiled_again_and_replaced(package: Path, tmp_path: Path) -> None:
    cache = tmp_path / "bytecode"
    run_import(package, cache)
    written = ours(cache, package / "freshpkg" / "mod.py")
    header = written.read_bytes()[:16]
    written.write_bytes(header + b"\x00 not marshal data")
    assert run_import(package, cache) == "1 CachedSourceLoader"
    assert run_import(package, cache, "--no-compile") == "1 CachedSourceLoader"


def test_where_python_writes_bytecode_itself_it_does(package: Path, tmp_path: Path) -> None:
    cache = tmp_path / "bytecode"
    assert run_import(package, cache, dont_write=False) == "1 CachedSourceLoader"
    assert not cache.exists()
    assert list((package / "freshpkg" / "__pycache__").glob("mod.*.pyc"))


def test_off_and_imports_outside_the_block_use_none(package: Path, tmp_path: Path) -> None:
    assert run_import(package, "off") == "1 SourceFileLoader"
    cache = tmp_path / "bytecode"
    assert run_import(package, cache, "--outside") == "1 SourceFileLoader"
    assert not cache.exists()


def test_an_unwritable_directory_still_imports(package: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert run_import(package, blocked / "bytecode") == "1 CachedSourceLoader"


async def test_the_fork_server_and_its_workers_write_it(package: Path, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "bytecode"
    monkeypatch.setenv("AIOCOMPILE_BYTECODE_DIR", str(cache))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # nor does this process write it beside
    monkeypatch.syspath_prepend(str(package))
    (package / "freshpkg" / "work.py").write_text("def value():\n    return 3\n")
    config = aiocompile.SchedulerConfig(workers=1, preload=("freshpkg.mod",), start_method="forkserver")
    async with aiocompile.Scheduler(config=config) as sched:
        await sched.warm()
        # The fork server's preload, then a module the worker imports for its job.
        assert ours(cache, package / "freshpkg" / "mod.py").is_file()
        from freshpkg.work import value

        assert await sched.run(value) == 3
    assert ours(cache, package / "freshpkg" / "work.py").is_file()
    sys.modules.pop("freshpkg.work", None)
    sys.modules.pop("freshpkg", None)


def test_prepare_compiles_the_imported_and_named_sources_in_processes_of_their_own(
        package: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare`` hands the sources that lack bytecode, of the modules this process has
    imported and of the packages named, to helper processes that write their bytecode;
    an import then compiles none of them."""
    from aiocompile._base import bytecode

    cache = tmp_path / "bytecode"
    (package / "importedpkg").mkdir()
    (package / "importedpkg" / "__init__.py").write_text("VALUE = 2\n")
    (package / "freshpkg" / "tests").mkdir()
    (package / "freshpkg" / "tests" / "test_mod.py").write_text("")  # never imported: skipped
    monkeypatch.setenv("AIOCOMPILE_BYTECODE_DIR", str(cache))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.setattr(bytecode, "PREPARE_MIN_CPUS", 1)
    monkeypatch.setattr(bytecode, "PREPARE_MIN_SOURCES", 3)
    monkeypatch.setattr(bytecode, "PREPARE_CPUS_PER_HELPER", 1)
    import importedpkg  # noqa: F401  (compiled here, no bytecode written anywhere)

    assert not ours(cache, package / "importedpkg" / "__init__.py").exists()
    thread = bytecode.prepare(["freshpkg"])
    assert thread is not None
    thread.join(60)
    assert not thread.is_alive()
    for source in (package / "importedpkg" / "__init__.py", package / "freshpkg" / "__init__.py",
                   package / "freshpkg" / "mod.py"):
        assert ours(cache, source).is_file(), source
    assert not ours(cache, package / "freshpkg" / "tests" / "test_mod.py").exists()
    assert "freshpkg" not in sys.modules  # named, not imported
    assert run_import(package, cache, "--no-compile") == "1 CachedSourceLoader"
    # Everything current: nothing to hand out, no helper started.
    monkeypatch.setattr(bytecode, "PREPARE_MIN_SOURCES", 1)
    before = {path: path.stat().st_mtime_ns for path in cache.rglob("*.pyc")}
    thread = bytecode.prepare(["freshpkg"])
    assert thread is not None
    thread.join(60)
    assert {path: path.stat().st_mtime_ns for path in cache.rglob("*.pyc")} == before


def test_prepare_does_nothing_with_bytecode_off_or_on_a_small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiocompile._base import bytecode

    monkeypatch.setenv("AIOCOMPILE_BYTECODE_DIR", "off")
    assert bytecode.prepare(["json"]) is None
    monkeypatch.delenv("AIOCOMPILE_BYTECODE_DIR")
    monkeypatch.setattr(os, "cpu_count", lambda: bytecode.PREPARE_MIN_CPUS - 1)
    assert bytecode.prepare(["json"]) is None


def test_package_imports_read_aiocompiles_bytecode_for_the_named_packages_only(package: Path, tmp_path: Path) -> None:
    """``PackageImports`` (which ``install()`` puts first on ``sys.meta_path`` for Inductor's
    packages): the named packages' modules come through aiocompile's bytecode, compiled
    once; every other import is Python's own; uninstalled, it is gone."""
    (package / "otherpkg").mkdir()
    (package / "otherpkg" / "__init__.py").write_text("")
    script = textwrap.dedent("""
        import sys
        from aiocompile._base import bytecode
        if "--no-compile" in sys.argv:
            def refuse(self, data, path):
                raise AssertionError(f"compiled {path}")
            bytecode.CachedSourceLoader.source_to_code = refuse
        finder = bytecode.PackageImports(["freshpkg"])
        finder.install()
        import freshpkg.mod, otherpkg
        print(type(freshpkg.mod.__spec__.loader).__name__, type(otherpkg.__spec__.loader).__name__)
        finder.uninstall()
        print(finder in sys.meta_path)
    """)
    cache = tmp_path / "bytecode"
    env = subprocess_env(AIOCOMPILE_BYTECODE_DIR=str(cache), PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join((str(package), env["PYTHONPATH"]))
    env.pop("PYTHONPYCACHEPREFIX", None)
    for flags in ((), ("--no-compile",)):
        done = subprocess.run([sys.executable, "-c", script, *flags], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["CachedSourceLoader", "SourceFileLoader", "False"]
    assert ours(cache, package / "freshpkg" / "mod.py").is_file()
    assert not ours(cache, package / "otherpkg" / "__init__.py").exists()


def test_a_benchmark_process_reads_aiocompiles_bytecode(package: Path, tmp_path: Path) -> None:
    """A benchmark process (max-autotune's timings, ``autotune()``) imports torch and
    Inductor as a worker does: through aiocompile's bytecode where there is none."""
    cache = tmp_path / "bytecode"
    env = subprocess_env(AIOCOMPILE_BYTECODE_DIR=str(cache), PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join((str(package), env["PYTHONPATH"]))
    env.pop("PYTHONPYCACHEPREFIX", None)
    script = ("from aiocompile._tuning import bench_main; bench_main.prepare_process(); import freshpkg.mod; "
              "print(type(freshpkg.mod.__spec__.loader).__name__)")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "CachedSourceLoader"
    assert ours(cache, package / "freshpkg" / "mod.py").is_file()


def test_the_loader_stands_aside_between_reading_bytecode_and_unmarshalling_it(
        package: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The read lets the interpreter lock go and the unmarshalling holds it for
    milliseconds, with no Python call between them: a call served meanwhile is looked for
    there (``aside.before_holding``), or it would wait for the whole unmarshalling."""
    from aiocompile._base import bytecode, pyc

    source = package / "freshpkg" / "mod.py"
    monkeypatch.setattr(pyc, "writes_beside", lambda python_own, dont_write: False)
    loader = bytecode.CachedSourceLoader("freshpkg.mod", str(source), str(tmp_path / "bytecode"))
    assert loader.get_code("freshpkg.mod") is not None  # compiled, and written to ours
    steps: list[str] = []
    real_open, real_marshal = open, bytecode.marshal

    class Reading:
        def __init__(self, path: str, mode: str) -> None:
            self.file = real_open(path, mode)

        def __enter__(self) -> Reading:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def read(self) -> bytes:
            steps.append("read")
            return self.file.read()

    def loads(data: object) -> object:
        steps.append("unmarshal")
        return real_marshal.loads(data)

    monkeypatch.setattr(bytecode, "open", Reading, raising=False)
    monkeypatch.setattr(bytecode, "marshal", type("Marshal", (), {"loads": staticmethod(loads),
                                                                   "dumps": staticmethod(real_marshal.dumps)}))
    monkeypatch.setattr(bytecode.aside, "before_holding", lambda: steps.append("stand aside if serving"))
    code = loader.get_code("freshpkg.mod")
    assert code is not None and "VALUE" in code.co_names
    assert steps == ["read", "stand aside if serving", "unmarshal"]
