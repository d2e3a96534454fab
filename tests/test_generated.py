"""Code that libraries generate as they are imported, compiled once for aiocompile's
processes (``_base/generated.py``): Jinja templates and ``exec`` of generated source
(dataclasses' methods, a module's own). What a fork server or worker compiles is written as
a pack, a later process's own threads read it instead of compiling, the program's own code
is compiled as without aiocompile, ``exec_`` is ``exec`` (flags, namespaces), and a pack
that cannot be read is compiled past."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import subprocess_env

# Makes code the way Inductor's modules do (a Jinja template, a dataclass, a module that
# execs generated source at its import), in aiocompile's processes ("everywhere"), in one of
# its threads of the serving process ("reading") or in the program's own ("program"); says
# how many sources were compiled rather than read, and what the code did.
SCRIPT = r"""
import dataclasses, json, os, sys, typing
from aiocompile._base import bytecode, generated

mode, folder = sys.argv[1], sys.argv[2]
if mode == "everywhere":
    bytecode.install_for_process()  # a fork server's imports
installed = generated.install(everywhere=(mode == "everywhere"))
bytecode.seed("made_at_import", exec=generated.exec_) if installed else None
sys.path.insert(0, folder)

compiled = []
jinja = generated._state["jinja"]
if jinja is not None:
    def counting(environment, source, filename):
        compiled.append("template")
        return jinja(environment, source, filename)
    generated._state["jinja"] = counting
real_compile = compile
def counting_compile(source, filename, mode_, flags=0, dont_inherit=False):
    compiled.append("exec")
    return real_compile(source, filename, mode_, flags, dont_inherit)
generated.compile = counting_compile  # what exec_ calls for a source it has no code of

def ours():
    import jinja2
    template = jinja2.Environment().from_string("def {{ name }}(x):\n    return x * {{ factor }}\n")
    text = template.render(name="scale", factor=3)

    @dataclasses.dataclass(frozen=True)
    class Shape:
        rows: int
        columns: typing.List[int] = dataclasses.field(default_factory=list)

    shape = Shape(3, [4])
    import made_at_import
    return {"template": text, "shape": repr(shape), "equal": shape == Shape(3, [4]),
            "annotations": {k: repr(v) for k, v in Shape.__init__.__annotations__.items()},
            "module": made_at_import.twice(21), "seeded": made_at_import.__dict__.get("exec") is generated.exec_}

if mode == "reading":
    from aiocompile._base import threads
    with threads.imports_yielding(), generated.reading():  # as the load's imports are made
        answer = ours()
else:
    answer = ours()
answer["installed"] = installed
import jinja2
answer["theirs"] = jinja2.Environment().from_string("{{ a }} and {{ b }}").render(a=1, b=2)
answer["compiled"] = len(compiled)
generated.flush()
print(json.dumps(answer))
"""

MODULE = """
exec("def twice(x):\\n    return 2 * x\\n")
"""


@pytest.fixture
def folder(tmp_path):
    where = tmp_path / "modules"
    where.mkdir()
    (where / "made_at_import.py").write_text(MODULE)
    return where


def _run(tmp_path, folder, mode: str, directory: str | None = None) -> dict:
    env = subprocess_env(AIOCOMPILE_BYTECODE_DIR=directory or str(tmp_path / "bytecode"), PYTHONDONTWRITEBYTECODE="1")
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(folder)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _packs(tmp_path) -> list:
    return sorted((tmp_path / "bytecode" / "generated").rglob("*.pack"))


# Compiled in each process: the template, the dataclass's methods (__init__, __repr__,
# __eq__, __hash__, __setattr__, __delattr__), the module's own source.
WHAT_OURS_COMPILES = 8


def _same(answer: dict) -> None:
    assert answer["template"] == "def scale(x):\n    return x * 3"
    assert answer["shape"].endswith("Shape(rows=3, columns=[4])") and answer["equal"] is True
    # dataclasses' generated code is compiled without this test's (or aiocompile's) future
    # flags, as exec would: its annotations are the types, not strings.
    assert answer["annotations"] == {"rows": "<class 'int'>", "columns": "typing.List[int]", "return": "None"}
    assert answer["module"] == 42
    assert answer["theirs"] == "1 and 2"


def test_code_compiled_by_a_worker_is_read_by_the_serving_process_and_the_programs_own_is_left_alone(tmp_path, folder):
    pytest.importorskip("jinja2")
    first = _run(tmp_path, folder, "everywhere")  # a fork server or worker: everything
    _same(first)
    assert first["installed"] is True and first["seeded"] is True
    assert first["compiled"] == WHAT_OURS_COMPILES + 1  # the program's template too, here
    assert len(_packs(tmp_path)) == 1

    # The serving process: aiocompile's own thread reads it all, compiling nothing; the
    # program's own template is compiled by Jinja, as without aiocompile.
    later = _run(tmp_path, folder, "reading")
    _same(later)
    assert later["compiled"] == 1
    assert len(_packs(tmp_path)) == 1  # nothing new: no pack written

    # Outside aiocompile's threads nothing goes through the cache, nor is written.
    (tmp_path / "bytecode").rename(tmp_path / "before")
    alone = _run(tmp_path, folder, "program")
    _same(alone)
    assert alone["seeded"] is False  # imported by the program, as Python imports it
    assert alone["compiled"] == WHAT_OURS_COMPILES and _packs(tmp_path) == []


def test_a_pack_that_cannot_be_read_is_compiled_past_and_the_code_kept_anew(tmp_path, folder):
    pytest.importorskip("jinja2")
    _run(tmp_path, folder, "everywhere")
    (damaged,) = _packs(tmp_path)
    damaged.write_bytes(b"not a pack")
    again = _run(tmp_path, folder, "reading")
    _same(again)
    assert again["compiled"] == WHAT_OURS_COMPILES + 1
    assert _run(tmp_path, folder, "reading")["compiled"] == 1  # read from the pack written anew


def test_packs_past_the_most_are_written_as_one(tmp_path, folder, monkeypatch):
    from aiocompile._base import generated

    monkeypatch.setenv("AIOCOMPILE_BYTECODE_DIR", str(tmp_path / "bytecode"))
    for n in range(generated.Packs.MAX_PACKS + 2):
        packs = generated.Packs(str(tmp_path / "bytecode" / "generated" / "x"))
        key = n.to_bytes(32, "little")
        assert packs.get(key, "<string>") is None
        packs.add(key, compile(f"value = {n}", "<string>", "exec"))
        packs.flush()
    left = list((tmp_path / "bytecode" / "generated" / "x").iterdir())
    assert 1 <= len(left) <= generated.Packs.MAX_PACKS
    reader = generated.Packs(str(tmp_path / "bytecode" / "generated" / "x"))
    for n in range(generated.Packs.MAX_PACKS + 2):
        space: dict = {}
        code = reader.get(n.to_bytes(32, "little"), "<string>")
        assert code is not None
        exec(code, space)
        assert space["value"] == n


def test_reading_a_pack_unmarshals_its_index_and_then_only_the_code_asked_for(tmp_path, monkeypatch):
    """A pack of many codes is read without one long C call: its index is unmarshalled, and
    each code from its own slice when asked for (a whole pack unmarshalled at once held the
    interpreter lock 4.5 ms for 2.5 MB)."""
    from aiocompile._base import generated

    folder = str(tmp_path / "bytecode" / "generated" / "x")
    writer = generated.Packs(folder)
    sources = {n.to_bytes(32, "little"): f"value = {n}\n" + "def f():\n    return 1\n" * 40 for n in range(300)}
    for key, source in sources.items():
        writer.add(key, compile(source, "<string>", "exec"))
    writer.flush()
    (pack,) = (tmp_path / "bytecode" / "generated" / "x").iterdir()
    data = pack.read_bytes()
    assert data.startswith(generated.Packs.PACK_MAGIC)

    sizes: list[int] = []

    class Counted:
        @staticmethod
        def loads(buffer):  # type: ignore[no-untyped-def]
            sizes.append(len(buffer))
            return __import__("marshal").loads(buffer)

        dumps = staticmethod(__import__("marshal").dumps)

    monkeypatch.setattr(generated, "marshal", Counted)
    reader = generated.Packs(folder)
    key = (123).to_bytes(32, "little")
    space: dict = {}
    exec(reader.get(key, "<string>"), space)
    assert space["value"] == 123
    index = int.from_bytes(data[len(generated.Packs.PACK_MAGIC):len(generated.Packs.PACK_MAGIC) + 4], "little")
    assert sizes[0] == index and len(sizes) == 2  # the index, then the one code
    assert max(sizes) < len(data) / 20
    assert reader.get((300).to_bytes(32, "little"), "<string>") is None  # no such key

    # Entries that are no (offset, length), or lie outside the codes, are read past.
    monkeypatch.setattr(generated, "marshal", __import__("marshal"))
    bad = generated.Packs._pack({b"k" * 32: b"x" * 4})
    for where in ("no pair", (10**6, 5)):
        head = __import__("marshal").dumps({b"k" * 32: where})
        damaged = b"".join([generated.Packs.PACK_MAGIC, len(head).to_bytes(4, "little"), head, bad[-4:]])
        (tmp_path / "bytecode" / "generated" / "x" / "damaged.pack").write_bytes(damaged)
        assert generated.Packs(folder).get(b"k" * 32, "<string>") is None


def test_no_bytecode_directory_means_no_cache(tmp_path, folder):
    pytest.importorskip("jinja2")
    answer = _run(tmp_path, folder, "everywhere", directory="off")
    _same(answer)
    assert answer["installed"] is False and answer["seeded"] is False
    assert answer["compiled"] == 0  # nothing went through aiocompile's hooks
    assert not (tmp_path / "bytecode").exists()


VALUE = 7


def test_exec_is_execs_own_behaviour(tmp_path, monkeypatch):
    """``exec_`` compiled or read is ``exec``: the caller's namespaces when none are given,
    the caller's ``__future__`` flags (this module has ``annotations``), a code object as
    it is, the closure option; in a cached thread and out of one."""
    from aiocompile._base import generated

    monkeypatch.setenv("AIOCOMPILE_BYTECODE_DIR", str(tmp_path / "bytecode"))
    monkeypatch.setattr(generated, "_PACKS", {})
    for cached in (False, True, True):
        with generated.reading() if cached else _nothing():
            here = {}
            generated.exec_("def f(x: int) -> str:\n    return str(x + VALUE)\n", None, here)
            assert here["f"](1) == "8" and here["f"].__annotations__ == {"x": "int", "return": "str"}

            space = {"n": 2}
            generated.exec_("m = n * 3", space)
            assert space["m"] == 6 and "__builtins__" in space

            space["VALUE"] = 10
            generated.exec_(compile("k = VALUE + 1", "<string>", "exec"), space)
            assert space["k"] == 11
            seen: list = []
            generated.exec_("seen.append(VALUE)")  # the caller's namespaces: its locals, this module's globals
            assert seen == [7]

            def outer():
                value = 5

                def uses():
                    sink.append(value)  # noqa: F821 - the globals given below hold it
                return uses

            out: list = []
            generated.exec_(outer().__code__, {"sink": out}, closure=outer().__closure__)
            assert out == [5]
            with pytest.raises(ZeroDivisionError):
                generated.exec_("1 / 0", {})
            with pytest.raises(SyntaxError):
                generated.exec_("def (", {})


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


TORCH_SCRIPT = r"""
import json, sys
import torch
from aiocompile._base import bytecode, generated, threads

mode = sys.argv[1]
if mode == "everywhere":
    bytecode.install_for_process()
generated.install(everywhere=(mode == "everywhere"))
compiled = []
real_compile = compile
def counting_compile(source, *args):
    compiled.append(len(source))
    return real_compile(source, *args)
generated.compile = counting_compile
with threads.imports_yielding(), generated.reading():
    import torch._inductor.lowering
    import torch._inductor.ops_handler as ops_handler
generated.flush()
print(json.dumps({"compiled": len(compiled), "largest": max(compiled, default=0),
                  "seeded": ops_handler.__dict__.get("exec") is generated.exec_,
                  "works": torch._inductor.ops_handler.DefaultHandler.add.__name__}))
"""


def test_inductors_generated_code_is_read_by_the_serving_process(tmp_path):
    """Inductor's own: its operators' handlers (one source of every operator's method,
    made at ``ops_handler``'s import) and its dataclasses, compiled by a worker's imports,
    are read by the serving process's load imports."""
    pytest.importorskip("torch._inductor")
    env = subprocess_env(AIOCOMPILE_BYTECODE_DIR=str(tmp_path / "bytecode"))

    def run(mode: str) -> dict:
        done = subprocess.run([sys.executable, "-c", TORCH_SCRIPT, mode], capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    worker = run("everywhere")
    assert worker["seeded"] is True and worker["works"] == "add"
    assert worker["compiled"] > 500 and worker["largest"] > 10_000  # dataclasses' methods; the handlers' source
    serving = run("reading")
    assert serving["seeded"] is True and serving["works"] == "add"
    assert serving["compiled"] == 0


def test_a_large_source_no_pack_holds_runs_in_pieces_in_the_serving_process_as_whole(tmp_path, monkeypatch):
    """The serving process's thread compiles a large generated source of definitions one
    definition at a time: the same functions, the same line numbers, the statements between
    them run in order; a source that does not split so (a definition inside a string, a
    decorated one, a ``__future__`` import) is compiled whole."""
    import traceback

    from aiocompile._base import generated

    monkeypatch.setenv("AIOCOMPILE_BYTECODE_DIR", str(tmp_path / "bytecode"))
    monkeypatch.setattr(generated, "_PACKS", {})
    names = [f"op{n}" for n in range(300)]
    source = "order = []\n" + "".join(
        f"def {name}(self, a, b):\n    order.append({name!r})\n    return self._default({name!r}, (a, b), {{}})\n\n"
        for name in names) + "def fails():\n    raise ValueError('here')\n"
    assert len(source) > generated.PIECES_FROM
    assert generated._pieces(source, 0) is not None and len(generated._pieces(source, 0)) == len(names) + 2

    class Handler:
        def _default(self, name, args, kwargs):
            return name, args

    with generated.reading():
        space: dict = {}
        generated.exec_(source, space)
    assert space["op7"](Handler(), 1, 2) == ("op7", (1, 2)) and space["order"] == ["op7"]
    with pytest.raises(ValueError) as raised:
        space["fails"]()
    whole: dict = {}
    exec(source, whole)
    with pytest.raises(ValueError) as as_whole:
        whole["fails"]()
    assert traceback.extract_tb(raised.tb)[-1].lineno == traceback.extract_tb(as_whole.tb)[-1].lineno == 1203

    tricky = [
        'text = """\ndef not_a_definition():\n    pass\n"""\n' + source,  # a split inside a string
        "import functools\n@functools.lru_cache\n" + source.split("\n", 1)[1] + "order = []\n",  # a decorated one
        "from __future__ import annotations\n" + source,
    ]
    for text in tricky:
        assert generated._pieces(text, 0) is None
        with generated.reading():
            space = {}
            generated.exec_(text, space)
        assert space["op7"](Handler(), 1, 2) == ("op7", (1, 2))


def test_each_piece_offers_to_stand_aside_for_a_call_being_served(monkeypatch):
    """Compiling pieces is a loop of C calls, with no Python call at which an attached
    thread learns that a call is being served: before each piece it asks
    (``aside.before_holding``)."""
    from aiocompile._base import aside, generated

    asked = []
    monkeypatch.setattr(aside, "before_holding", lambda: asked.append(1))
    source = "".join(f"def op{n}(self, a):\n    return self._default('op{n}', (a,), {{}})\n\n" for n in range(100))
    assert len(source) > generated.PIECES_FROM
    pieces = generated._pieces(source, 0)
    assert pieces is not None and len(asked) == len(pieces) == 100
