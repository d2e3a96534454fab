"""Repro bundles: the bounded root, listing them (``aiocompile report --repro``), the
setting that switches them off, and the bundle of an Inductor kernel that did not compile
under ``aiocompile.torch.install()`` (whose script fails the same way)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, subprocess_env

import aiocompile
from aiocompile._observe.repro import ReproRoot, environment, list_bundles, root_of


def write(root: ReproRoot, name: str, size: int = 10, **info) -> str:
    return root.write("test", name, {"repro.py": "raise SystemExit(3)\n", "data.bin": b"x" * size},
                      {"stage": "testing", "error_type": "ValueError", "error": f"{name} went wrong\nmore", **info})


def test_a_bundle_is_written_whole_with_its_manifest(tmp_path):
    root = ReproRoot(str(tmp_path / "repro"))
    path = Path(write(root, "first kernel/1"))
    assert path.parent == tmp_path / "repro" and "-test-first_kernel_1-" in path.name
    manifest = json.loads((path / "bundle.json").read_text())
    assert manifest["files"] == ["bundle.json", "data.bin", "repro.py"]
    assert (manifest["kind"], manifest["name"], manifest["stage"]) == ("test", "first kernel/1", "testing")
    assert manifest["versions"]["aiocompile"] == aiocompile.__version__
    assert [p.name for p in (tmp_path / "repro").iterdir()] == [path.name]  # nothing half-written left
    assert oct(path.stat().st_mode & 0o777) == "0o700"
    (bundle,) = list_bundles(root.path)
    assert (bundle.path, bundle.headline) == (str(path), "ValueError: first kernel/1 went wrong")


def test_the_root_keeps_the_newest_bundles_within_both_bounds(tmp_path):
    root = ReproRoot(str(tmp_path), keep=3, max_bytes=None)
    written = []
    for i in range(5):
        written.append(write(root, f"b{i}"))
        time.sleep(0.01)  # bundles are ordered by their creation time
    assert [b.path for b in list_bundles(root.path)] == written[2:]

    # By size: a bound of two and a half bundles keeps two.
    probe = ReproRoot(str(tmp_path / "probe"))
    size = list_bundles(probe.path)[0].size if write(probe, "s0", size=1024) else 0
    sized = ReproRoot(str(tmp_path / "sized"), keep=100, max_bytes=int(2.5 * size))
    paths = []
    for i in range(4):
        paths.append(write(sized, f"s{i}", size=1024))
        time.sleep(0.01)
    assert [b.path for b in list_bundles(sized.path)] == paths[2:]

    # A bundle larger than the whole bound is kept alone: the newest always stays.
    huge = write(sized, "huge", size=20_000)
    assert [b.path for b in list_bundles(sized.path)] == [huge]


def test_listing_passes_over_what_is_not_a_bundle(tmp_path):
    root = ReproRoot(str(tmp_path))
    good = write(root, "good")
    (tmp_path / "stray").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "bundle.json").write_text("{not json")
    (tmp_path / ".writing-x").mkdir()
    # A manifest far too large to be one (sparse: it costs no disk) is not read, nor is
    # one that is a FIFO (opening it to read would wait for a writer forever).
    (tmp_path / "huge").mkdir()
    with open(tmp_path / "huge" / "bundle.json", "wb") as f:
        f.truncate(8 << 30)
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "bundle.json")
    started = time.monotonic()
    assert [b.path for b in list_bundles(str(tmp_path))] == [good]
    assert time.monotonic() - started < 5
    assert list_bundles(str(tmp_path / "missing")) == []


def test_what_others_left_in_a_shared_root_holds_up_no_listing_and_no_writer(tmp_path):
    # A root others may write (AIOCOMPILE_REPRO_DIR on a shared disk): a FIFO where a
    # bundle's manifest belongs, a time no bundle was made at, escape sequences in a message.
    root = ReproRoot(str(tmp_path))
    for name in ("fifo", "far_future", "escapes"):
        (tmp_path / name).mkdir()
    os.mkfifo(tmp_path / "fifo" / "bundle.json")
    (tmp_path / "far_future" / "bundle.json").write_text('{"created": 1e300, "name": "far"}')
    (tmp_path / "escapes" / "bundle.json").write_text(json.dumps({"created": 1.0, "name": "esc\x1b]0;owned\x07",
                                                                  "error": "\x1b[2Jcleared"}))
    good = write(root, "good")  # prunes after writing: it lists the root too
    assert sorted(Path(b.path).name for b in list_bundles(root.path)) == sorted(["far_future", "escapes",
                                                                                 Path(good).name])
    proc = _report("--repro", root.path)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "esc?]0;owned?" in proc.stdout and "?[2Jcleared" in proc.stdout
    assert "1970-01-01" in proc.stdout and "far" in proc.stdout


def test_the_environment_kept_leaves_secrets_out():
    env = environment({"TORCHINDUCTOR_CACHE_DIR": "/c", "AIOCOMPILE_CACHE_KEY": "hunter2", "HOME": "/root",
                       "CUDA_VISIBLE_DEVICES": "0", "TRITON_API_TOKEN": "t"})
    assert env == {"CUDA_VISIBLE_DEVICES": "0", "TORCHINDUCTOR_CACHE_DIR": "/c"}


def test_one_setting_switches_bundles_off():
    assert root_of(aiocompile.SchedulerConfig(repro_dir=None)) is None
    default = aiocompile.SchedulerConfig()
    assert default.repro_dir.endswith(os.path.join("aiocompile", "repro")) and root_of(default) is not None
    for word in ("off", "0", "none", "False"):
        assert aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_REPRO_DIR": word}).repro_dir is None
    config = aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_REPRO_DIR": "/tmp/bundles",
                                                  "AIOCOMPILE_REPRO_KEEP": "7", "AIOCOMPILE_REPRO_DIR_BYTES": "1000"})
    assert root_of(config) == ReproRoot("/tmp/bundles", 7, 1000)


def _report(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiocompile", "report", *args], capture_output=True, text=True,
                          cwd=ROOT, env=subprocess_env(**env), timeout=120)


def test_report_lists_bundles_newest_first(tmp_path):
    root = ReproRoot(str(tmp_path / "repro"))
    old = write(root, "older_kernel")
    time.sleep(0.01)
    new = write(root, "newer_kernel")
    proc = _report("--repro", root.path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"2 repro bundle(s) in {root.path}")
    assert out.index("newer_kernel") < out.index("older_kernel")
    assert "ValueError: newer_kernel went wrong" in out and "more" not in out
    assert f"python {os.path.join(new, 'repro.py')}" in out and old in out

    # Without a directory: the root the environment's configuration names.
    assert root.path in _report("--repro", AIOCOMPILE_REPRO_DIR=root.path).stdout
    empty = _report("--repro", str(tmp_path / "none-yet"))
    assert empty.returncode == 0 and "no repro bundles in" in empty.stdout
    off = _report("--repro", AIOCOMPILE_REPRO_DIR="off")
    assert off.returncode == 2 and "switched off" in off.stderr
    neither = _report()
    assert neither.returncode == 2 and "EVENTS" in neither.stderr



# -- Inductor kernels under install() ------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_a_kernel_that_does_not_compile_under_install_leaves_a_bundle_that_fails_the_same_way(tmp_path,
                                                                                             monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("with a GPU the kernel compiles")
    from test_inductor import one_kernel
    from torch._inductor import config

    import aiocompile.torch as aiotorch

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    kernel = one_kernel()
    repro = tmp_path / "repro"
    sched = aiocompile.Scheduler(config=aiocompile.SchedulerConfig(workers=1, preload=(), repro_dir=str(repro)))
    from torch._inductor.async_compile import AsyncCompile

    try:
        with aiotorch.installed(sched, timeout=300, warm=False), config.patch(compile_threads=2):
            future = AsyncCompile().triton(kernel["kernel_name"], kernel["source_code"], device_str="cuda")
            with pytest.raises(aiocompile.CompileError) as failed:
                future.result(timeout=300)
            # Asked again, the same failure: one bundle however many ask.
            with pytest.raises(aiocompile.CompileError) as again:
                AsyncCompile().triton(kernel["kernel_name"], kernel["source_code"], device_str="cuda").result()
    finally:
        sched.close()
    bundle = failed.value.repro
    assert bundle is not None and bundle in str(failed.value) and again.value.repro == bundle
    (listed,) = list_bundles(str(repro))
    assert listed.path == bundle and listed.kind == "kernel" and listed.name == kernel["kernel_name"]
    manifest = json.loads(Path(bundle, "bundle.json").read_text())
    assert manifest["target"] == "cuda:90" and manifest["error_type"] == "CompileError"
    assert Path(bundle, "kernel.py").read_text() == kernel["source_code"]
    assert "Traceback in the worker process" in Path(bundle, "error.txt").read_text()

    proc = subprocess.run([sys.executable, os.path.join(bundle, "repro.py")], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300, cwd="/")
    assert proc.returncode != 0
    # The worker's own message (the module fails to load without a GPU driver) is the
    # repro's last word too.
    message = failed.value.message.split(": ", 1)[-1].strip().splitlines()[0]
    assert message in proc.stderr, (message, proc.stderr[-3000:])


@pytest.mark.timeout(600)
def test_an_inductor_error_under_install_leaves_a_graph_bundle_that_fails_the_same_way(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    import traceback

    from torch._inductor import compile_fx

    import aiocompile.torch as aiotorch

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    cxx = tmp_path / "broken-g++"
    cxx.write_text('#!/bin/sh\necho "broken-g++: this compiler compiles nothing" >&2\nexit 1\n')
    cxx.chmod(0o755)
    repro = tmp_path / "repro"
    sched = aiocompile.Scheduler(config=aiocompile.SchedulerConfig(workers=1, preload=(), repro_dir=str(repro)))
    debug_wrapper = compile_fx.wrap_compiler_debug
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    torch._dynamo.reset()
    try:
        with aiotorch.installed(sched, warm=False):
            assert compile_fx.wrap_compiler_debug is not debug_wrapper
            with pytest.raises(Exception) as failed:
                torch.compile(model, options={"cpp.cxx": (None, str(cxx))})(torch.randn(2, 8))
        assert compile_fx.wrap_compiler_debug is debug_wrapper  # uninstall put it back
    finally:
        sched.close()
        torch._dynamo.reset()
    (bundle,) = list_bundles(str(repro))
    assert (bundle.kind, bundle.stage, bundle.error_type) == ("graph", "inductor", "InductorError")
    # The error names the bundle in its traceback.
    assert bundle.path in "".join(traceback.format_exception(failed.value))
    graph = Path(bundle.path, "graph.py").read_text()
    assert "torch.ops.aten" in graph and "f32[2, 8]" in graph

    env = subprocess_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "again"))
    proc = subprocess.run([sys.executable, os.path.join(bundle.path, "repro.py")], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    assert "InvalidCxxCompiler" in proc.stderr and str(cxx) in proc.stderr, proc.stderr[-3000:]
