"""The `aiocompile build` command, run as a user runs it."""

import importlib.metadata
import json
import logging
import os
import re
import stat
import subprocess
import sys

import pytest
from conftest import ROOT, subprocess_env
from native_sources import have

import aiocompile


def _aiocompile(*args, cwd=ROOT, umask=-1, **env):
    return subprocess.run([sys.executable, "-m", "aiocompile", *args], capture_output=True, text=True, cwd=cwd,
                          env=subprocess_env(**env), timeout=600, umask=umask)


def test_build_the_example_set_for_two_targets(tmp_path):
    out = tmp_path / "kernels"
    proc = _aiocompile("build", "examples/kernels.py", "--target", "cuda:80", "-t", "hip:gfx942", "--out", str(out),
                       "--no-progress", "-j", "2")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["targets"] == ["cuda:80", "hip:gfx942"]
    entries = manifest["kernels"]
    assert len(entries) == 22 and not manifest["failures"]
    assert {e["label"] for e in entries} >= {"add_fp32", "softmax_1024", "matmul_fp16_128x128x64", "layer_norm_4096"}
    for entry in entries:
        kernel = aiocompile.TritonKernel.from_bytes((out / entry["file"]).read_bytes())
        assert kernel.key == entry["key"] and kernel.target == entry["target"]
        assert (out / entry["binary"]).read_bytes() == kernel.binary
    stats = manifest["statistics"]
    assert stats["compiled"] == 22 and stats["failed"] == 0 and stats["workers_started"] == 2
    # The summary a person reads: one row per kernel and target, then the totals.
    assert "matmul_fp16_128x128x64" in proc.stdout and "hip:gfx942" in proc.stdout
    assert "22 built, 0 failed" in proc.stdout

    # Building again compiles nothing: everything comes from the directory.
    again = _aiocompile("build", "examples/kernels.py", "--target", "cuda:80", "-t", "hip:gfx942", "--out", str(out),
                        "--no-progress", "-j", "2")
    assert again.returncode == 0, again.stderr
    assert "22 built (22 of them from the cache)" in again.stdout
    stats = json.loads((out / "manifest.json").read_text())["statistics"]
    assert (stats["compiled"], stats["disk_hits"], stats["workers_started"]) == (0, 22, 0)


SERVER = """
import asyncio, importlib.util, json, sys
import aiocompile

# The kernels as a server imports them: its own way, under its own module name.
spec = importlib.util.spec_from_file_location("server_side_kernels", sys.argv[2])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)

async def main():
    async with aiocompile.Scheduler(workers=2, cache_dir=sys.argv[1]) as sched:
        kernels = await sched.compile_many(
            [dict(entry, target="cuda:80") for entry in module.KERNELS], return_exceptions=False)
        print(json.dumps({"n": len(kernels), **sched.statistics().to_dict()}))

asyncio.run(main())
"""


def test_a_server_started_on_a_prebuilt_directory_compiles_nothing(tmp_path):
    out = tmp_path / "prebuilt"
    proc = _aiocompile("build", "examples/kernels.py", "-t", "cuda:80", "--out", str(out), "--no-progress", "-j", "2")
    assert proc.returncode == 0, proc.stderr
    server = subprocess.run([sys.executable, "-c", SERVER, str(out), str(ROOT / "examples" / "kernels.py")],
                            capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert server.returncode == 0, server.stderr
    stats = json.loads(server.stdout.strip().splitlines()[-1])
    assert stats["n"] == 11
    assert (stats["disk_hits"], stats["compiled"], stats["workers_started"]) == (11, 0, 0)


def test_a_kernel_that_fails_is_reported_and_the_rest_are_built(tmp_path):
    kernel_set = tmp_path / "broken_set.py"
    kernel_set.write_text(
        "import triton\nimport triton.language as tl\n\n"
        "@triton.jit\ndef good(x_ptr):\n    tl.store(x_ptr, 1.0)\n\n"
        "@triton.jit\ndef bad(x_ptr):\n    tl.store(x_ptr, undefined_name)\n\n"
        "KERNELS = [\n"
        "    {'label': 'good', 'kernel': good, 'signature': {'x_ptr': '*fp32'}},\n"
        "    {'label': 'bad', 'kernel': bad, 'signature': {'x_ptr': '*fp32'}},\n"
        "]\n"
    )
    out = tmp_path / "out"
    proc = _aiocompile("build", str(kernel_set), "-t", "cuda:90", "--out", str(out), "--no-progress", "-j", "1")
    assert proc.returncode == 1
    assert "FAILED" in proc.stdout and "undefined_name" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["label"] for e in manifest["kernels"]] == ["good"]
    assert manifest["failures"][0]["label"] == "bad"


def test_bad_arguments_are_refused_with_status_2(tmp_path):
    # 2 as argparse gives for a bad command line; 1 is kept for kernels that failed.
    proc = _aiocompile("build", "examples/kernels.py", "-t", "cuda:9x", "--out", str(tmp_path))
    assert proc.returncode == 2 and "cuda:9x" in proc.stderr
    proc = _aiocompile("build", str(tmp_path / "missing.py"), "-t", "cuda:90")
    assert proc.returncode == 2 and "no such file" in proc.stderr
    (tmp_path / "empty.py").write_text("X = 1\n")
    proc = _aiocompile("build", str(tmp_path / "empty.py"), "-t", "cuda:90")
    assert proc.returncode == 2 and "must define KERNELS" in proc.stderr
    for option, value in (("-j", "0"), ("--timeout", "-1"), ("--timeout", "soon"), ("--timeout", "inf")):
        proc = _aiocompile("build", "examples/kernels.py", "-t", "cuda:90", option, value)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and value in proc.stderr


def test_an_architecture_triton_does_not_know_is_refused_before_any_worker(tmp_path):
    for target, known in (("cuda:99", "cuda:90"), ("hip:gfx9999", "hip:gfx942")):
        out = tmp_path / target.replace(":", "-")
        proc = _aiocompile("build", "examples/kernels.py", "-t", f"cuda:80,{target}", "--out", str(out))
        assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
        assert proc.stderr.startswith(f"aiocompile: unknown {'CUDA' if known.startswith('cuda') else 'AMD'} "
                                      f"architecture in target {target}: this Triton")
        assert f"{known}," in proc.stderr and "Traceback" not in proc.stderr
        assert not out.exists()  # no scheduler, no worker: nothing was started


def test_a_kernel_set_entry_without_what_it_needs_is_a_message_not_a_traceback(tmp_path):
    kernel_set = tmp_path / "no_signature.py"
    kernel_set.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                          "from triton_kernels import add_kernel\n"
                          "KERNELS = [{'label': 'add_64', 'kernel': add_kernel, 'constexprs': {'BLOCK': 64}}]\n")
    proc = _aiocompile("build", str(kernel_set), "-t", "cuda:80", "--out", str(tmp_path / "out"), "--no-progress")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"aiocompile: {kernel_set}: KERNELS[0] (add_64) has no 'signature'\n"


@pytest.mark.parametrize("entry, says", [
    ("{'label': 'five', 'kernel': 5, 'signature': {}}", "'kernel' must be a @triton.jit function, got int"),
    ("{'label': 'sig', 'kernel': add_kernel, 'signature': '*fp32'}", "'signature' must be a dict, got str"),
    ("{'label': 'src', 'kind': 'cpp', 'source': b'int x;'}", "'source' must be the source text (a str), got bytes"),
])
def test_a_kernel_set_entry_of_the_wrong_type_is_a_message_and_status_2(tmp_path, entry, says):
    kernel_set = tmp_path / "wrong_types.py"
    kernel_set.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                          f"from triton_kernels import add_kernel\nKERNELS = [{entry}]\n")
    out = tmp_path / "out"
    proc = _aiocompile("build", str(kernel_set), "-t", "cuda:80", "--out", str(out), "--no-progress")
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr.startswith(f"aiocompile: {kernel_set}: KERNELS[0] (") and says in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_what_the_command_cannot_use_is_a_line_and_status_2_not_a_traceback(tmp_path):
    broken = tmp_path / "broken_set.py"
    broken.write_text("import os\n\nraise RuntimeError('no such model')\n")
    escaping = tmp_path / "escaping_set.py"
    escaping.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                        "from triton_kernels import ADD_SIGNATURE, add_kernel\n"
                        "KERNELS = [{'label': '../../escaped', 'kernel': add_kernel, 'signature': ADD_SIGNATURE,\n"
                        "            'constexprs': {'BLOCK': 64}}]\n")
    out = tmp_path / "out"
    cases = [
        (("build", str(broken), "-t", "cuda:80"), {},
         f"aiocompile: cannot load {broken}: RuntimeError: no such model ({broken}, line 3)\n"),
        (("build", str(escaping), "-t", "cuda:80"), {},
         f"aiocompile: {escaping}: KERNELS[0] (../../escaped) has the label '../../escaped': a label names a file, "
         "so it is a non-empty string without '/'\n"),
        (("build", "examples/kernels.py", "-t", "cuda:80"), {"AIOCOMPILE_WORKERS": "many"},
         "aiocompile: AIOCOMPILE_WORKERS must be an integer >= 1, got 'many'\n"),
        (("build", "examples/kernels.py", "-t", "cuda:80", "--events", str(broken / "events.jsonl")), {},
         f"aiocompile: cannot write the event log {broken / 'events.jsonl'}: "),
    ]
    for args, env, said in cases:
        proc = _aiocompile(*args, "--out", str(out), "--no-progress", **env)
        assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
        assert proc.stderr.splitlines(keepends=True)[-1].startswith(said), proc.stderr
        assert "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("*.cubin")), "nothing was built, nowhere"


PTXAS_STAND_IN = """#!/bin/sh
# ptxas for the tests: kills the worker that runs it for a kernel named crashy, hangs for
# one named sleepy, and is the real one otherwise (and when asked its version or help).
for arg in "$@"; do case "$arg" in *.ptx) ptx="$arg";; esac; done
if [ -n "$ptx" ] && grep -q "entry crashy" "$ptx"; then kill -9 $PPID; sleep 60; fi
if [ -n "$ptx" ] && grep -q "entry sleepy" "$ptx"; then sleep 60; fi
exec {real} "$@"
"""

FAILING_SET = """
import triton
import triton.language as tl


@triton.jit
def crashy(x_ptr):
    tl.store(x_ptr, 1.0)


@triton.jit
def sleepy(x_ptr):
    tl.store(x_ptr, 2.0)


@triton.jit
def fine(x_ptr):
    tl.store(x_ptr, 3.0)


KERNELS = [
    {"label": "crashes", "kernel": crashy, "signature": {"x_ptr": "*fp32"}},
    {"label": "hangs", "kernel": sleepy, "signature": {"x_ptr": "*fp32"}, "timeout": 3},
    {"label": "bad_ptxas_option", "kernel": fine, "signature": {"x_ptr": "*fp32"}, "ptx_options": "--no-such-flag"},
    {"label": "fine", "kernel": fine, "signature": {"x_ptr": "*fp32"}},
]
"""


def test_the_table_names_each_failure_as_it_happened(tmp_path):
    from triton import knobs

    ptxas = tmp_path / "ptxas"
    ptxas.write_text(PTXAS_STAND_IN.format(real=knobs.nvidia.ptxas.path))
    ptxas.chmod(0o755)
    kernel_set = tmp_path / "failing_set.py"
    kernel_set.write_text(FAILING_SET)
    proc = _aiocompile("build", str(kernel_set), "-t", "cuda:80", "--out", str(tmp_path / "out"), "--no-progress",
                       "-j", "2", TRITON_PTXAS_PATH=str(ptxas), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    assert proc.returncode == 1, proc.stderr
    rows = {line.split()[0]: " ".join(line.split()[2:]) for line in proc.stdout.splitlines()[2:6]}
    assert rows["crashes"] == "FAILED WorkerCrashed: killed its worker 2 times, last with signal SIGKILL"
    assert rows["hangs"] == "FAILED JobTimeout: did not finish within 3 s; its worker was killed"
    # ptxas's own verdict, not the exception that carried it or the command that ran.
    assert rows["bad_ptxas_option"] == "FAILED CompileError: ptxas fatal : Unknown option '-no-such-flag'"
    assert not rows["fine"].startswith("FAILED")
    # Each failure's whole message on stderr, once; no worker's comings and goings.
    assert proc.stderr.count("aiocompile: crashed: crashy for cuda:80: WorkerCrashed") == 1
    assert proc.stderr.count("aiocompile: timeout: sleepy for cuda:80: JobTimeout") == 1
    assert "aiocompile: error: fine for cuda:80: CompileError" in proc.stderr and "ptxas fatal" in proc.stderr
    assert "exited (crashed" not in proc.stderr and "Traceback" not in proc.stderr


def _clean_env(tmp_path, **extra):
    """The environment of a user's shell: no variable the test session sets for itself."""
    return {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
            "TRITON_CACHE_DIR": str(tmp_path / "triton"), "XDG_CACHE_HOME": str(tmp_path / "cache"), **extra}


def test_tritons_notice_about_fp_fusion_is_one_line_and_the_key_stays_the_variables(tmp_path):
    kernel_set = tmp_path / "one.py"
    kernel_set.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                          "from triton_kernels import ADD_SIGNATURE, add_kernel\n"
                          "KERNELS = [{'label': 'add_64', 'kernel': add_kernel, 'signature': ADD_SIGNATURE,\n"
                          "            'constexprs': {'BLOCK': 64}}]\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "aiocompile", "build", str(kernel_set), "-t", "cuda:80", "--out",
                           str(out), "-j", "1"], capture_output=True, text=True, cwd=ROOT, env=_clean_env(tmp_path),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "aiocompile: building 1 kernel for 1 target (cuda:80) with 1 worker"
    assert lines[1].startswith("aiocompile: UserWarning from triton: TRITON_DEFAULT_FP_FUSION is unset")
    assert len(lines) == 2, proc.stderr  # Triton's source line and file name stay out of it
    # The build leaves the variable unset, as a server that reads the directory has it:
    # it is part of every kernel's key.
    entry = json.loads((out / "manifest.json").read_text())["kernels"][0]
    code = ("import asyncio, sys, aiocompile\n"
            f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
            "from triton_kernels import ADD_SIGNATURE, add_kernel\n"
            "async def main():\n"
            f"    async with aiocompile.Scheduler(workers=1, cache_dir={str(out)!r}) as s:\n"
            "        k = await s.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={'BLOCK': 64},\n"
            "                                   target='cuda:80')\n"
            "        print(k.key, s.statistics().disk_hits)\n"
            "asyncio.run(main())\n")
    served = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            env=_clean_env(tmp_path), timeout=300)
    assert served.stdout.split() == [entry["key"], "1"], served.stderr


TWO_KERNELS = (
    "import sys\n"
    "sys.path.insert(0, {tests!r})\n"
    "from triton_kernels import ADD_SIGNATURE, add_kernel\n\n"
    "KERNELS = [\n"
    "    {{'label': 'add_64', 'kernel': add_kernel, 'signature': ADD_SIGNATURE, 'constexprs': {{'BLOCK': 64}}}},\n"
    "    {{'label': 'add_128', 'kernel': add_kernel, 'signature': ADD_SIGNATURE, 'constexprs': {{'BLOCK': 128}}}},\n"
    "]\n"
)


def test_a_directory_built_by_another_triton_is_said_once_in_the_build_the_log_and_the_report(tmp_path, caplog):
    here = importlib.metadata.version("triton")
    out = tmp_path / "kernels"
    out.mkdir(mode=0o700)
    # As `aiocompile build` left it under the Triton installed before this one.
    (out / "manifest.json").write_text(json.dumps({"kernels": [
        {"label": "add_64", "kind": "triton", "target": "cuda:80", "triton": "3.8.0"},
        {"label": "add_cpp", "kind": "cpp", "target": "x86_64-linux-gnu"}]}))
    said = (f"the cache directory {out} was built by Triton 3.8.0 (its manifest.json says so), and this is Triton "
            f"{here}: a Triton kernel's key holds its Triton version, so none of its Triton kernels is found")
    kernel_set = tmp_path / "two_kernels.py"
    kernel_set.write_text(TWO_KERNELS.format(tests=str(ROOT / "tests")))
    events = tmp_path / "events.jsonl"
    proc = _aiocompile("build", str(kernel_set), "-t", "cuda:80", "--out", str(out), "--no-progress", "-j", "1",
                       "--events", str(events))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(f"aiocompile: {said}") == 1 and proc.stderr.count("was built by") == 1
    report = _aiocompile("report", str(events))
    assert report.stdout.count(f"warnings:\n  {said}") == 1, report.stdout
    # The build wrote this Triton's manifest: nothing left to say.
    caplog.set_level(logging.WARNING, logger="aiocompile")
    aiocompile.Scheduler(workers=1, cache_dir=out).close()
    assert not [r for r in caplog.records if "was built by" in r.getMessage()]
    # Another Triton's, and a server that opens the directory: once, in its log.
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["kernels"]:
        entry["triton"] = "3.8.0"
    (out / "manifest.json").write_text(json.dumps(manifest))
    aiocompile.Scheduler(workers=1, cache_dir=out).close()
    warned = [r for r in caplog.records if "was built by" in r.getMessage()]
    assert [(r.levelno, r.getMessage().split(": a Triton")[0]) for r in warned] == \
        [(logging.WARNING, said.split(": a Triton")[0])]


def test_a_build_with_a_key_writes_signed_files_private_to_its_user(tmp_path):
    from aiocompile._cache.sealed import unseal

    kernel_set = tmp_path / "two_kernels.py"
    kernel_set.write_text(TWO_KERNELS.format(tests=str(ROOT / "tests")))
    out = tmp_path / "kernels"
    proc = _aiocompile("build", str(kernel_set), "-t", "cuda:80", "--out", str(out), "--no-progress", "-j", "1",
                       umask=0, AIOCOMPILE_CACHE_KEY="the fleet's key")
    assert proc.returncode == 0, proc.stderr
    for path in [out, *out.rglob("*")]:
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    manifest = json.loads((out / "manifest.json").read_text())
    for kernel in manifest["kernels"]:
        signed = (out / kernel["file"]).read_bytes()
        data = unseal(signed, b"the fleet's key", kernel["key"])
        assert aiocompile.TritonKernel.from_bytes(data).key == kernel["key"]
    # A build again with the key reads them all; one with another key trusts none of them.
    again = _aiocompile("build", str(kernel_set), "-t", "cuda:80", "--out", str(out), "--no-progress", "-j", "1",
                        AIOCOMPILE_CACHE_KEY="the fleet's key")
    assert "2 built (2 of them from the cache)" in again.stdout, again.stderr
    other = _aiocompile("build", str(kernel_set), "-t", "cuda:80", "--out", str(out), "--no-progress", "-j", "1",
                        AIOCOMPILE_CACHE_KEY="another key")
    stats = json.loads((out / "manifest.json").read_text())["statistics"]
    assert other.returncode == 0 and (stats["disk_refused"], stats["compiled"]) == (2, 2)


def test_a_build_into_a_directory_others_can_write_stops_before_compiling(tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    os.chmod(out, 0o777)
    proc = _aiocompile("build", "examples/kernels.py", "-t", "cuda:80", "--out", str(out), "--no-progress")
    assert proc.returncode == 2 and "cannot build into" in proc.stderr and "refusing" in proc.stderr
    assert list(out.iterdir()) == []


# -- decisions ---------------------------------------------------------------------------------


def _decision(key_char, kernel="matmul_kernel"):
    from aiocompile._tuning.decisions import Decision

    return Decision(key=key_char * 64, kernel=kernel, tuning_key="(4096, 4096, 4096)", device_name="NVIDIA H100",
                    triton_version="3.6.0", config='{"kwargs": [["BLOCK", 128]], "pre_hook": null}',
                    label="BLOCK=128, num_warps=4", timings=(("BLOCK=128, num_warps=4", 0.2, None),
                                                             ("BLOCK=64, num_warps=4", None, "out of resource")),
                    tuned_at=1_700_000_000.0)


def test_decisions_travel_by_export_and_import(tmp_path):
    from aiocompile._tuning.decisions import read_all, write_all

    source, target = tmp_path / "gpu-host", tmp_path / "fleet"
    made = [_decision("a"), _decision("b", "l2norm_fwd_kernel")]
    write_all(source, made)
    listed = _aiocompile("decisions", "list", str(source))
    assert listed.returncode == 0, listed.stderr
    assert "matmul_kernel" in listed.stdout and "on NVIDIA H100" in listed.stdout and "BLOCK=128" in listed.stdout
    assert "2 decision(s)" in listed.stdout

    exported = tmp_path / "decisions.json"
    proc = _aiocompile("decisions", "export", str(source), "-o", str(exported))
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(exported.stat().st_mode) == 0o600
    proc = _aiocompile("decisions", "import", str(target), str(exported))
    assert proc.returncode == 0, proc.stderr
    assert sorted(read_all(target)[0], key=lambda d: d.key) == made

    # Signed where a key is set: read with the key, refused without it.
    signed = tmp_path / "signed"
    assert _aiocompile("decisions", "import", str(signed), str(exported), AIOCOMPILE_CACHE_KEY="k").returncode == 0
    assert len(read_all(signed, "k")[0]) == 2 and read_all(signed, "other")[0] == []


def test_build_carries_decisions_into_its_directory(tmp_path):
    from aiocompile._tuning.decisions import export_text, read_all

    kernels = tmp_path / "one_kernel.py"
    tests = str(ROOT / "tests")
    kernels.write_text(f"import sys\nsys.path.insert(0, {tests!r})\nfrom triton_kernels import ADD_SIGNATURE, "
                       "add_kernel\nKERNELS = [{'label': 'add', 'kernel': add_kernel, 'signature': ADD_SIGNATURE, "
                       "'constexprs': {'BLOCK': 64}}]\n")
    exported = tmp_path / "decisions.json"
    exported.write_text(export_text([_decision("c")]))
    out = tmp_path / "out"
    proc = _aiocompile("build", str(kernels), "-t", "cuda:90", "--out", str(out), "--no-progress", "-j", "1",
                       "--decisions", str(exported))
    assert proc.returncode == 0, proc.stderr
    assert "1 tuning decision(s) imported" in proc.stderr
    assert [d.key for d in read_all(out)[0]] == ["c" * 64]


def test_bad_decision_files_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else", "decisions": []}')
    proc = _aiocompile("decisions", "import", str(tmp_path / "d"), str(bad))
    assert proc.returncode == 2 and "not an export of tuning decisions" in proc.stderr
    proc = _aiocompile("decisions", "import", str(tmp_path / "d"), str(tmp_path / "missing.json"))
    assert proc.returncode == 2 and "no such file" in proc.stderr
    proc = _aiocompile("decisions", "list", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "no such directory" in proc.stderr


MIXED = (
    "import sys\n"
    "sys.path.insert(0, {tests!r})\n"
    "from native_sources import ADD, VECTOR_ADD\n"
    "from triton_kernels import ADD_SIGNATURE, add_kernel\n\n"
    "KERNELS = [\n"
    "    {{'label': 'add_64', 'kernel': add_kernel, 'signature': ADD_SIGNATURE, 'constexprs': {{'BLOCK': 64}}}},\n"
    "    {{'label': 'add_cpp', 'kind': 'cpp', 'source': ADD, 'flags': ['-O2']}},\n"
    "    {{'label': 'vector_add', 'kind': 'cuda', 'source': VECTOR_ADD, 'arch': ['sm_80', 'sm_90']}},\n"
    "    {{'label': 'vector_add_ptx', 'kind': 'cuda', 'source': VECTOR_ADD, 'output': 'ptx'}},\n"
    "    {{'label': 'broken_cpp', 'kind': 'cpp', 'source': 'int broken() {{ return undefined_name; }}'}},\n"
    "]\n"
)


@pytest.mark.skipif(not (have("cpp") and have("cuda")), reason="needs a C++ compiler and nvcc")
def test_a_build_of_triton_cpp_and_cuda_kernels_side_by_side(tmp_path):
    kernel_set = tmp_path / "mixed_set.py"
    kernel_set.write_text(MIXED.format(tests=str(ROOT / "tests")))
    out = tmp_path / "out"
    proc = _aiocompile("build", str(kernel_set), "-t", "cuda:80,cuda:90", "--out", str(out), "--no-progress", "-j", "2")
    assert proc.returncode == 1, proc.stderr  # one entry does not compile
    manifest = json.loads((out / "manifest.json").read_text())
    entries = {(e["label"], e["target"]): e for e in manifest["kernels"]}
    machine = next(e["target"] for e in manifest["kernels"] if e["kind"] == "cpp")
    # Triton and the CUDA source without an arch once per target; the rest once.
    assert set(entries) == {("add_64", "cuda:80"), ("add_64", "cuda:90"), ("add_cpp", machine),
                            ("vector_add", "cuda:sm_80+sm_90"), ("vector_add_ptx", "cuda:sm_80"),
                            ("vector_add_ptx", "cuda:sm_90")}
    library = aiocompile.NativeLibrary.from_bytes((out / entries["add_cpp", machine]["file"]).read_bytes())
    assert (out / entries["add_cpp", machine]["binary"]).read_bytes() == library.binary
    assert library.symbol("add")(2, 3) == 5 and "-O2" in entries["add_cpp", machine]["command"]
    cubins = entries["vector_add", "cuda:sm_80+sm_90"]
    binary = aiocompile.CudaBinary.from_bytes((out / cubins["file"]).read_bytes())
    assert set(cubins["images"]) == {"sm_80", "sm_90"}
    for arch, path in cubins["images"].items():
        assert path.endswith(f"vector_add.{arch}.cubin") and (out / path).read_bytes() == binary.images[arch]
    assert {"cicc", "ptxas"} <= {stage for stage, _ in cubins["stages"]}
    ptx = (out / entries["vector_add_ptx", "cuda:sm_90"]["binary"]).read_text()
    assert ".target sm_90" in ptx
    # The failure: its compiler's first error, file:line, in the summary and the manifest.
    assert manifest["failures"][0]["label"] == "broken_cpp" and "command:" in manifest["failures"][0]["error"]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("broken_cpp"))
    assert "FAILED" in line and "source.cpp:1:" in line and "undefined_name" in line
    assert "6 built, 1 failed" in proc.stdout

    again = _aiocompile("build", str(kernel_set), "-t", "cuda:80,cuda:90", "--out", str(out), "--no-progress")
    assert "6 built (6 of them from the cache), 1 failed" in again.stdout, again.stderr


@pytest.mark.skipif(not have("cpp"), reason="needs a C++ compiler")
def test_a_build_of_cpp_sources_alone_needs_no_target(tmp_path):
    kernel_set = tmp_path / "cpp_set.py"
    kernel_set.write_text("KERNELS = [{'label': 'one', 'kind': 'cpp',\n"
                          "            'source': 'extern \"C\" int one() { return 1; }'}]\n")
    out = tmp_path / "out"
    proc = _aiocompile("build", str(kernel_set), "--out", str(out), "--no-progress", "-j", "1")
    assert proc.returncode == 0, proc.stderr
    assert "building 1 kernel for this machine with 1 worker\n" in proc.stderr and "1 built, 0 failed" in proc.stdout
    assert re.search(r"1 built, 0 failed in [0-9.]+ s wall with 1 worker;", proc.stdout), proc.stdout
    # A Triton kernel, or a CUDA source without an arch, is built per target: then one is needed.
    kernel_set.write_text("KERNELS = [{'label': 'k', 'kind': 'cuda', 'source': '__global__ void k() {}'}]\n")
    proc = _aiocompile("build", str(kernel_set), "--out", str(out), "--no-progress")
    assert proc.returncode == 2 and "--target is needed" in proc.stderr
    kernel_set.write_text("KERNELS = [{'kind': 'rust', 'source': 'fn main() {}'}]\n")
    proc = _aiocompile("build", str(kernel_set), "--out", str(out), "--no-progress")
    assert proc.returncode == 2 and "must define KERNELS" in proc.stderr
