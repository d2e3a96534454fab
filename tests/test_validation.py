"""Bad input raises ValueError/TypeError in the caller, at once, before any worker is involved.

A wrong type is a ``TypeError`` (a string or a bool where a number is meant, a float where
an integer is meant); a value of the right type that makes no sense (NaN, an infinity, out
of range, empty) a ``ValueError``; each message names the setting and the value.
"""

import concurrent.futures as cf
import os
import time
from dataclasses import fields

import anyio
import jobs
import pytest
from conftest import alive, child_pids
from triton_kernels import ADD_SIGNATURE, add_kernel

import aiocompile
from aiocompile._base.checks import MAX_SECONDS
from aiocompile._base.config import ENVIRONMENT, SETTINGS
from aiocompile._foreign.pool import ForeignPool
from aiocompile._pool.pool import WorkerPool
from aiocompile.backends.triton._targets import known_architectures

NAN, INF = float("nan"), float("inf")
NO_PRELOAD = aiocompile.SchedulerConfig(workers=1, preload=())

BAD_TIMEOUTS = [
    ("5", TypeError), (True, TypeError), (0, ValueError), (-1.0, ValueError), (NAN, ValueError),
    (INF, ValueError), (-INF, ValueError), (MAX_SECONDS * 2, ValueError),
]

BAD_CALLS = [
    # (what is wrong, keyword arguments, expected exception)
    ("signature is not a mapping", dict(signature=["*fp32"]), TypeError),
    ("unknown argument in signature", dict(signature={**ADD_SIGNATURE, "z_ptr": "*fp32"}), ValueError),
    ("missing argument type", dict(signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32"}), ValueError),
    ("unknown type string", dict(signature={**ADD_SIGNATURE, "n": "int32"}), ValueError),
    ("type that is not a string", dict(signature={**ADD_SIGNATURE, "n": 32}), TypeError),
    ("constexpr without a value", dict(signature={**ADD_SIGNATURE, "BLOCK": "constexpr"}, constexprs=None), ValueError),
    ("unknown constexpr", dict(constexprs={"BLOCK": 64, "OTHER": 1}), ValueError),
    ("unknown target string", dict(target="cuda:9x"), ValueError),
    ("unknown target backend", dict(target="metal:3"), ValueError),
    ("target of the wrong type", dict(target=90), TypeError),
    ("unknown option", dict(num_warp=4), TypeError),
    ("option of the wrong type", dict(num_warps="4"), TypeError),
    ("bool given for an int option", dict(num_stages=True), TypeError),
    ("num_warps not a power of two", dict(num_warps=3), ValueError),
    ("CUDA option for an AMD target", dict(target="hip:gfx942", maxnreg=128), TypeError),
    ("attrs for an unknown argument", dict(attrs={"q": [("tt.divisibility", 16)]}), ValueError),
    ("malformed attrs", dict(attrs={"x_ptr": ["tt.divisibility"]}), TypeError),
    ("unpicklable constexpr", dict(constexprs={"BLOCK": lambda: 1}), TypeError),
    ("an architecture Triton does not know", dict(target="cuda:99"), ValueError),
    ("an architecture far beyond any", dict(target="cuda:999"), ValueError),
    ("an AMD architecture Triton does not know", dict(target="hip:gfx9999"), ValueError),
    ("a backend Triton does not have", dict(target=aiocompile.Target("xpu", 1, 32)), ValueError),
    ("num_warps past any block", dict(num_warps=2**40), ValueError),
    ("more threads than a block holds", dict(num_warps=64), ValueError),
    ("more wave64 warps than a block holds", dict(target="hip:gfx942", num_warps=32), ValueError),
    ("num_stages past a C int", dict(num_stages=2**40), ValueError),
    ("nonsense warp size", dict(target="cuda:90:7"), ValueError),
    ("AMD warp size neither 32 nor 64", dict(target="hip:gfx942:48"), ValueError),
    ("timeout as text", dict(timeout="5"), TypeError),
    ("bool timeout", dict(timeout=True), TypeError),
    ("zero timeout", dict(timeout=0), ValueError),
    ("negative timeout", dict(timeout=-1.0), ValueError),
    ("timeout not a number", dict(timeout=NAN), ValueError),
    ("infinite timeout", dict(timeout=INF), ValueError),
    ("timeout past the longest", dict(timeout=MAX_SECONDS * 2), ValueError),
]


@pytest.mark.parametrize(("what", "kwargs", "exc"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
async def test_bad_input_raises_before_any_worker(what, kwargs, exc):
    call = {"signature": ADD_SIGNATURE, "constexprs": {"BLOCK": 64}, "target": "cuda:80", **kwargs}
    before = child_pids()
    sched = aiocompile.Scheduler(workers=1)
    try:
        with pytest.raises(exc):
            await sched.compile_triton(add_kernel, **call)
        assert sched.statistics().workers_started == 0
        assert child_pids() == before
    finally:
        await sched.aclose()


@pytest.fixture(scope="module")
def one_worker():
    """A scheduler with one worker, for the tests of bad timeouts, one after the other (each
    counts what its own calls did)."""
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    yield sched
    sched.close(grace=0)


@pytest.mark.parametrize(("timeout", "exc"), BAD_TIMEOUTS)
async def test_a_bad_timeout_fails_its_own_call_and_nothing_else(timeout, exc, one_worker):
    sched = one_worker
    before = sched.statistics()
    assert await sched.run(abs, -1) == 1  # a worker is up and idle: the fastest path
    with pytest.raises(exc, match="timeout"):
        await sched.run(abs, -2, timeout=timeout)
    with pytest.raises(exc, match="timeout"):
        await sched.compile_many([{"kernel": add_kernel, "signature": ADD_SIGNATURE,
                                   "constexprs": {"BLOCK": 64}, "target": "cuda:80", "timeout": timeout}])
    # The scheduler, its pool and its supervisor are as they were.
    assert await sched.run(abs, -3) == 3
    stats = sched.statistics()
    assert (stats.submitted - before.submitted, stats.failed - before.failed,
            stats.worker_crashes - before.worker_crashes) == (2, 0, 0)


@pytest.mark.parametrize("target", ["cuda:99", "cuda:999", "hip:gfx9999"])
async def test_an_architecture_triton_does_not_know_is_refused_naming_those_it_does(target):
    backend = target.partition(":")[0]
    known = known_architectures(backend)
    assert known and f"{backend}:{'90' if backend == 'cuda' else 'gfx942'}" in known and target not in known
    async with aiocompile.Scheduler(workers=1) as sched:
        with pytest.raises(ValueError, match=f"unknown .* architecture in target {target}") as info:
            await sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64}, target=target)
        assert f"compiles for {', '.join(known)}" in str(info.value)
        with pytest.raises(ValueError, match=f"unknown .* architecture in target {target}"):
            await sched.warm(target)
        with pytest.raises(ValueError, match=f"unknown .* architecture in target {target}"):
            await sched.warmup(add_kernel, "fp32", "fp32", "fp32", 1024, BLOCK=64, target=target)
        stats = sched.statistics()
        assert (stats.workers_started, stats.submitted) == (0, 0)


@pytest.mark.skipif(os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd"), reason="this machine has a GPU")
async def test_without_a_gpu_the_current_device_is_refused_with_a_reason():
    async with aiocompile.Scheduler(workers=1) as sched:
        # Said, rather than warming some other target, or Triton's "0 active drivers".
        with pytest.raises(ValueError, match="target=None means the current GPU.*explicit target"):
            await sched.warm(None)
        with pytest.raises(ValueError, match="target=None means the current GPU.*explicit target"):
            await sched.warmup(add_kernel, "fp32", "fp32", "fp32", 1024, BLOCK=64)
        assert sched.statistics().submitted == 0


async def test_compile_many_takes_flags_as_flags():
    async with aiocompile.Scheduler(workers=1) as sched:
        with pytest.raises(TypeError, match="progress must be True or False"):
            await sched.compile_many([], progress="yes")
        with pytest.raises(TypeError, match="return_exceptions must be True or False"):
            await sched.compile_many([], return_exceptions=1)
        assert sched.statistics().workers_started == 0


async def test_looking_for_the_current_gpu_is_not_counted_as_a_request():
    async with aiocompile.Scheduler(workers=1) as sched:
        try:
            await sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64}, target=None)
        except ValueError as exc:  # no GPU here
            assert "explicit target" in str(exc)
            expected = []
        else:
            expected = ["add_kernel"]
        assert [record.name for record in sched.records()] == expected
        stats = sched.statistics()
        assert (stats.submitted, stats.failed) == (len(expected), 0)


async def test_not_a_kernel():
    sched = aiocompile.Scheduler(workers=1)
    try:
        with pytest.raises(TypeError):
            await sched.compile_triton(lambda x: x, signature={"x": "i32"}, target="cuda:80")
        with pytest.raises(TypeError):
            await sched.compile_triton("add_kernel", signature={"x": "i32"}, target="cuda:80")
        assert sched.statistics().workers_started == 0
    finally:
        await sched.aclose()


def test_triton_source_is_checked_when_made():
    with pytest.raises(ValueError):
        aiocompile.TritonSource("def broken(:\n", "broken")
    with pytest.raises(ValueError):
        aiocompile.TritonSource("import triton\n", "missing")
    with pytest.raises(ValueError):
        aiocompile.TritonSource("def k(x): pass\n", "not an identifier")
    with pytest.raises(TypeError):
        aiocompile.TritonSource(b"def k(x): pass\n", "k")


def test_config_rejects_nonsense():
    for bad in (dict(workers=0), dict(timeout=-1), dict(max_crashes=0), dict(start_method="thread")):
        with pytest.raises(ValueError):
            aiocompile.SchedulerConfig(**bad)


def test_config_from_env():
    env = {"AIOCOMPILE_WORKERS": "3", "AIOCOMPILE_TIMEOUT": "7.5", "AIOCOMPILE_MAX_CRASHES": "4",
           "AIOCOMPILE_START_METHOD": "spawn", "AIOCOMPILE_CANCEL_RUNNING": "kill",
           "AIOCOMPILE_MAX_WORKER_RSS": "1000000000", "AIOCOMPILE_IDLE_TIMEOUT": "30",
           "AIOCOMPILE_BENCHMARK_TIMEOUT": "12", "AIOCOMPILE_TUNING_DEVICES": "2, 0",
           "AIOCOMPILE_BENCHMARK_AT_START": "1", "AIOCOMPILE_TUNING_SCREEN": "1.5"}
    config = aiocompile.SchedulerConfig.from_env(env)
    assert config.tuning_screen == 1.5 and aiocompile.SchedulerConfig().tuning_screen == 1.25
    for off in ("off", "0", "none"):
        assert aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_TUNING_SCREEN": off}).tuning_screen is None
    assert config.benchmark_at_start is True and aiocompile.SchedulerConfig().benchmark_at_start is False
    assert (config.workers, config.timeout, config.max_crashes, config.start_method) == (3, 7.5, 4, "spawn")
    assert (config.benchmark_timeout, config.tuning_devices) == (12.0, (2, 0))
    assert (config.cancel_running, config.max_worker_rss, config.idle_timeout) == ("kill", 10**9, 30.0)
    assert aiocompile.SchedulerConfig.from_env({}) == aiocompile.SchedulerConfig()
    for bad in (dict(cancel_running="maybe"), dict(max_worker_rss=0), dict(idle_timeout=-1)):
        with pytest.raises(ValueError):
            aiocompile.SchedulerConfig(**bad)
    with pytest.raises(ValueError):
        aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_WORKERS": "many"})


# -- the configuration --------------------------------------------------------------------

BAD_SETTINGS = [
    # (field, value, expected exception)
    ("workers", 0, ValueError), ("workers", -1, ValueError), ("workers", 1.5, TypeError),
    ("workers", True, TypeError), ("workers", "4", TypeError), ("workers", None, TypeError),
    ("timeout", INF, ValueError), ("timeout", NAN, ValueError), ("timeout", 0, ValueError),
    ("timeout", -1, ValueError), ("timeout", MAX_SECONDS + 1, ValueError), ("timeout", "5", TypeError),
    ("timeout", True, TypeError),
    ("max_crashes", 0, ValueError), ("max_crashes", 1.5, TypeError), ("max_crashes", False, TypeError),
    ("start_method", "thread", ValueError), ("start_method", 3, TypeError),
    ("preload", "aiocompile", TypeError), ("preload", (3,), TypeError), ("preload", ("not a module!",), ValueError),
    ("cache_entries", -1, ValueError), ("cache_entries", 1.5, TypeError), ("cache_entries", True, TypeError),
    ("cache_entries", INF, TypeError),
    ("cache_bytes", -1, ValueError), ("cache_bytes", 1.5, TypeError), ("cache_bytes", "1", TypeError),
    ("error_ttl", -1, ValueError), ("error_ttl", NAN, ValueError), ("error_ttl", INF, ValueError),
    ("error_ttl", "2", TypeError), ("error_ttl", None, TypeError),
    ("cache_dir", "", ValueError), ("cache_dir", "  ", ValueError), ("cache_dir", 3, TypeError),
    ("cache_dir", b"/tmp/x", TypeError),
    ("cache_dir_bytes", 0, ValueError), ("cache_dir_bytes", 1.5, TypeError),
    ("close_grace", NAN, ValueError), ("close_grace", INF, ValueError), ("close_grace", -1, ValueError),
    ("close_grace", "5", TypeError), ("close_grace", None, TypeError),
    ("cancel_running", "maybe", ValueError), ("cancel_running", True, TypeError),
    ("max_worker_rss", 0, ValueError), ("max_worker_rss", 1.5, TypeError), ("max_worker_rss", INF, TypeError),
    ("idle_timeout", INF, ValueError), ("idle_timeout", NAN, ValueError), ("idle_timeout", 0, ValueError),
    ("idle_timeout", -1, ValueError), ("idle_timeout", MAX_SECONDS * 10, ValueError),
    ("idle_timeout", "30", TypeError), ("idle_timeout", True, TypeError),
    ("worker_nice", 20, ValueError), ("worker_nice", -1, ValueError), ("worker_nice", True, TypeError),
    ("worker_nice", 1.5, TypeError), ("worker_idle", 1, TypeError), ("worker_idle", "yes", TypeError),
    ("metrics", 1, TypeError), ("metrics", "yes", TypeError), ("metrics", None, TypeError),
    ("event_log", "", ValueError), ("event_log", 3, TypeError),
    ("cost_history", "", ValueError), ("cost_history", 3, TypeError),
    ("cache_key", b"", ValueError), ("cache_key", "", ValueError), ("cache_key", 1234, TypeError),
    ("benchmark_timeout", 0, ValueError), ("benchmark_timeout", INF, ValueError),
    ("benchmark_timeout", "60", TypeError),
    ("tuning_devices", (), ValueError), ("tuning_devices", (0, 0), ValueError), ("tuning_devices", (-1,), ValueError),
    ("tuning_devices", 0, TypeError), ("tuning_devices", (True,), TypeError), ("tuning_devices", "0,1", TypeError),
    ("benchmark_at_start", 1, TypeError), ("benchmark_at_start", None, TypeError),
    ("tuning_screen", 0.9, ValueError), ("tuning_screen", INF, ValueError), ("tuning_screen", "1.2", TypeError),
    ("cache_url", "http://:s3cret@cache/", ValueError), ("cache_url", "redis://:s3cret@", ValueError),
    ("cache_url", b"redis://:s3cret@cache", TypeError),
    ("cache_url_ttl", 0, ValueError), ("cache_url_ttl", "60", TypeError),
    ("cache_url_entry_bytes", 0, ValueError), ("cache_url_entry_bytes", 1.5, TypeError),
    ("cache_dir_entry_bytes", 0, ValueError), ("cache_dir_entry_bytes", None, TypeError),
    ("cache_url_timeout", 0, ValueError), ("cache_url_timeout", 61, ValueError), ("cache_url_timeout", None, TypeError),
    ("cache_url_retry", INF, ValueError), ("cache_url_retry", True, TypeError),
    ("repro_dir", "", ValueError), ("repro_dir", 3, TypeError), ("repro_dir", False, TypeError),
    ("repro_keep", 0, ValueError), ("repro_keep", 1.5, TypeError), ("repro_keep", None, TypeError),
    ("repro_dir_bytes", 0, ValueError), ("repro_dir_bytes", "1", TypeError),
]


def test_every_setting_is_checked_by_a_rule():
    assert set(SETTINGS) == {f.name for f in fields(aiocompile.SchedulerConfig)}
    assert {name for _, name in ENVIRONMENT} <= set(SETTINGS)
    assert {field for field, _, _ in BAD_SETTINGS} == set(SETTINGS)  # the table below covers them all


@pytest.mark.parametrize(("field", "value", "exc"), BAD_SETTINGS,
                         ids=[f"{field}={value!r}" for field, value, _ in BAD_SETTINGS])
def test_a_bad_setting_is_refused_naming_itself_and_its_value(field, value, exc):
    with pytest.raises(exc) as info:
        aiocompile.SchedulerConfig(**{field: value})
    assert type(info.value) is exc
    assert field in str(info.value)
    if field == "cache_key":
        assert "1234" not in str(info.value)  # a secret: its value stays out of messages
    elif field == "cache_url":
        assert "s3cret" not in str(info.value)  # nor does a URL's password
    else:
        assert repr(value) in str(info.value)
    if value is not None:
        with pytest.raises(exc):
            aiocompile.SchedulerConfig().with_changes(**{field: value})


@pytest.mark.parametrize("field", ["timeout", "idle_timeout", "max_worker_rss"])
def test_a_limit_too_large_says_how_to_ask_for_none(field):
    value = INF if field != "max_worker_rss" else 0
    with pytest.raises(ValueError, match="use None for no limit"):
        aiocompile.SchedulerConfig(**{field: value})
    with pytest.raises(ValueError, match="use None for no limit"):
        aiocompile.SchedulerConfig(**{field: MAX_SECONDS + 1 if field != "max_worker_rss" else -1})


def test_settings_are_kept_in_one_form(tmp_path):
    config = aiocompile.SchedulerConfig(cache_dir=tmp_path, event_log=tmp_path / "e.jsonl", preload=["jobs"],
                                        timeout=5, idle_timeout=MAX_SECONDS, close_grace=0)
    assert (config.cache_dir, config.event_log, config.preload) == (str(tmp_path), str(tmp_path / "e.jsonl"),
                                                                    ("jobs",))
    assert (config.timeout, config.idle_timeout, config.close_grace) == (5, MAX_SECONDS, 0)
    assert aiocompile.SchedulerConfig(cache_bytes=None, cache_dir_bytes=None, max_worker_rss=None).cache_bytes is None


BAD_ENVIRONMENT = [
    ("AIOCOMPILE_TIMEOUT", "inf"), ("AIOCOMPILE_TIMEOUT", "nan"), ("AIOCOMPILE_TIMEOUT", "soon"),
    ("AIOCOMPILE_TIMEOUT", "-5"), ("AIOCOMPILE_IDLE_TIMEOUT", "inf"), ("AIOCOMPILE_IDLE_TIMEOUT", "0"),
    ("AIOCOMPILE_WORKERS", "1.5"), ("AIOCOMPILE_WORKERS", "0"), ("AIOCOMPILE_MAX_CRASHES", "0"),
    ("AIOCOMPILE_MAX_WORKER_RSS", "0"), ("AIOCOMPILE_CACHE_DIR_BYTES", "-1"), ("AIOCOMPILE_WORKER_NICE", "20"),
    ("AIOCOMPILE_WORKER_IDLE", "sometimes"),
    ("AIOCOMPILE_METRICS", "maybe"), ("AIOCOMPILE_START_METHOD", "thread"), ("AIOCOMPILE_CANCEL_RUNNING", "maybe"),
    ("AIOCOMPILE_BENCHMARK_TIMEOUT", "0"), ("AIOCOMPILE_TUNING_DEVICES", "0,x"), ("AIOCOMPILE_TUNING_DEVICES", "1,1"),
    ("AIOCOMPILE_BENCHMARK_AT_START", "sometimes"), ("AIOCOMPILE_TUNING_SCREEN", "0.5"),
    ("AIOCOMPILE_TUNING_SCREEN", "wide"),
    ("AIOCOMPILE_CACHE_URL", "http://cache/"), ("AIOCOMPILE_CACHE_URL_TIMEOUT", "0"),
    ("AIOCOMPILE_CACHE_URL_TTL", "never"),
    ("AIOCOMPILE_REPRO_KEEP", "0"), ("AIOCOMPILE_REPRO_DIR_BYTES", "lots"),
]


@pytest.mark.parametrize(("variable", "text"), BAD_ENVIRONMENT)
def test_a_bad_environment_variable_is_refused_naming_itself_and_its_value(variable, text):
    with pytest.raises(ValueError) as info:
        aiocompile.SchedulerConfig.from_env({variable: text})
    assert variable in str(info.value) and repr(text) in str(info.value)


BAD_SCHEDULER_ARGUMENTS = [
    (dict(workers=0), ValueError), (dict(workers=True), TypeError), (dict(workers=2.0), TypeError),
    (dict(timeout=INF), ValueError), (dict(timeout="5"), TypeError), (dict(max_crashes=0), ValueError),
    (dict(start_method="thread"), ValueError), (dict(cancel_running="maybe"), ValueError),
    (dict(cache_dir=""), ValueError), (dict(cache_dir=3), TypeError), (dict(event_log=""), ValueError),
    (dict(on_event=5), TypeError), (dict(config="workers=2"), TypeError), (dict(executor=5), TypeError),
    (dict(executor=cf.ThreadPoolExecutor, max_crashes=0), ValueError),
]


@pytest.mark.parametrize(("kwargs", "exc"), BAD_SCHEDULER_ARGUMENTS, ids=[repr(k) for k, _ in BAD_SCHEDULER_ARGUMENTS])
def test_bad_scheduler_arguments_are_refused_before_anything_starts(kwargs, exc):
    before = child_pids()
    with pytest.raises(exc) as info:
        aiocompile.Scheduler(**kwargs)
    assert type(info.value) is exc
    assert not (child_pids() - before)  # nothing started


# -- the coroutines' arguments --------------------------------------------------------------

CALLS = {
    "compile_triton": lambda sched, timeout: sched.compile_triton(
        add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64}, target="cuda:80", timeout=timeout),
    "compile_many": lambda sched, timeout: sched.compile_many([
        {"kernel": add_kernel, "signature": ADD_SIGNATURE, "constexprs": {"BLOCK": 64}, "target": "cuda:80",
         "timeout": timeout}]),
    "run": lambda sched, timeout: sched.run(abs, -1, timeout=timeout),
    "warmup": lambda sched, timeout: sched.warmup(add_kernel, 1, 2, 3, 4, BLOCK=64, target="cuda:80",
                                                  timeout=timeout),
    "inductor_triton": lambda sched, timeout: sched.inductor_triton("kernel", "source", timeout=timeout),
}


async def _still_serving(sched):
    """The scheduler answers a good request after the bad ones, its supervisor alive."""
    assert not sched.closed
    with anyio.fail_after(60):
        assert await sched.run(abs, -7) == 7
    stats = sched.statistics()
    assert (stats.submitted, stats.failed, stats.workers_started) == (1, 0, 1)


@pytest.mark.parametrize("call", list(CALLS))
async def test_a_bad_timeout_is_refused_by_every_coroutine_before_anything_counts(call):
    before = child_pids()
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    try:
        for timeout, exc in BAD_TIMEOUTS:
            with pytest.raises(exc, match="timeout") as info:
                await CALLS[call](sched, timeout)
            assert repr(timeout) in str(info.value)
        stats = sched.statistics()
        assert (stats.submitted, stats.workers_started) == (0, 0)
        assert not (child_pids() - before)  # nothing started
        await _still_serving(sched)
    finally:
        await sched.aclose()


async def test_run_refuses_what_is_not_callable_before_anything_counts():
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    try:
        for fn in (5, None, "abs"):
            with pytest.raises(TypeError, match="fn must be callable") as info:
                await sched.run(fn)
            assert repr(fn) in str(info.value)
        assert sched.records() == []
        stats = sched.statistics()
        assert (stats.submitted, stats.failed, stats.workers_started) == (0, 0, 0)
        await _still_serving(sched)
    finally:
        await sched.aclose()


@pytest.mark.parametrize(("grace", "exc"), [(NAN, ValueError), ("1", TypeError), (-1, ValueError),
                                            (INF, ValueError), (True, TypeError)])
async def test_aclose_with_a_bad_grace_raises_at_once_and_a_later_aclose_closes(grace, exc):
    before = child_pids()
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    assert await sched.run(abs, -1) == 1
    mine = child_pids() - before  # its fork server and worker
    assert mine
    with anyio.fail_after(10):
        with pytest.raises(exc, match="grace"):
            await sched.aclose(grace=grace)
    with pytest.raises(exc, match="grace"):
        sched.close(grace=grace)
    assert not sched.closed
    with anyio.fail_after(60):
        assert await sched.run(abs, -2) == 2
        await sched.aclose()
    assert sched.closed and not alive(mine)


# -- the pools ----------------------------------------------------------------------------

BAD_POOL_ARGUMENTS = [
    (dict(max_workers=0), ValueError), (dict(max_workers=True), TypeError), (dict(max_workers=1.5), TypeError),
    (dict(max_crashes=0), ValueError), (dict(max_crashes="2"), TypeError), (dict(idle_timeout=INF), ValueError),
    (dict(idle_timeout=NAN), ValueError), (dict(idle_timeout=0), ValueError), (dict(max_worker_rss=0), ValueError),
    (dict(worker_nice=20), ValueError), (dict(worker_nice=True), TypeError), (dict(start_method="thread"), ValueError),
    (dict(preload="jobs"), TypeError),
]


@pytest.mark.parametrize(("kwargs", "exc"), BAD_POOL_ARGUMENTS, ids=[repr(k) for k, _ in BAD_POOL_ARGUMENTS])
def test_a_pool_refuses_bad_arguments(kwargs, exc):
    kwargs = {"max_workers": 1, **kwargs}
    with pytest.raises(exc) as info:
        WorkerPool(kwargs.pop("max_workers"), **kwargs)
    assert type(info.value) is exc


def test_a_pool_refuses_bad_job_and_shutdown_arguments_and_carries_on():
    pool = WorkerPool(1)
    try:
        assert pool.submit(abs, -1).result(timeout=60) == 1
        for bad, exc in ((dict(max_crashes=0), ValueError), (dict(max_crashes=1.5), TypeError),
                         (dict(timeout=INF), ValueError)):
            with pytest.raises(exc):
                pool.submit_job(abs, (-2,), **bad)
        for grace, exc in ((NAN, ValueError), ("1", TypeError), (INF, ValueError)):
            with pytest.raises(exc, match="grace"):
                pool.shutdown(grace=grace)
        assert not pool.closed
        assert pool.submit(abs, -3).result(timeout=60) == 3
    finally:
        pool.shutdown(grace=1)
    assert pool.closed


def test_a_foreign_pool_refuses_bad_arguments():
    with cf.ThreadPoolExecutor(1) as executor:
        for bad, exc in ((0, ValueError), (True, TypeError), (2.0, TypeError)):
            with pytest.raises(exc, match="max_crashes"):
                ForeignPool(executor, max_crashes=bad)
        pool = ForeignPool(executor)
        with pytest.raises(ValueError, match="timeout"):
            pool.submit_job(abs, (-1,), timeout=INF)
        with pytest.raises(ValueError, match="grace"):
            pool.shutdown(grace=NAN)
        assert pool.submit_job(abs, (-1,)).future.result(timeout=60) == 1
        pool.shutdown()


# -- durations at their extremes ------------------------------------------------------------


async def test_durations_at_their_largest_work():
    config = aiocompile.SchedulerConfig(workers=1, preload=(), timeout=MAX_SECONDS, idle_timeout=MAX_SECONDS,
                                        close_grace=MAX_SECONDS, error_ttl=MAX_SECONDS)
    sched = aiocompile.Scheduler(config=config)
    with anyio.fail_after(60):
        assert await sched.run(abs, -1) == 1
        # The supervisor now waits for the idle worker's deadline, MAX_SECONDS away.
        await anyio.sleep(0.3)
        assert await sched.run(jobs.sleep_then, 0.2, 2, timeout=MAX_SECONDS) == 2
        await sched.aclose(grace=MAX_SECONDS)
    stats = sched.statistics()
    assert (stats.submitted, stats.failed, stats.workers_started, stats.worker_crashes) == (2, 0, 1, 0)


async def test_durations_at_their_smallest_work():
    config = aiocompile.SchedulerConfig(workers=1, preload=(), idle_timeout=1e-6, close_grace=0)
    sched = aiocompile.Scheduler(config=config)
    try:
        with anyio.fail_after(60):
            assert await sched.run(abs, -1) == 1
            while sched.statistics().workers_idle_stopped < 1:
                await anyio.sleep(0.01)
            assert await sched.run(abs, -2) == 2  # on a new worker
            with pytest.raises(aiocompile.JobTimeout):
                await sched.run(time.sleep, 30, timeout=1e-9)
            assert await sched.run(abs, -3) == 3
        stats = sched.statistics()
        assert stats.workers_started >= 2 and stats.timeouts == 1 and stats.worker_crashes == 0
    finally:
        with anyio.fail_after(60):
            await sched.aclose()


def test_the_cache_key_is_a_secret():
    config = aiocompile.SchedulerConfig(cache_key=b"hunter2-bytes")
    assert "hunter2" not in repr(config) and "cache_key" not in repr(config)
    assert aiocompile.SchedulerConfig(cache_key="text key").cache_key == "text key"
    env = aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_CACHE_KEY": " from the environment\n"})
    assert env.cache_key == "from the environment" and "environment" not in repr(env)
    assert aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_CACHE_KEY": ""}).cache_key is None
    for bad, exc in ((b"", ValueError), ("", ValueError), (1234, TypeError), (bytearray(b"mutable"), TypeError)):
        with pytest.raises(exc) as raised:
            aiocompile.SchedulerConfig(cache_key=bad)
        assert "mutable" not in str(raised.value) and "1234" not in str(raised.value)  # the value stays out
