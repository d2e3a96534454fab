"""Jinja templates' code compiled once for aiocompile's processes (``_base/templates.py``):
what a fork server or worker compiles is written, a later process's own threads read it
instead of compiling, the program's own templates are left to Jinja, and a file that is
not a template's code is compiled again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import subprocess_env

pytest.importorskip("jinja2")

# Compiles (or reads) a template the way Inductor's modules make theirs, and says how many
# times Jinja's own compile ran, and what the templates rendered.
SCRIPT = """
import json, sys
import jinja2
from aiocompile._base import templates

mode = sys.argv[1]
installed = templates.install(everywhere=(mode == "everywhere"))
original = templates._state["original"]
compiled = []
if original is not None:
    def counting(environment, source, filename):
        compiled.append(filename)
        return original(environment, source, filename)
    templates._state["original"] = counting

def kernel():
    env = jinja2.Environment()
    return env.from_string("def {{ name }}(x):\\n    return x * {{ factor }}\\n").render(name="scale", factor=3)

if mode == "reading":
    with templates.reading():
        ours = kernel()
else:
    ours = kernel()
theirs = jinja2.Environment().from_string("{{ a }} and {{ b }}").render(a=1, b=2)
print(json.dumps({"installed": installed, "ours": ours, "theirs": theirs, "compiled": len(compiled)}))
"""


def _run(tmp_path, mode: str, directory: str | None = None) -> dict:
    env = subprocess_env(AIOCOMPILE_BYTECODE_DIR=directory or str(tmp_path / "bytecode"))
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _written(tmp_path) -> list:
    return sorted((tmp_path / "bytecode" / "templates").rglob("*.code"))


def test_a_template_compiled_by_a_worker_is_read_by_the_serving_process_and_the_programs_own_are_left_alone(tmp_path):
    first = _run(tmp_path, "everywhere")  # a fork server or worker: every template
    assert first["installed"] is True and first["compiled"] == 2
    assert first["ours"] == "def scale(x):\n    return x * 3" and first["theirs"] == "1 and 2"
    assert len(_written(tmp_path)) == 2

    # The serving process: aiocompile's own thread reads it, compiling nothing; the
    # program's own template is compiled by Jinja, as without aiocompile.
    later = _run(tmp_path, "reading")
    assert (later["ours"], later["theirs"]) == (first["ours"], first["theirs"])
    assert later["compiled"] == 1

    # Outside aiocompile's threads nothing goes through the cache, nor is written.
    (tmp_path / "bytecode").rename(tmp_path / "before")
    alone = _run(tmp_path, "program")
    assert alone["compiled"] == 2 and _written(tmp_path) == []


def test_a_file_that_is_not_a_templates_code_is_compiled_again_and_rewritten(tmp_path):
    _run(tmp_path, "everywhere")
    files = _written(tmp_path)
    for path in files:
        path.write_bytes(b"not marshalled code")
    again = _run(tmp_path, "reading")
    assert again["ours"] == "def scale(x):\n    return x * 3"
    assert again["compiled"] == 2  # both compiled: ours again, theirs as always
    # Ours rewritten; the program's own template never went through the cache here.
    assert sum(path.read_bytes() == b"not marshalled code" for path in files) == 1
    assert _run(tmp_path, "reading")["compiled"] == 1  # read again


def test_no_bytecode_directory_means_no_cache(tmp_path):
    answer = _run(tmp_path, "everywhere", directory="off")
    assert answer["installed"] is False and answer["compiled"] == 0
    assert answer["ours"] == "def scale(x):\n    return x * 3"
