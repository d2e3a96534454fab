"""`aiocompile report`: event logs written by real schedulers, read back and drawn."""

import json
import re
import subprocess
import sys
from collections import Counter

import anyio
import jobs
import pytest
from conftest import ROOT, example_spec, subprocess_env
from test_faults import gather
from triton_kernels import ADD_SIGNATURE, add_kernel, type_error_kernel

import aiocompile
from aiocompile._observe.events import JsonLinesSink
from aiocompile._observe.report import draw_timeline, read_events, summary_table
from aiocompile.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def compile_add(sched):
    return sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 128}, target="cuda:80")


async def record_a_run(path):
    """Real jobs through a real scheduler, one of each fate the report tells apart: two
    compiles, a compile error, a job that kills its worker (twice: it is retried once),
    one that hangs past its timeout, a plain function, and a repeat answered from memory."""
    sched = aiocompile.Scheduler(workers=2, event_log=path)
    try:
        with anyio.fail_after(120):
            results = await gather(
                lambda: compile_add(sched),
                lambda: sched.compile_triton(target="cuda:90", **example_spec("softmax_1024")),
                lambda: sched.compile_triton(type_error_kernel, signature={"x_ptr": "*fp32", "n": "i32"},
                                             constexprs={"BLOCK": 64}, target="cuda:80"),
                lambda: sched.run(jobs.kill_self),
                lambda: sched.run(jobs.hang, timeout=0.5),
                lambda: sched.run(jobs.echo, "innocent"),
            )
            results.append(await compile_add(sched))
    finally:
        await sched.aclose()  # writes the rest of the event log
    kinds = [type(result).__name__ for result in results]
    assert kinds == ["TritonKernel", "TritonKernel", "CompileError", "WorkerCrashed", "JobTimeout", "str",
                     "TritonKernel"], results


async def test_a_real_run_is_read_back_exactly(tmp_path, capsys):
    path = tmp_path / "events.jsonl"
    await record_a_run(path)

    events = read_events(path)
    assert events.skipped == 0
    assert Counter(record.outcome for record in events.requests) == {
        "compiled": 3, "cache_hit": 1, "error": 1, "crashed": 1, "timeout": 1}
    assert Counter(attempt.status for attempt in events.attempts) == {"ok": 3, "error": 1, "crashed": 2, "timeout": 1}
    exits = Counter(event.status for event in events.workers if event.event == "worker_exited")
    assert (exits["crashed"], exits["timeout"]) == (2, 1)
    crashed = [attempt for attempt in events.attempts if attempt.status == "crashed"]
    assert [attempt.name for attempt in crashed] == ["kill_self", "kill_self"]
    assert [attempt.attempt for attempt in crashed] == [1, 2] and crashed[0].pid != crashed[1].pid
    softmax = next(record for record in events.requests if record.name == "softmax_kernel")
    assert softmax.target == "cuda:90"
    if not softmax.compiler_cache_hit:  # a compile Triton ran itself (not found in its cache) reports its stages
        assert {"ttir", "ptx", "cubin"} <= set(softmax.stage_times)

    text = summary_table(events)
    for name in ("add_kernel", "softmax_kernel", "type_error_kernel", "kill_self", "hang", "echo"):
        assert re.search(rf"^{name} ", text, re.MULTILINE), (name, text)
    for outcome, count in {"compiled": 3, "cache_hit": 1, "error": 1, "crashed": 1, "timeout": 1, "total": 7}.items():
        assert re.search(rf"^{outcome} +{count}\b", text, re.MULTILINE), (outcome, text)
    assert "7 requests, 7 attempts" in text
    # add_kernel: 2 requests, 1 compiled, 1 hit, 0 joined, 0 failed.
    assert re.search(r"^add_kernel +cuda:80 +2 +1 +1 +0 +0 ", text, re.MULTILINE), text
    crashes = text.split("crashes and timeouts:")[1]
    assert crashes.count("kill_self") == 2 and crashes.count("crashed (SIGKILL)") == 2
    assert "hang" in crashes and "timeout (SIGKILL)" in crashes

    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"aiocompile report: {path}\n") and text in out


async def test_the_timeline_of_a_real_run(tmp_path, capsys):
    image = pytest.importorskip("matplotlib.image")
    path, png = tmp_path / "events.jsonl", tmp_path / "out.png"
    await record_a_run(path)

    assert main(["report", str(path), "--timeline", str(png)]) == 0
    assert f"timeline written to {png}" in capsys.readouterr().out
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    height, width = image.imread(png).shape[:2]
    assert width == 1200 and 200 < height < 1200


def write_events(path, events):
    """Through the writer the scheduler uses, so the lines are exactly its format."""
    sink = JsonLinesSink(path)
    for event in events:
        sink(event)
    sink.close()


def a_few_events(t=1000.0):
    return [
        aiocompile.WorkerEvent("worker_started", t, 11),
        aiocompile.WorkerEvent("job_started", t + 0.1, 11, job_id=1, name="k", attempt=1, started_at=t + 0.1),
        aiocompile.WorkerEvent("job_ended", t + 0.5, 11, job_id=1, name="k", attempt=1, status="ok",
                               started_at=t + 0.1),
        aiocompile.JobRecord(key="ab", name="k", backend="triton", target="cuda:90", outcome="compiled", error=None,
                             queued_at=t, started_at=t + 0.1, finished_at=t + 0.6, queue_wait=0.1, run_time=0.4,
                             load_time=0.01, total_time=0.6, stages=(("ttir", 0.1), ("ptx", 0.2)), attempts=1,
                             worker_pid=11),
        aiocompile.WorkerEvent("worker_exited", t + 2.0, 11, status="shutdown", exitcode=0),
    ]


def test_a_line_cut_short_is_skipped_and_counted(tmp_path):
    path = tmp_path / "events.jsonl"
    write_events(path, a_few_events())
    with open(path, "a") as f:
        f.write(json.dumps({"event": "something_newer", "time": 1.0}) + "\n\n")  # not counted: a kind to pass over
        f.write('{"event": "request", "key": "0123456789abcdef", "name": "add_ke')  # a writer killed mid-line

    events = read_events(path)
    assert events.skipped == 1
    assert [record.name for record in events.requests] == ["k"]
    assert events.requests[0].stage_times == {"ttir": 0.1, "ptx": 0.2}
    assert [attempt.status for attempt in events.attempts] == ["ok"]
    assert [event.event for event in events.workers] == ["worker_started", "worker_exited"]
    assert events.span == (1000.0, 1002.0)
    assert "1 unreadable line(s) skipped" in summary_table(events)


def test_a_missing_or_empty_file_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path / "missing.jsonl")])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith(f"aiocompile: no such file: {tmp_path / 'missing.jsonl'}")

    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"event": "request", "na')
    with pytest.raises(SystemExit) as info:
        main(["report", str(empty)])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith(f"aiocompile: no events in {empty} (1 unreadable line(s) skipped)")


def test_a_log_without_attempts_has_no_timeline(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "events.jsonl"
    write_events(path, [event for event in a_few_events() if event.event != "job_ended"])
    with pytest.raises(ValueError, match="no job attempts"):
        draw_timeline(read_events(path), tmp_path / "out.png")
    with pytest.raises(SystemExit) as info:
        main(["report", str(path), "--timeline", str(tmp_path / "out.png")])
    assert info.value.code == 2 and "no job attempts" in capsys.readouterr().err
    assert not (tmp_path / "out.png").exists()


def test_a_reader_that_stops_reading_early_costs_no_traceback(tmp_path):
    path = tmp_path / "events.jsonl"
    write_events(path, a_few_events())
    # As `aiocompile report events.jsonl | head -1`, with the reader gone before the first write.
    for command in (("report", str(path)), ("decisions", "list", str(tmp_path))):
        proc = subprocess.Popen([sys.executable, "-m", "aiocompile", *command], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=ROOT)
        proc.stdout.close()
        stderr = proc.stderr.read()
        assert (proc.wait(timeout=120), stderr) == (0, ""), command


def test_a_timeline_that_cannot_be_written_is_a_line_and_status_2(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "events.jsonl"
    write_events(path, a_few_events())
    where = tmp_path / "missing" / "timeline.png"
    with pytest.raises(SystemExit) as info:
        main(["report", str(path), "--timeline", str(where)])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"aiocompile: cannot write the timeline {where}: No such file or directory\n"


def test_build_writes_its_event_log(tmp_path):
    kernel_set = tmp_path / "tiny_set.py"
    kernel_set.write_text(
        "import triton\nimport triton.language as tl\n\n"
        "@triton.jit\ndef fill(x_ptr):\n    tl.store(x_ptr, 1.0)\n\n"
        "@triton.jit\ndef scale(x_ptr, y_ptr):\n    tl.store(y_ptr, tl.load(x_ptr) * 2.0)\n\n"
        "KERNELS = [\n"
        "    {'label': 'fill', 'kernel': fill, 'signature': {'x_ptr': '*fp32'}},\n"
        "    {'label': 'scale', 'kernel': scale, 'signature': {'x_ptr': '*fp32', 'y_ptr': '*fp32'}},\n"
        "]\n"
    )
    log = tmp_path / "logs" / "build.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "aiocompile", "build", str(kernel_set), "-t", "cuda:90", "--out", str(tmp_path / "out"),
         "--no-progress", "-j", "1", "--events", str(log)],
        capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"events appended to {log}" in proc.stdout
    events = read_events(log)
    assert sorted((r.name, r.target, r.outcome) for r in events.requests) == [
        ("fill", "cuda:90", "compiled"), ("scale", "cuda:90", "compiled")]
    assert [attempt.status for attempt in events.attempts] == ["ok", "ok"]
    assert len({attempt.pid for attempt in events.attempts}) == 1  # -j 1
