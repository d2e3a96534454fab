"""The Python modules of a compiled graph, compiled in the worker: the serving process's
load runs their code instead of compiling their source, under Inductor's own loader."""

from __future__ import annotations

import marshal
import textwrap

import pytest

torch = pytest.importorskip("torch")

from torch._inductor import codecache  # noqa: E402

from aiocompile._torch import graph_code  # noqa: E402

SOURCE = textwrap.dedent('''
    WHERE = "module"

    def call():
        return WHERE + " called"
''')


@pytest.fixture
def spied(monkeypatch):
    """Inductor's loader, its loads noted (the paths it compiled)."""
    compiled: list[str] = []
    real = codecache._reload_python_module

    def spy(key, path, *args, **kwargs):
        compiled.append(path)
        return real(key, path, *args, **kwargs)

    monkeypatch.setattr(codecache, "_reload_python_module", spy)
    return compiled, spy


def _worker_codes(tmp_path, source: str) -> dict[bytes, bytes]:
    """What a worker's ``collect`` gives for ``source``, loaded there from another path
    (Inductor's, under ``tmp_path``: this process has not loaded it before)."""
    before = graph_code.mark()
    key, path = codecache.write(source, "py", extra=str(tmp_path))
    codecache.PyCodeCache.load_by_key_path(key, path)
    codes = graph_code.collect(before)
    assert len(codes) == 1
    return codes


def test_a_module_whose_code_came_is_run_from_it_and_named_for_its_path_here(tmp_path, spied):
    compiled, spy = spied
    codes = _worker_codes(tmp_path, SOURCE)
    compiled.clear()
    (code,) = codes.values()
    assert marshal.loads(code).co_filename != str(tmp_path / "here.py")
    here = tmp_path / "here.py"
    here.write_text(SOURCE)
    other = tmp_path / "other.py"
    other.write_text("WHERE = 'compiled here'\n")
    with graph_code.used(codes):
        assert codecache._reload_python_module is not spy
        module = codecache.PyCodeCache.load_by_key_path("here", str(here))
        unknown = codecache.PyCodeCache.load_by_key_path("other", str(other))
    # Given back as it was.
    assert codecache._reload_python_module is spy
    assert module.call() == "module called" and module.__file__ == str(here) and module.key == "here"
    # Its functions' file is the path here (a traceback shows the module's source).
    assert module.call.__code__.co_filename == str(here)
    # A source without code is compiled by Inductor's own loader, as before.
    assert compiled == [str(other)] and unknown.WHERE == "compiled here"


def test_a_source_changed_since_is_compiled_not_run_from_stale_code(tmp_path, spied):
    compiled, _ = spied
    codes = _worker_codes(tmp_path, SOURCE)
    compiled.clear()
    changed = tmp_path / "changed.py"
    changed.write_text(SOURCE.replace('"module"', '"changed"'))
    with graph_code.used(codes):
        module = codecache.PyCodeCache.load_by_key_path("changed", str(changed))
    assert module.call() == "changed called" and compiled == [str(changed)]


def test_loads_that_overlap_share_the_loader_and_the_last_gives_it_back(tmp_path, spied):
    _, spy = spied
    first = _worker_codes(tmp_path, SOURCE)
    second = _worker_codes(tmp_path, "VALUE = 2\n")
    outer = graph_code.used(first)
    outer.__enter__()
    with graph_code.used(second):
        installed = codecache._reload_python_module
    # The first load is still under way: the loader stays, with its codes.
    assert installed is not spy and codecache._reload_python_module == installed
    here = tmp_path / "here.py"
    here.write_text(SOURCE)
    assert codecache.PyCodeCache.load_by_key_path("here", str(here)).call() == "module called"
    outer.__exit__(None, None, None)
    assert codecache._reload_python_module is spy
    # No codes: Inductor's loader is not touched.
    with graph_code.used({}):
        assert codecache._reload_python_module is spy
