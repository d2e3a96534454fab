"""Bad input raises ValueError/TypeError in the caller, at once, before any worker is involved."""

import pytest
from conftest import child_pids
from triton_kernels import ADD_SIGNATURE, add_kernel

import aiocompile

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
    ("timeout as text", dict(timeout="5"), ValueError),
    ("zero timeout", dict(timeout=0), ValueError),
    ("negative timeout", dict(timeout=-1.0), ValueError),
    ("timeout not a number", dict(timeout=float("nan")), ValueError),
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


@pytest.mark.parametrize("timeout", ["5", 0, -1, True, float("nan"), float("inf")])
async def test_a_bad_timeout_fails_its_own_call_and_nothing_else(timeout):
    async with aiocompile.Scheduler(workers=1) as sched:
        assert await sched.run(abs, -1) == 1  # a worker is up and idle: the fastest path
        with pytest.raises(ValueError, match="timeout"):
            await sched.run(abs, -2, timeout=timeout)
        with pytest.raises(ValueError, match="timeout"):
            await sched.compile_many([{"kernel": add_kernel, "signature": ADD_SIGNATURE,
                                       "constexprs": {"BLOCK": 64}, "target": "cuda:80", "timeout": timeout}])
        # The scheduler, its pool and its supervisor are as they were.
        assert await sched.run(abs, -3) == 3
        stats = sched.statistics()
        assert (stats.submitted, stats.failed, stats.worker_crashes) == (2, 0, 0)


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
           "AIOCOMPILE_MAX_WORKER_RSS": "1000000000", "AIOCOMPILE_IDLE_TIMEOUT": "30"}
    config = aiocompile.SchedulerConfig.from_env(env)
    assert (config.workers, config.timeout, config.max_crashes, config.start_method) == (3, 7.5, 4, "spawn")
    assert (config.cancel_running, config.max_worker_rss, config.idle_timeout) == ("kill", 10**9, 30.0)
    assert aiocompile.SchedulerConfig.from_env({}) == aiocompile.SchedulerConfig()
    for bad in (dict(cancel_running="maybe"), dict(max_worker_rss=0), dict(idle_timeout=-1)):
        with pytest.raises(ValueError):
            aiocompile.SchedulerConfig(**bad)
    with pytest.raises(ValueError):
        aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_WORKERS": "many"})


def test_the_cache_key_is_a_secret():
    config = aiocompile.SchedulerConfig(cache_key=b"hunter2-bytes")
    assert "hunter2" not in repr(config) and "cache_key" not in repr(config)
    assert aiocompile.SchedulerConfig(cache_key="text key").cache_key == "text key"
    env = aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_CACHE_KEY": " from the environment\n"})
    assert env.cache_key == "from the environment" and "environment" not in repr(env)
    assert aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_CACHE_KEY": ""}).cache_key is None
    for bad in (b"", "", 1234, bytearray(b"mutable")):
        with pytest.raises(ValueError) as raised:
            aiocompile.SchedulerConfig(cache_key=bad)
        assert "mutable" not in str(raised.value)  # the value stays out of the message
