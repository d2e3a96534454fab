"""Guarantee 5: every request is measured and counted exactly once, and the records reach
each sink (logging, the JSON-lines file, listeners, Prometheus) as the same facts."""

import functools
import io
import json
import logging
import subprocess
import sys
import textwrap
import time
import uuid

import anyio
import jobs
import pytest
from conftest import subprocess_env, wait_until
from triton_kernels import ADD_SIGNATURE, add_kernel, type_error_kernel

import aiocompile
from aiocompile._observe.progress import Progress
from aiocompile.records import FAILURES, OUTCOMES

SCALE_SOURCE = '''
import triton
import triton.language as tl

@triton.jit
def scale_{tag}(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2.0, mask=mask)
'''


def fresh_kernel():
    """A kernel no cache has seen: Triton really compiles it."""
    tag = uuid.uuid4().hex[:12]
    return aiocompile.TritonSource(SCALE_SOURCE.format(tag=tag), f"scale_{tag}")


def scale_args(target="cuda:90"):
    return {"signature": {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}, "constexprs": {"BLOCK": 128},
            "target": target}


class TTY(io.StringIO):
    def isatty(self):
        return True


async def started_in_worker(sched, name):
    """Wait until a job called ``name`` has started in a worker (from the pool's events)."""
    started = anyio.Event()
    token = anyio.lowlevel.current_token()

    def listener(event):
        if event.event == "job_started" and event.name == name:
            anyio.from_thread.run_sync(started.set, token=token)

    unsubscribe = sched.subscribe(listener)
    try:
        await started.wait()
    finally:
        unsubscribe()


async def every_outcome(sched, other_sched_with_same_cache_dir):
    """Ends one request (or more) in each outcome; returns the outcomes expected."""
    kernel = fresh_kernel()
    compiled = await sched.compile_triton(kernel, **scale_args())                # compiled
    await sched.compile_triton(kernel, **scale_args())                           # cache_hit
    # The file is written in the background, after the answer.
    assert wait_until(lambda: sched.port._disk.path(compiled.key).exists())
    await other_sched_with_same_cache_dir.compile_triton(kernel, **scale_args())  # disk_hit (there)

    async with anyio.create_task_group() as group:                               # compiled + joined
        for _ in range(2):
            group.start_soon(functools.partial(sched.run, jobs.sleep_then, 0.3, "shared", key="k1"))

    with pytest.raises(aiocompile.CompileError):                                 # error
        await sched.compile_triton(type_error_kernel, signature={"x_ptr": "*fp32", "n": "i32"},
                                   constexprs={"BLOCK": 64}, target="cuda:80")
    with pytest.raises(aiocompile.CompileError):                                 # error_hit
        await sched.compile_triton(type_error_kernel, signature={"x_ptr": "*fp32", "n": "i32"},
                                   constexprs={"BLOCK": 64}, target="cuda:80")
    with pytest.raises(aiocompile.WorkerCrashed):                           # crashed (2 deaths)
        await sched.run(jobs.exit_now, 3)
    with pytest.raises(aiocompile.JobTimeout):                               # timeout
        await sched.run(jobs.hang, timeout=0.5)
    with anyio.move_on_after(0.3):                                               # cancelled
        await sched.run(jobs.sleep_then, 3.0)

    closed = []

    async def outlive_the_scheduler():
        try:
            await sched.run(jobs.sleep_then, 30.0)
        except aiocompile.SchedulerClosed as exc:
            closed.append(exc)

    async with anyio.create_task_group() as group:                               # closed
        group.start_soon(outlive_the_scheduler)
        await started_in_worker(sched, "sleep_then")
        await sched.aclose(grace=0)
    assert len(closed) == 1
    return {"compiled": 2, "cache_hit": 1, "joined": 1, "error": 1, "error_hit": 1, "crashed": 1, "timeout": 1,
            "cancelled": 1, "closed": 1}


def expected_counts(expected):
    return {outcome: expected.get(outcome, 0) for outcome in OUTCOMES}


async def test_every_request_ends_in_exactly_one_outcome(tmp_path):
    other = aiocompile.Scheduler(workers=1, cache_dir=tmp_path / "cache")
    sched = aiocompile.Scheduler(workers=2, max_crashes=2, cache_dir=tmp_path / "cache")
    try:
        expected = await every_outcome(sched, other)
    finally:
        await other.aclose()
        await sched.aclose()
    stats = sched.statistics()
    assert stats.outcomes == expected_counts(expected)
    assert stats.submitted == sum(expected.values()) == sum(stats.outcomes.values())
    assert stats.in_flight == 0
    assert stats.failed == sum(stats.outcomes[name] for name in FAILURES) == 4
    assert (stats.compiled, stats.cache_hits, stats.joined, stats.error_hits, stats.cancelled) == (2, 1, 1, 1, 1)
    assert other.statistics().outcomes == expected_counts({"disk_hit": 1})

    records = sched.records()
    assert sorted(r.outcome for r in records) == sorted(o for o, n in expected.items() for _ in range(n))
    by_outcome = {}
    for record in records:
        by_outcome.setdefault(record.outcome, []).append(record)

    compiled = by_outcome["compiled"][0]
    assert compiled.backend == "triton" and compiled.target == "cuda:90" and compiled.name.startswith("scale_")
    assert compiled.queued_at <= compiled.started_at <= compiled.finished_at
    assert compiled.queue_wait >= 0 and compiled.run_time > 0 and compiled.load_time >= 0
    assert compiled.total_time >= compiled.run_time
    assert compiled.attempts == 1 and compiled.worker_pid and compiled.worker_rss > 0
    assert compiled.artifact_size > 1000 and compiled.error is None

    hit = by_outcome["cache_hit"][0]
    assert (hit.queue_wait, hit.run_time, hit.started_at, hit.attempts) == (None, None, None, 0)
    assert hit.key == compiled.key and hit.artifact_size == compiled.artifact_size

    joined = by_outcome["joined"][0]
    assert joined.run_time is None and joined.attempts == 0 and joined.worker_pid is not None

    crashed = by_outcome["crashed"][0]
    assert crashed.attempts == 2 and crashed.error.startswith("WorkerCrashed")
    timeout = by_outcome["timeout"][0]
    assert timeout.attempts == 1 and timeout.run_time is None and timeout.error.startswith("JobTimeout")
    assert by_outcome["error"][0].error.startswith("CompileError") and by_outcome["error"][0].run_time > 0
    assert by_outcome["error_hit"][0].attempts == 0
    assert by_outcome["closed"][0].error.startswith("SchedulerClosed")

    # Summaries cover the jobs that ran; total_time every answered request.
    assert stats.total_time.count == stats.submitted
    assert stats.run_time.count == 3  # the compile, the shared run(), the compile error
    assert stats.run_time.p50 <= stats.run_time.p95 <= stats.run_time.max <= stats.run_time.total
    json.dumps(stats.to_dict())  # JSON-ready


async def test_sinks_see_the_same_events(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="aiocompile")
    seen = []
    log_path = tmp_path / "events.jsonl"
    other = aiocompile.Scheduler(workers=1, cache_dir=tmp_path / "cache")
    sched = aiocompile.Scheduler(workers=2, cache_dir=tmp_path / "cache", event_log=log_path, on_event=seen.append)
    try:
        await every_outcome(sched, other)
    finally:
        await other.aclose()
        await sched.aclose()

    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(lines) == len(seen)
    assert [line["event"] for line in lines] == [event.event for event in seen]
    requests = [line for line in lines if line["event"] == "request"]
    assert [r["outcome"] for r in requests] == [r.outcome for r in sched.records()]
    assert requests[0] == {"event": "request", **sched.records()[0].to_dict()}
    assert set(requests[0]["stages"]) >= {"ttir", "ttgir", "llir", "ptx", "cubin"}

    def count(event, status=None):
        return sum(1 for line in lines if line["event"] == event and (status is None or line["status"] == status))

    # Every attempt that started ended, with the status the request saw.
    assert count("job_started") == count("job_ended")
    assert count("job_ended", "crashed") == 2 and count("worker_exited", "crashed") == 2
    assert count("job_ended", "timeout") == 1 and count("worker_exited", "timeout") == 1
    assert count("job_ended", "error") == 1
    # A cancelled wait leaves its started job running (cancel_running="keep"): it is killed
    # at close with the one whose caller got SchedulerClosed.
    assert count("job_ended", "cancelled") == 0 and count("job_ended", "closed") == 2
    started = count("worker_started")
    assert started == sched.statistics().workers_started
    assert count("worker_exited") == started  # every worker's end is reported, at close too
    for line in lines:
        if line["event"] == "job_ended":
            assert line["started_at"] <= line["time"] and line["pid"] and line["job_id"]

    # The logger got one record per event, the fields in extra.
    # (Other schedulers log to the same logger: ``other`` for one.)
    logged = [r for r in caplog.records if r.name == "aiocompile" and hasattr(r, "event")]
    mine = {(line["event"], line.get("time", line.get("finished_at"))) for line in lines}
    logged = [r for r in logged if (r.event, getattr(r, "time", getattr(r, "finished_at", None))) in mine]
    assert len(logged) == len(lines)
    compiled = next(r for r in logged if getattr(r, "outcome", None) == "compiled")
    assert compiled.levelno == logging.INFO and compiled.kernel.startswith("scale_")
    assert compiled.run_time > 0 and compiled.worker_pid and "cubin" in compiled.stages
    assert "compiled scale_" in compiled.getMessage()
    levels = {(r.event, getattr(r, "outcome", None) or r.status): r.levelno for r in logged}
    assert levels[("request", "crashed")] == logging.WARNING
    assert levels[("request", "timeout")] == logging.WARNING
    assert levels[("request", "cache_hit")] == logging.DEBUG
    assert levels[("worker_exited", "crashed")] == logging.WARNING


QUIET_SCRIPT = textwrap.dedent("""
    import asyncio, os, aiocompile

    async def main():
        try:
            await aiocompile.compile_cpp("int x = ;")
        except aiocompile.CompileError:
            print("compile error caught")
        async with aiocompile.Scheduler(workers=1, max_crashes=2) as sched:
            try:
                await sched.run(os.abort)
            except aiocompile.WorkerCrashed:
                print("crash caught")

    asyncio.run(main())
""")


def test_errors_a_program_catches_print_nothing():
    # As a program that configures no logging runs it: the library logs its warnings,
    # and prints none of them (no last-resort handler, no CRITICAL from a retry).
    done = subprocess.run([sys.executable, "-c", QUIET_SCRIPT], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "compile error caught\ncrash caught\n", "")


async def test_stage_times_come_from_the_compiler(scheduler):
    kernel = fresh_kernel()
    await scheduler.compile_triton(kernel, **scale_args("cuda:90"))
    record = scheduler.records()[-1]
    stages = [stage for stage, _ in record.stages]
    assert stages[0] == "make_ir" and stages[-1] == "store"
    assert stages[1:-1] == ["ttir", "ttgir", "llir", "ptx", "cubin"]
    assert all(seconds >= 0 for _, seconds in record.stages)
    assert sum(seconds for _, seconds in record.stages) <= record.run_time
    assert record.compiler_cache_hit is False
    assert set(scheduler.statistics().stages) >= set(stages)

    amd = fresh_kernel()
    await scheduler.compile_triton(amd, **scale_args("hip:gfx942"))
    assert [stage for stage, _ in scheduler.records()[-1].stages][1:-1] == ["ttir", "ttgir", "llir", "amdgcn", "hsaco"]

    # A scheduler with an empty memory cache finds it in Triton's own cache in the worker.
    async with aiocompile.Scheduler(workers=1) as other:
        await other.compile_triton(kernel, **scale_args("cuda:90"))
        again = other.records()[-1]
    assert again.outcome == "compiled" and again.compiler_cache_hit is True and again.stages == ()


async def test_prometheus_exposition():
    prometheus = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from aiocompile.prometheus import SchedulerCollector

    async with aiocompile.Scheduler(workers=2) as sched:
        registry = prometheus.CollectorRegistry()
        registry.register(SchedulerCollector(sched, labels={"pool": "test"}))
        for _ in range(2):
            await sched.compile_triton(fresh_kernel(), **scale_args())
        await sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64}, target="cuda:80")
        await sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64}, target="cuda:80")
        with pytest.raises(aiocompile.CompileError):
            await sched.compile_triton(type_error_kernel, signature={"x_ptr": "*fp32", "n": "i32"},
                                       constexprs={"BLOCK": 64}, target="cuda:80")
        stats = sched.statistics()
        text = prometheus.generate_latest(registry).decode()

    families = {family.name: family for family in text_string_to_metric_families(text)}

    def samples(name):
        return [s for s in families[name].samples if s.name == name or s.name.startswith(name + "_")]

    requests = {s.labels["outcome"]: s.value for s in families["aiocompile_requests"].samples
                if s.name == "aiocompile_requests_total"}
    assert requests == {outcome: float(n) for outcome, n in stats.outcomes.items()}
    assert requests["compiled"] == 3 and requests["cache_hit"] == 1 and requests["error"] == 1
    assert all(s.labels["pool"] == "test" for family in families.values() for s in family.samples)

    histogram = families["aiocompile_compile_seconds"]
    assert histogram.type == "histogram"
    buckets = [s for s in histogram.samples if s.name.endswith("_bucket")]
    assert all(s.labels["backend"] == "triton" for s in buckets)
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf"
    (count,) = [s.value for s in histogram.samples if s.name.endswith("_count")]
    (total,) = [s.value for s in histogram.samples if s.name.endswith("_sum")]
    assert count == counts[-1] == stats.run_time.count == 4  # three compiles and the compile error
    assert total == pytest.approx(stats.run_time.total)

    stage_buckets = [s for s in families["aiocompile_compile_stage_seconds"].samples if s.name.endswith("_count")]
    assert {s.labels["stage"] for s in stage_buckets} >= {"ttir", "ttgir", "llir", "ptx", "cubin"}
    for name, value in [("aiocompile_queue_depth", 0), ("aiocompile_busy_workers", 0),
                        ("aiocompile_requests_in_flight", 0), ("aiocompile_cache_entries", stats.cache_entries)]:
        assert families[name].type == "gauge" and samples(name)[0].value == value
    assert samples("aiocompile_queue_depth_max")[0].value == stats.queue_depth_max >= 1
    assert families["aiocompile_workers_started"].type == "counter"
    assert samples("aiocompile_workers_started")[0].value == stats.workers_started


def test_prometheus_collector_follows_the_default_scheduler():
    prometheus = pytest.importorskip("prometheus_client")
    from aiocompile.prometheus import SchedulerCollector

    registry = prometheus.CollectorRegistry()
    registry.register(SchedulerCollector())
    assert b"aiocompile_requests_total" in prometheus.generate_latest(registry)
    with pytest.raises(ValueError, match="outcome"):
        SchedulerCollector(labels={"outcome": "x"})


async def test_listeners_come_and_go_and_a_failing_one_harms_nothing(caplog):
    seen = []

    def broken(event):
        raise RuntimeError("listener bug")

    async with aiocompile.Scheduler(workers=1) as sched:
        unsubscribe = sched.subscribe(seen.append)
        sched.subscribe(broken)
        assert await sched.run(jobs.echo, 1) == 1
        assert await sched.run(jobs.echo, 2) == 2
        unsubscribe()
        count = len(seen)
        assert await sched.run(jobs.echo, 3) == 3
    assert len(seen) == count
    assert [e.outcome for e in seen if e.event == "request"] == ["compiled", "compiled"]
    assert sum("event listener raised" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(TypeError):
        sched.subscribe("not callable")
    with pytest.raises(TypeError):
        aiocompile.Scheduler(on_event=42)


async def test_metrics_off_keeps_exact_counts_and_nothing_else(tmp_path):
    seen = []
    config = aiocompile.SchedulerConfig(workers=1, metrics=False)
    async with aiocompile.Scheduler(config=config, on_event=seen.append, event_log=tmp_path / "e.jsonl") as sched:
        kernel = fresh_kernel()
        await sched.compile_triton(kernel, **scale_args())
        await sched.compile_triton(kernel, **scale_args())
        with pytest.raises(aiocompile.JobTimeout):
            await sched.run(jobs.hang, timeout=0.3)
        stats = sched.statistics()
    assert sched.records() == [] and seen == []
    assert not (tmp_path / "e.jsonl").exists()
    assert (stats.compiled, stats.cache_hits, stats.failed, stats.in_flight) == (1, 1, 1, 0)
    assert stats.outcomes["timeout"] == 1 and stats.submitted == 3
    assert stats.run_time.count == 0 and stats.slowest == ()


def test_configuration_from_the_environment(tmp_path):
    config = aiocompile.SchedulerConfig.from_env(
        {"AIOCOMPILE_METRICS": "0", "AIOCOMPILE_EVENT_LOG": str(tmp_path / "x.jsonl")})
    assert config.metrics is False and config.event_log == str(tmp_path / "x.jsonl")
    assert aiocompile.SchedulerConfig.from_env({}).metrics is True
    with pytest.raises(ValueError, match="AIOCOMPILE_METRICS"):
        aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_METRICS": "maybe"})
    with pytest.raises(TypeError, match="metrics"):
        aiocompile.SchedulerConfig(metrics="yes")


# -- progress and wait() ------------------------------------------------------------------


async def test_progress_names_what_runs_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    terminal = TTY()
    monkeypatch.setattr("sys.stderr", terminal)
    async with aiocompile.Scheduler(workers=2) as sched:
        results = await sched.wait([sched.run(jobs.sleep_then, 0.4, i) for i in range(4)], progress=True)
    assert results == [0, 1, 2, 3]
    shown = terminal.getvalue()
    assert "compiling" in shown and "4/4" in shown
    assert "sleep_then" in shown  # the name of what a worker was running


async def test_progress_stays_quiet_off_a_terminal_or_unasked(monkeypatch):
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    async with aiocompile.Scheduler(workers=1) as sched:
        await sched.compile_many([{"kernel": add_kernel, "signature": ADD_SIGNATURE, "constexprs": {"BLOCK": 64},
                                   "target": "cuda:80"}], progress=True)
        await sched.wait([sched.run(jobs.echo, 1)])
    assert pipe.getvalue() == ""
    assert not Progress(3, enabled=True, stream=pipe).enabled
    assert not Progress(3, enabled=False, stream=TTY()).enabled


def test_progress_tracks_running_kernels_from_worker_events():
    bar = Progress(5, enabled=True, stream=TTY(), names={"a", "b", "c"})
    event = aiocompile.WorkerEvent
    for name in ("a", "b", "c", "other"):
        bar.on_event(event("job_started", 0.0, 1, name=name))
    bar.on_event(event("job_started", 0.0, 1, name="a", warm_up=True))
    assert bar.postfix() == "a, b +1"
    bar.on_event(event("job_ended", 0.0, 1, name="a", status="ok"))
    bar.on_event(event("job_ended", 0.0, 1, name="b", status="crashed"))
    assert bar.postfix() == "c"
    bar.close()


async def test_wait_fills_a_scope_in_place_and_keeps_order():
    import concurrent.futures as cf

    async with aiocompile.Scheduler(workers=2) as sched:
        done = cf.Future()
        done.set_result("from a thread")
        scope = {"first": sched.run(jobs.sleep_then, 0.2, "a"), "plain": 42, "second": sched.run(jobs.echo, "b"),
                 "future": done}
        assert await sched.wait(scope) is scope
        assert scope == {"first": "a", "plain": 42, "second": "b", "future": "from a thread"}
        assert await sched.wait([sched.run(jobs.echo, i) for i in range(5)]) == list(range(5))
        assert await sched.wait([]) == []
        assert await aiocompile.wait([anyio.sleep(0), sched.run(jobs.echo, 7)]) == [None, 7]
        with pytest.raises(TypeError, match="not awaitable"):
            await sched.wait([1, 2])

        failing = [sched.run(jobs.echo, 1), sched.run(jobs.exit_now, 3)]
        results = await sched.wait(failing, return_exceptions=True)
        assert results[0] == 1 and isinstance(results[1], aiocompile.WorkerCrashed)
        with pytest.raises(aiocompile.JobTimeout):
            await sched.wait([sched.run(jobs.hang, timeout=0.3), sched.run(jobs.sleep_then, 0.1, 1)])


async def test_a_foreign_executor_reports_its_attempts_too():
    import concurrent.futures as cf

    seen = []
    async with aiocompile.Scheduler(executor=cf.ProcessPoolExecutor(1), on_event=seen.append) as sched:
        assert await sched.run(jobs.echo, 5) == 5
        pid = await sched.run(jobs.pid)
    ended = [e for e in seen if e.event == "job_ended"]
    assert [e.status for e in ended] == ["ok", "ok"] and ended[-1].pid == pid
    assert all(e.started_at <= e.time for e in ended)
    record = sched.records()[-1]
    assert record.outcome == "compiled" and record.worker_pid == pid and record.run_time >= 0


def test_progress_shows_in_a_notebook_without_a_terminal(monkeypatch):
    import sys
    import types

    class ZMQInteractiveShell:  # what a Jupyter kernel's shell is called
        pass

    fake = types.ModuleType("IPython")
    fake.get_ipython = ZMQInteractiveShell
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert Progress(2, enabled=True, stream=io.StringIO()).enabled
    fake.get_ipython = lambda: None  # plain IPython in a terminal, or no shell at all
    assert not Progress(2, enabled=True, stream=io.StringIO()).enabled


# -- autotune(): its counters, records and progress -------------------------------------------


def _stand_in_tuning(sched, devices=1):
    from tuning_stand_in import StandInTiming

    from aiocompile._tuning.tuner import Tuner

    sched.port._tuner = Tuner(sched.port, StandInTiming(devices))
    return sched


@pytest.fixture
def stand_in_driver():
    from triton.runtime import driver
    from tuning_stand_in import StandInDriver

    previous = driver._active
    driver.set_active(StandInDriver())
    try:
        yield
    finally:
        driver._active = previous
        import tuning_kernels

        tuning_kernels.scale_base.device_caches.clear()


async def test_tuning_counters_reach_statistics_and_prometheus(stand_in_driver):
    prometheus = pytest.importorskip("prometheus_client")
    torch = pytest.importorskip("torch")
    import tuning_kernels as tk
    import tuning_stand_in as si
    from prometheus_client.parser import text_string_to_metric_families

    from aiocompile.prometheus import SchedulerCollector

    x, out = torch.ones(4096), torch.empty(4096)
    kernel = tk.tuned([tk.config(64, cost=5), tk.config(128, mode=si.ERROR), tk.config(256, mode=si.CRASH)])
    failing = tk.tuned([tk.config(64, mode=si.ERROR), tk.config(128, mode=si.ERROR)])
    async with _stand_in_tuning(aiocompile.Scheduler(workers=2)) as sched:
        await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)
        await sched.autotune(kernel, x, out, 4096, 2.0, grid=tk.grid)  # the decision, remembered
        with pytest.raises(aiocompile.AutotuneError):
            await sched.autotune(failing, x, out, 4096, 2.0, grid=tk.grid)
        stats = sched.statistics()
        registry = prometheus.CollectorRegistry()
        registry.register(SchedulerCollector(sched))
        text = prometheus.generate_latest(registry).decode()
    assert (stats.tunings, stats.tuned, stats.tuning_hits, stats.tuning_failures) == (2, 1, 1, 1)
    assert stats.benchmarks == 5 and stats.benchmark_outcomes["ok"] == 1
    assert stats.benchmark_outcomes["error"] == 3 and stats.benchmark_outcomes["crashed"] == 1
    assert stats.benchmark_processes_started >= 1 and stats.benchmark_processes_lost == 1
    assert stats.benchmark_time.count == 5 and stats.benchmark_time.max > 0
    # The configurations are ordinary compiles: each distinct one once (failing's BLOCK=128
    # is kernel's), the chosen one's later requests answered by the cache.
    assert stats.compiled == 4 and stats.cache_hits == 3
    json.dumps(stats.to_dict())

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, sample.labels.get("outcome"))] = sample.value
    assert samples[("aiocompile_tunings_total", None)] == 2
    assert samples[("aiocompile_tunings_benchmarked_total", None)] == 1
    assert samples[("aiocompile_tuning_hits_total", None)] == 1
    assert samples[("aiocompile_tuning_failures_total", None)] == 1
    assert samples[("aiocompile_benchmarks_total", "error")] == 3
    assert samples[("aiocompile_benchmarks_total", "crashed")] == 1
    assert samples[("aiocompile_benchmark_seconds_count", None)] == 5
    assert samples[("aiocompile_benchmark_processes_lost_total", None)] == 1


async def test_progress_covers_compiles_and_benchmarks(monkeypatch, stand_in_driver):
    pytest.importorskip("tqdm")
    torch = pytest.importorskip("torch")
    import tuning_kernels as tk

    terminal = TTY()
    monkeypatch.setattr("sys.stderr", terminal)
    kernel = tk.tuned([tk.config(64, cost=5), tk.config(128, cost=3)])
    async with _stand_in_tuning(aiocompile.Scheduler(workers=2)) as sched:
        await sched.autotune(kernel, torch.ones(4096), torch.empty(4096), 4096, 2.0, grid=tk.grid, progress=True)
    shown = terminal.getvalue()
    assert "tuning scale_base" in shown and "4/4" in shown  # two compiles, two benchmarks


def test_a_record_s_outcome_is_an_enum_that_reads_and_writes_as_its_string():
    import json

    from aiocompile.records import JobRecord, Outcome

    fields = dict(key="k", name="add", backend="triton", target="cuda:90", outcome=Outcome.COMPILED, error=None,
                  queued_at=1.0, started_at=1.5, finished_at=2.0, queue_wait=0.5, run_time=0.4, load_time=0.01,
                  total_time=1.0, stages=(("ttir", 0.1),), compiler_cache_hit=False, attempts=1, worker_pid=7,
                  worker_rss=1 << 20, artifact_size=4096)
    record = JobRecord(**fields)
    with pytest.raises(AttributeError):
        record.outcome = Outcome.ERROR  # type: ignore[misc]  # frozen
    assert record.outcome == "compiled" and {"compiled": 1}[record.outcome] == 1
    assert f"{record.outcome}" == str(record.outcome) == "compiled" and f"{record.outcome:>9}" == " compiled"
    data = record.to_dict()
    assert type(data["outcome"]) is str and json.loads(json.dumps(data))["outcome"] == "compiled"
    assert [outcome for outcome in Outcome if outcome.failed] == [Outcome.ERROR, Outcome.CRASHED, Outcome.TIMEOUT,
                                                                  Outcome.CLOSED]


def test_a_record_made_in_a_hurry_is_the_record_its_constructor_makes():
    """``JobRecord.make`` (one per request) takes exactly the dataclass's fields, with their
    defaults, and makes an equal, frozen record."""
    import dataclasses
    import inspect

    from aiocompile.records import JobRecord, Outcome

    parameters = inspect.signature(JobRecord.make).parameters
    fields = dataclasses.fields(JobRecord)
    assert list(parameters) == [field.name for field in fields]
    for field in fields:
        default = parameters[field.name].default
        assert default == (inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default)
    values = dict(key="k", name="add", backend="triton", target="cuda:90", outcome=Outcome.TIMEOUT, error="JobTimeout",
                  queued_at=1.0, started_at=1.5, finished_at=2.0, queue_wait=0.5, run_time=0.4, load_time=None,
                  total_time=1.0, stages=(("ttir", 0.1),), attempts=1, worker_pid=7)
    made = JobRecord.make(**values)
    assert made == JobRecord(**values) and made.to_dict() == JobRecord(**values).to_dict()
    assert made.worker_rss is None and made.artifact_size is None and made.compiler_cache_hit is None
    with pytest.raises(AttributeError):
        made.outcome = Outcome.ERROR  # type: ignore[misc]  # still frozen


async def test_a_run_s_record_is_in_every_read_right_after_its_await(async_runner):
    """Under asyncio, with nobody listening, a trivial run's record is made on the loop's
    next turn (while the caller's next job is on its way): every read of the metrics still
    has it as soon as the await returns, its times are the answer's, and without any read
    the loop's next turn makes it. A listener is told before the await returns."""
    async with aiocompile.Scheduler(workers=1) as sched:
        await sched.run(jobs.echo, 0)
        for i in range(1, 21):
            before = time.time()
            assert await sched.run(jobs.echo, i) == i
            returned = time.time()
            assert sched.statistics().outcomes["compiled"] == i + 1
            record = sched.records()[-1]
            assert record.outcome == "compiled" and before <= record.finished_at <= returned
        await sched.run(jobs.echo, 21)
        await anyio.sleep(0)
        await anyio.sleep(0)
        assert len(sched.port._metrics.records) == 22  # made by the loop, unread
        seen: list = []
        sched.subscribe(seen.append)
        await sched.run(jobs.echo, 22)
        assert [event.outcome for event in seen if isinstance(event, aiocompile.JobRecord)] == ["compiled"]
    assert sched.statistics().outcomes["compiled"] == 23



def test_records_left_for_a_drain_that_never_runs_do_not_pile_up():
    """A drain scheduled on a loop that stops before running it leaves the records
    waiting: past a bound they are made at once, each exactly once, and a read makes the
    rest."""
    from aiocompile._observe.metrics import Metrics

    metrics, made = Metrics(), []
    scheduled = [metrics.later(functools.partial(made.append, i)) for i in range(200)]
    assert scheduled[0] and not all(scheduled)
    assert len(metrics._later) <= 64 and len(made) >= 136 and made == list(range(len(made)))
    metrics.snapshot({})
    assert made == list(range(200))
