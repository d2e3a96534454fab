"""autotune()'s plan is Triton's own: the same key, the same configurations after pruning,
the same specialisation for each, checked against Triton's autotuner and JIT running on
the same kernels and arguments. A stand-in driver reports an H100, so Triton's real code
runs here; its benchmarking and launching are replaced by recorders, nothing else."""

import copy
import sys

import pytest
import tuning_kernels as tk
from tuning_stand_in import StandInDriver

from aiocompile._tuning import plan as _plan
from aiocompile._tuning.inputs import InputCollector, rebuild

torch = pytest.importorskip("torch", reason="launch arguments are torch tensors")


@pytest.fixture(autouse=True)
def stand_in_driver():
    from triton.runtime import driver

    previous = driver._active
    driver.set_active(StandInDriver())
    try:
        yield
    finally:
        driver._active = previous
        for kernel in (tk.scale_base, tk.masked_base, tk.accumulate_base):
            kernel.device_caches.clear()


class Recorder:
    def __init__(self):
        self.calls = []

    def run(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def triton_tunes(kernel, args, kwargs, grid):
    """Run Triton's own launch path on copies of the chain: the autotuner with a fresh
    cache and a benchmarker that only calls the kernel, the JIT function replaced by a
    recorder. Returns Triton's key, and what the JIT would have been run with for each
    configuration it benchmarked, in order."""
    links, current = [], kernel
    while hasattr(current, "fn") and not hasattr(current, "device_caches"):
        links.append(copy.copy(current))
        current = current.fn
    recorder = Recorder()
    for upper, lower in zip(links, links[1:] + [recorder]):
        upper.fn = lower
    tuner = next(link for link in links if type(link).__name__ == "Autotuner")
    tuner.cache = {}
    tuner.__dict__["do_bench"] = lambda kernel_call, quantiles: (kernel_call(), [1.0, 1.0, 1.0])[1]
    links[0].run(*args, grid=grid, warmup=False, **kwargs)
    (key,) = tuner.cache
    benchmarked = recorder.calls[:-1]  # the last is the launch with the configuration chosen
    return key, benchmarked


def jit_key(jit, args, kwargs):
    """The JIT's own key for a launch, as its compile hook reports it."""
    from triton import knobs

    seen = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["key"]) or True  # True: skip the compile
    saved = dict(jit.device_caches)
    try:
        jit.device_caches.clear()
        jit.warmup(*args, **kwargs)
    finally:
        knobs.runtime.jit_cache_hook = previous
        jit.device_caches.clear()
        jit.device_caches.update(saved)
    (key,) = seen
    return key


x = torch.randn(4096)
out = torch.empty(4096)
half = torch.randn(5000, dtype=torch.float16)

CASES = {
    "plain": (tk.tuned([tk.config(b, num_warps=w) for b in (64, 128) for w in (2, 4)]), (x, out, 4096, 2.0), {}),
    "a dtype in the key": (tk.tuned([tk.config(64), tk.config(128)]), (half, half, 5000, 0.5), {}),
    "n equal to 1": (tk.tuned([tk.config(64), tk.config(128)]), (x, out, 1, 2.0), {}),
    "keywords": (tk.tuned([tk.config(64), tk.config(256, num_stages=2)]), (x,),
                 {"out_ptr": out, "n": 4000, "factor": 3}),
    "heuristics below": (tk.inner_heuristics, (x, out, 4096), {}),
    "heuristics below, uneven": (tk.inner_heuristics, (x, out, 1000), {}),
    "heuristics above": (tk.outer_heuristics, (x, out, 20_000), {}),
    "early_config_prune": (tk.pruned_early, (x, out, 1024, 1.0), {}),
    "perf_model and top_k": (tk.pruned_by_model, (x, out, 8192, 1.0), {}),
    "both, top_k a fraction": (tk.pruned_both, (x, out, 4096, 1.0), {}),
    "reset_to_zero": (tk.accumulate, (x, torch.zeros(1), 4096), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_key_pruning_and_specialisations_are_tritons(case):
    kernel, args, kwargs = CASES[case]
    kernel_cache = dict(getattr(kernel, "cache", {}) or getattr(kernel.fn, "cache", {}))
    plan = _plan.plan(kernel, args, kwargs, tk.grid, 0)
    key, benchmarked = triton_tunes(kernel, args, kwargs, tk.grid)

    assert plan.key == key
    assert plan.tunes
    # The configurations Triton benchmarks, in its order, and for each what its JIT is
    # run with: the same specialisation, so the same JIT key.
    jit = plan.chain.jit
    assert len(plan.configs) == len(benchmarked)
    for planned, (jit_args, jit_kwargs) in zip(plan.configs, benchmarked):
        expected = {k: v for k, v in jit_kwargs.items() if k not in ("grid", "warmup")}
        for name, value in planned.config.all_kwargs().items():
            assert expected[name] == value
        assert planned.spec.jit_key == jit_key(jit, jit_args, {"grid": (1,), **expected})
        # The grid as the JIT would compute it from the bound arguments.
        assert planned.grid == (-(-planned.spec.bound_args["n"] // planned.spec.bound_args["BLOCK"]), 1, 1)
    # The caller's autotuner is untouched.
    tuner = plan.chain.tuner
    assert tuner.cache == kernel_cache and getattr(tuner, "nargs", None) is None


def test_pruning_matches_tritons_count():
    plan = _plan.plan(tk.pruned_early, (x, out, 1024, 1.0), {}, tk.grid, 0)
    assert [c.config.kwargs["BLOCK"] for c in plan.configs] == [64, 64, 128, 128, 256, 256]
    assert plan.pruned_away == 4
    plan = _plan.plan(tk.pruned_by_model, (x, out, 8192, 1.0), {}, tk.grid, 0)
    assert len(plan.configs) == 3 and plan.pruned_away == 7


def test_the_decision_key_follows_what_makes_a_decision_valid():
    kernel = tk.tuned([tk.config(64), tk.config(128)])
    base = _plan.plan(kernel, (x, out, 4096, 2.0), {}, tk.grid, 0).decision_key("H100")
    # The specialisation is not in it (Triton keeps one choice per key too)...
    assert _plan.plan(kernel, (x, out, 4096, 7.0), {}, tk.grid, 0).decision_key("H100") == base
    # ...the key, the device model and the configurations are.
    assert _plan.plan(kernel, (x, out, 8192, 2.0), {}, tk.grid, 0).decision_key("H100") != base
    assert _plan.plan(kernel, (x, out, 4096, 2.0), {}, tk.grid, 0).decision_key("H200") != base
    other = tk.tuned([tk.config(64), tk.config(256)])
    assert _plan.plan(other, (x, out, 4096, 2.0), {}, tk.grid, 0).decision_key("H100") != base


def test_one_configuration_is_nothing_to_tune():
    plan = _plan.plan(tk.tuned([tk.config(64)]), (x, out, 4096, 2.0), {}, tk.grid, 0)
    assert plan.key is None and not plan.tunes and len(plan.configs) == 1
    # Pruned to one: the key is the autotuner's, and there is nothing to time.
    kernel = tk.tuned([tk.config(64), tk.config(128)], prune_configs_by={"perf_model": tk._model, "top_k": 1})
    plan = _plan.plan(kernel, (x, out, 260, 1.0), {}, tk.grid, 0)
    assert plan.key == (260, "torch.float32", "torch.float32") and not plan.tunes and len(plan.configs) == 1


def test_hooks_and_timing_settings_travel():
    plan = _plan.plan(tk.accumulate, (x, torch.zeros(1), 4096), {}, tk.grid, 0)
    assert plan.hooks.reset_to_zero == ("total_ptr",) and plan.hooks.pre_hook is None
    assert plan.hooks.timing == ("default",)
    with pytest.warns(DeprecationWarning):
        legacy = tk.tuned([tk.config(64), tk.config(128)], warmup=5, rep=20)
    assert _plan.plan(legacy, (x, out, 4096, 2.0), {}, tk.grid, 0).hooks.timing == ("do_bench", 5, 20)


def test_hooks_that_cannot_travel_are_refused():
    kernel = tk.tuned([tk.config(64), tk.config(128)], pre_hook=lambda nargs, reset_only=False: None)
    with pytest.raises(TypeError, match="pre_hook must pickle"):
        _plan.plan(kernel, (x, out, 4096, 2.0), {}, tk.grid, 0)


def test_conflicting_meta_parameters_are_refused_as_triton_refuses_them():
    kernel = tk.tuned([tk.config(64), tk.config(128)])
    with pytest.raises(ValueError, match="Conflicting meta-parameters: BLOCK"):
        _plan.plan(kernel, (x, out, 4096, 2.0), {"BLOCK": 32}, tk.grid, 0)


# -- the tensors, as a benchmark process rebuilds them ------------------------------------------


def test_tensors_travel_with_values_strides_aliasing_and_alignment():
    base = torch.arange(1000, dtype=torch.float32)
    matrix = torch.arange(600, dtype=torch.float16).reshape(20, 30)
    views = [base[3:500], base[10:], matrix.t(), matrix[::2, 1:], torch.zeros(0)]
    collector = InputCollector()
    refs = [collector.ref(v) for v in views]
    assert collector.ref(views[0]) == refs[0]  # one tensor, one view
    inputs = collector.finish()
    assert len(inputs.buffers) == 3  # base's two views share one buffer
    rebuilt = rebuild(inputs, "cpu")
    for original, ref in zip(views, refs):
        copy_ = rebuilt[ref[1]]
        assert copy_.dtype == original.dtype and copy_.shape == original.shape
        assert copy_.stride() == original.stride()
        assert torch.equal(copy_, original)
        assert copy_.data_ptr() % 16 == original.data_ptr() % 16
    # Views of one storage still alias there.
    rebuilt[refs[0][1]][7] = -1.0
    assert rebuilt[refs[1][1]][0] == -1.0  # base[10] is base[3:][7]


def test_values_that_cannot_travel():
    collector = InputCollector()
    assert collector.ref(lambda meta: (1,), hook=True) == ("none",)
    assert collector.ref(3) == ("value", 3) and collector.ref(None, constant=True) == ("none",)
    with pytest.raises(TypeError, match="does not pickle"):
        collector.ref(lambda: 0)


# -- a benchmark process's life ------------------------------------------------------------------


def test_a_benchmark_process_moves_only_as_its_table_allows():
    from aiocompile._pool.state import InvalidTransition
    from aiocompile._tuning.benchproc import TRANSITIONS, BenchProcess, Move, State

    events = {event for _, event in TRANSITIONS}
    assert {target for target in TRANSITIONS.values()} | {State.STARTING} == set(State)
    for state in State:
        for event in events:
            process = object.__new__(BenchProcess)  # the machine alone, no process behind it
            process.state = state
            process.popen = type("Popen", (), {"pid": 0})()
            if (state, event) in TRANSITIONS:
                process._move(event)
                assert process.state is TRANSITIONS[(state, event)]
            else:
                with pytest.raises(InvalidTransition, match=f"a {state.value} benchmark process"):
                    process._move(event)
    # Every state but GONE can end; GONE is final.
    assert all((state, Move.ENDED) in TRANSITIONS for state in State if state is not State.GONE)
    assert not any(state is State.GONE for state, _ in TRANSITIONS)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")
def test_a_benchmark_process_leads_a_group_of_its_own_in_this_session():
    """As the pool's processes do: a Ctrl-C meant for the program does not reach it, and
    where Linux groups each session for the scheduler it does not get the CPU as an equal
    of the serving process."""
    import os

    from aiocompile._tuning import benchproc

    process = benchproc.launch(0, {})
    try:
        assert os.getpgid(process.pid) == process.pid
        if sys.version_info >= (3, 11):
            assert os.getsid(process.pid) == os.getsid(0)
    finally:
        process.kill()
        process.ended(30)
        process.close()
