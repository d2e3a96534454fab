"""While a model compiles in the background, its eager calls run with fewer of torch's
intra-op threads where the caller's count would leave the compile no CPU
(``compile_in_background``'s ``eager_threads``): the count asked while a compile runs (and
for the call that starts it), the
caller's own after each call, and the caller's own again once the compile has ended."""

from __future__ import annotations

import asyncio

import pytest
from conftest import wait_until

torch = pytest.importorskip("torch")

import background_models  # noqa: E402  (needs torch)

import aiocompile  # noqa: E402
import aiocompile.torch as aiotorch  # noqa: E402
from aiocompile._torch.eager_threads import _openmp, limit_for, usable_cpus  # noqa: E402

TIMEOUT = 300


@pytest.mark.parametrize(("setting", "device", "threads", "cpus", "limit"), [
    ("auto", "cpu", 2, 2, 1),  # torch's default on 2 CPUs: one left for the compile
    ("auto", "cpu", 8, 8, 7),
    ("auto", "cpu", 16, 8, 7),  # more threads than CPUs
    ("auto", "cpu", 1, 2, None),  # a CPU left already
    ("auto", "cpu", 4, 8, None),
    ("auto", "cpu", 1, 1, None),  # one CPU: one thread is the least
    ("auto", "cuda", 8, 8, None),  # a GPU model's calls wait for the GPU, not for CPUs
    (None, "cpu", 2, 2, None),
    (1, "cpu", 4, 8, 1),
    (4, "cpu", 2, 8, None),  # never more than the caller's
    (2, "cuda", 4, 4, 2),
])
def test_the_threads_an_eager_call_gets_while_compiling(setting, device, threads, cpus, limit):
    assert limit_for(setting, device, threads, cpus) == limit


@pytest.mark.parametrize(("value", "error"), [("fast", ValueError), (0, ValueError), (-2, ValueError),
                                              (True, TypeError), (1.5, TypeError)])
def test_bad_eager_threads_are_refused_at_once(value, error):
    model, _ = background_models.make_mlp()
    with pytest.raises(error, match="eager_threads"):
        aiotorch.compile_in_background(model, eager_threads=value, disable=True)


@pytest.fixture(scope="module")
def sched():
    scheduler = aiocompile.Scheduler(config=aiocompile.SchedulerConfig(workers=1, preload=(aiotorch.PRELOAD,)))
    yield scheduler
    scheduler.close()


@pytest.fixture
def callers_threads():
    """This thread's torch thread count, put back after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("callers_threads")
@pytest.mark.parametrize(("setting", "callers", "while_compiling"), [
    (1, 2, 1),
    (None, 2, 2),
    ("auto", usable_cpus(), max(1, usable_cpus() - 1)),
], ids=["one", "none", "auto"])
def test_eager_calls_while_compiling_run_with_the_threads_asked_and_give_the_callers_back(
        sched, tmp_path, monkeypatch, setting, callers, while_compiling):
    if not _openmp(torch):
        pytest.skip("torch's threads here are not OpenMP's: their count is not the calling thread's own")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # The worker's C++ compiler waits for the test: the compile runs until it lets it go.
    gate = tmp_path / "gate"
    gate.mkdir()
    cxx = tmp_path / "gate-g++"
    cxx.write_text(f'#!/bin/sh\n: > "{gate}/started"\n'
                   f'while [ ! -e "{gate}/release" ]; do sleep 0.05; done\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    torch.set_num_threads(callers)
    torch.manual_seed(0)
    model, x = background_models.NotesThreads().eval(), torch.randn(4, 16)
    options = {"cpp.cxx": (None, str(cxx)), "aot_inductor.precompile_headers": False,
               "cpp_cache_precompile_headers": False}
    compiled = aiotorch.compile_in_background(model, options=options, scheduler=sched, eager_threads=setting)
    try:
        with torch.no_grad():
            compiled(x)  # the call that starts the compile
            assert torch.get_num_threads() == callers
            assert wait_until(lambda: (gate / "started").exists(), timeout=TIMEOUT)
            for _ in range(5):
                compiled(x)
                assert torch.get_num_threads() == callers
    finally:
        (gate / "release").touch()
    shape = asyncio.run(compiled.ready(x))
    assert shape.state == "compiled", shape.error
    with torch.no_grad():
        compiled(x)  # compiled: the model's forward does not run
    compiled(x)  # records autograd history: eager, no compile running
    assert torch.get_num_threads() == callers
    assert model.seen == [while_compiling] * 6 + [callers]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.usefixtures("callers_threads")
def test_calls_that_start_no_compile_keep_the_callers_threads(sched, tmp_path, monkeypatch):
    if not _openmp(torch):
        pytest.skip("torch's threads here are not OpenMP's: their count is not the calling thread's own")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.set_num_threads(2)
    # A wrapper made with disable=True compiles nothing: every call keeps the caller's.
    model = background_models.NotesThreads().eval()
    disabled = aiotorch.compile_in_background(model, scheduler=sched, eager_threads=1, disable=True)
    with torch.no_grad():
        for rows in (1, 2, 3):
            disabled(torch.randn(rows, 16))
    assert model.seen == [2, 2, 2]

    # Past max_signatures a new signature starts nothing either: once the one compile has
    # ended (here it fails: no such compiler), those calls keep the caller's too.
    model = background_models.NotesThreads().eval()
    broken = {"cpp.cxx": (None, str(tmp_path / "no-such-g++"))}
    compiled = aiotorch.compile_in_background(model, scheduler=sched, eager_threads=1, max_signatures=1,
                                              options=broken)
    x = torch.randn(4, 16)
    with torch.no_grad():
        compiled(x)  # starts the one compile
    assert asyncio.run(compiled.ready(x)).state == "failed"
    with torch.no_grad():
        for rows in (1, 2, 3):
            compiled(torch.randn(rows, 16))
    assert model.seen == [1, 2, 2, 2]
