"""Compile costs are remembered, and a batch starts its longest compiles first."""

import json
import math
import os

import anyio
import pytest
from triton_kernels import ADD_SIGNATURE, MATMUL_SIGNATURE, add_kernel, axpy_kernel, tile_matmul_kernel

import aiocompile
from aiocompile._core.costs import PRIORS, TERMS, CostHistory, longest_first

AXPY_SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "alpha": "fp32", "n": "i32"}


def add_spec(block, **more):
    return {"kernel": add_kernel, "signature": ADD_SIGNATURE, "constexprs": {"BLOCK": block}, "target": "cuda:80",
            **more}


def axpy_spec(block):
    return {"kernel": axpy_kernel, "signature": AXPY_SIGNATURE, "constexprs": {"BLOCK": block, "SQUARE": True},
            "target": "cuda:80"}


# -- the history -------------------------------------------------------------------------------


def test_estimates_come_from_the_key_then_from_the_kernels_family():
    history = CostHistory()
    history.note("k1", "matmul", "triton", "cuda:90", 0.3)
    history.note("k2", "matmul", "triton", "cuda:90", 0.5)
    history.note("k3", "add", "triton", "cuda:90", 0.05)
    assert history.estimate("k1", "matmul", "triton", "cuda:90") == 0.3
    # A new configuration of a known kernel: the mean of its family.
    assert history.estimate("new", "matmul", "triton", "cuda:90") == pytest.approx(0.4)
    # The family includes the target: sm_80 is not sm_90.
    assert history.estimate("new", "matmul", "triton", "cuda:80") is None
    history.note("k1", "matmul", "triton", "cuda:90", 0.7)  # measured again: replaces
    assert history.estimate("k1", "matmul", "triton", "cuda:90") == 0.7
    assert history.estimate("new", "matmul", "triton", "cuda:90") == pytest.approx(0.6)
    history.note(None, "x", "python", None, 1.0)  # no key: nothing to remember it by
    history.note("k4", "x", "python", None, 0.0)
    assert len(history) == 3


def test_the_file_is_merged_with_other_writers_bounded_and_replaced_whole(tmp_path):
    path = str(tmp_path / "sub" / "costs.json")
    first, second = CostHistory(path), CostHistory(path, limit=3)
    first.note("a", "k", "triton", "cuda:90", 1.0)
    first.note("b", "k", "triton", "cuda:90", 2.0)
    first.save()
    second.load()
    second.note("c", "k", "triton", "cuda:90", 3.0)
    second.note("d", "k", "triton", "cuda:90", 4.0)
    second.save()  # keeps the newest 3 of a, b, c, d
    data = json.loads(open(path).read())
    assert data["version"] == 2 and sorted(data["costs"]) == ["b", "c", "d"]
    assert os.listdir(tmp_path / "sub") == ["costs.json"]  # no temporary file left
    third = CostHistory(path)
    third.load()
    assert third.estimate("b", "k", "triton", "cuda:90") == 2.0
    assert third.estimate("z", "k", "triton", "cuda:90") == pytest.approx(3.0)


@pytest.mark.parametrize("content", ["", "{not json", '{"version": 99, "costs": {}}', '[1, 2]',
                                     '{"version": 1, "costs": {"a": [-1, "k", "triton", "t", 0], "b": "x"}}'])
def test_a_bad_file_is_an_empty_history(tmp_path, content):
    path = tmp_path / "costs.json"
    path.write_text(content)
    history = CostHistory(str(path))
    history.load()
    assert len(history) == 0
    history.note("a", "k", "triton", "t", 1.0)
    history.save()
    assert list(json.loads(path.read_text())["costs"]) == ["a"]


def test_a_history_that_cannot_be_written_costs_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    history = CostHistory(str(blocker / "costs.json"))  # a directory that cannot exist
    history.note("a", "k", "triton", "t", 1.0)
    history.save()
    assert history.estimate("a", "k", "triton", "t") == 1.0


def test_longest_first_order():
    assert longest_first([0.1, 0.5, None, 0.3]) == [1, 2, 3, 0]  # None counts as the median (0.3)
    assert longest_first([None, None, None]) == [0, 1, 2]         # nothing known: as given
    assert longest_first([0.2, 0.2, 0.4]) == [2, 0, 1]            # stable for equal estimates
    assert longest_first([]) == []


# -- the batch ---------------------------------------------------------------------------------


async def started_order(sched, specs):
    order = []
    unsubscribe = sched.subscribe(
        lambda event: order.append(event.key) if getattr(event, "event", None) == "job_started"
        and not event.warm_up else None)
    try:
        with anyio.fail_after(240):
            kernels = await sched.compile_many(specs)
    finally:
        unsubscribe()
    return kernels, order


async def test_a_batch_starts_its_longest_compiles_first_as_the_history_says(tmp_path, monkeypatch):
    # Compiles Triton answers from its own cache are not noted: make them real.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    history = tmp_path / "costs.json"
    specs = [add_spec(64), add_spec(128), add_spec(256), axpy_spec(64), add_spec(512)]
    async with aiocompile.Scheduler(workers=1, config=aiocompile.SchedulerConfig(cost_history=str(history))) as sched:
        kernels, first_order = await started_order(sched, specs)
    keys = [k.key for k in kernels]
    # Nothing was measured: the adds in the order of their predicted cost, larger blocks first.
    assert [key for key in first_order if key != keys[3]] == [keys[4], keys[2], keys[1], keys[0]]
    # The scheduler noted each compile's time in the file.
    assert set(json.loads(history.read_text())["costs"]) == set(keys)

    # Say the 256-block add is the slowest and the 64-block one next; the axpy kernel is
    # known only by its family (a different configuration of it was measured).
    costs = {keys[0]: [0.4, "add_kernel", "triton", "cuda:80", 1.0],
             keys[1]: [0.1, "add_kernel", "triton", "cuda:80", 1.0],
             keys[2]: [0.9, "add_kernel", "triton", "cuda:80", 1.0],
             "another-axpy": [0.6, "axpy_kernel", "triton", "cuda:80", 1.0],
             keys[4]: [0.2, "add_kernel", "triton", "cuda:80", 1.0]}
    history.write_text(json.dumps({"version": 1, "costs": costs}))
    async with aiocompile.Scheduler(workers=1, config=aiocompile.SchedulerConfig(cost_history=str(history))) as sched:
        again, order = await started_order(sched, specs)
    # Results stay in the order of the specs; the compiles ran longest first.
    assert [k.key for k in again] == keys
    assert order == [keys[2], keys[3], keys[0], keys[4], keys[1]]


async def test_the_cache_directory_keeps_the_history_and_a_bad_spec_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    async with aiocompile.Scheduler(workers=1, cache_dir=tmp_path) as sched:
        await sched.compile_many([add_spec(32)])
        with pytest.raises(ValueError):
            await sched.compile_many([add_spec(1024), add_spec(2048, num_warps=3)])  # 3: not a power of 2
        assert sched.statistics().submitted == 1
        with pytest.raises(TypeError, match="no 'signature'"):
            await sched.compile_many([{"kernel": add_kernel}])
    assert len(json.loads((tmp_path / "costs.json").read_text())["costs"]) == 1


# -- predicting a compile that never ran ---------------------------------------------------------


def triton_features(tile, warps=4, stages=3, dot=0.0, source=10.0):
    return (("source", source), ("tile", math.log2(tile)), ("warps", math.log2(warps)), ("dot", dot),
            ("stages", float(stages)))


def test_with_nothing_measured_the_prior_ranks_matmuls_by_their_tile_and_above_elementwise_kernels():
    history = CostHistory()
    add = history.estimate("a", "add", "triton", "cuda:90", triton_features(1024, source=8.2))
    small = history.estimate("m1", "mm", "triton", "cuda:90", triton_features(16 * 32 * 32, 1, 2, dot=1.0, source=10.7))
    large = history.estimate("m2", "mm", "triton", "cuda:90", triton_features(128 * 256 * 64, 8, 3, 1.0, 10.7))
    assert add is not None and small is not None and large is not None
    assert add < small < large
    # Nothing about it at all, not even a description: no estimate (as given, in a batch).
    assert history.estimate("z", "other", "triton", "cuda:90") is None
    model = history.model("triton")
    assert model["compiles"] == 0 and model["terms"] == dict(zip(TERMS, PRIORS["triton"]))


def test_the_model_learns_from_compiles_and_a_fresh_process_reads_what_it_learnt(tmp_path):
    path = str(tmp_path / "costs.json")
    history = CostHistory(path)
    # On this machine, say, the prior is wrong about warps: more warps compile slower.
    for n, warps in enumerate([1, 2, 4, 8, 16] * 4):
        history.note(f"k{n}", f"kernel{n}", "triton", "cuda:90", 0.05 * warps, triton_features(1024, warps))
    learnt = history.model("triton")
    assert learnt["compiles"] == 20 and learnt["terms"]["warps"] > 0.5 > PRIORS["triton"][TERMS.index("warps")]
    few, many = (history.estimate("new", "unseen", "triton", "cuda:90", triton_features(1024, w)) for w in (2, 16))
    assert few is not None and many is not None and many > 4 * few
    history.save()
    fresh = CostHistory(path)
    fresh.load()
    assert fresh.model("triton") == learnt
    assert fresh.estimate("new", "unseen", "triton", "cuda:90", triton_features(1024, 16)) == pytest.approx(many)
    # Measured again: the old time leaves the model, the new one takes its place.
    fresh.note("k0", "kernel0", "triton", "cuda:90", 0.05, triton_features(1024, 1))
    assert fresh.model("triton") == learnt


def test_a_new_configuration_of_a_known_kernel_is_corrected_by_its_familys_residual():
    history = CostHistory()
    slow_before = history.estimate("new", "slow_kernel", "triton", "cuda:90", triton_features(2048))
    plain_before = history.estimate("new", "plain_kernel", "triton", "cuda:90", triton_features(2048, source=9.0))
    # One family compiles about 8x slower than the prior says, another as it says.
    for family, factor, source in (("slow_kernel", 8, 10.0), ("plain_kernel", 1, 9.0)):
        for tile in (256, 512, 1024):
            features = triton_features(tile, source=source)
            predicted = CostHistory().estimate(None, family, "triton", "cuda:90", features)
            history.note(f"{family}{tile}", family, "triton", "cuda:90", factor * predicted, features)
    slow = history.estimate("new", "slow_kernel", "triton", "cuda:90", triton_features(2048))
    plain = history.estimate("new", "plain_kernel", "triton", "cuda:90", triton_features(2048, source=9.0))
    assert slow_before is not None and plain_before is not None and slow is not None and plain is not None
    assert slow > 4 * slow_before
    assert plain < 2 * plain_before


def test_a_version_1_file_is_read_and_its_times_still_count(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"version": 1, "costs": {"a": [0.7, "k", "triton", "cuda:90", 1.0]}}))
    history = CostHistory(str(path))
    history.load()
    assert history.estimate("a", "k", "triton", "cuda:90", triton_features(64)) == 0.7
    assert history.estimate("b", "k", "triton", "cuda:90", triton_features(64)) == 0.7  # its family's mean
    history.note("c", "k", "triton", "cuda:90", 0.5, triton_features(64))
    history.save()
    data = json.loads(path.read_text())
    assert data["version"] == 2 and data["costs"]["a"][5] is None and data["costs"]["c"][5]["tile"] == 6.0


async def test_a_first_run_starts_the_matmul_before_the_vector_adds(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    matmul = {"kernel": tile_matmul_kernel, "signature": MATMUL_SIGNATURE, "target": "cuda:80",
              "constexprs": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, "num_warps": 2}
    specs = [add_spec(64), add_spec(1024), matmul, add_spec(256)]
    config = aiocompile.SchedulerConfig(cost_history=str(tmp_path / "costs.json"))
    async with aiocompile.Scheduler(workers=1, config=config) as sched:
        kernels, order = await started_order(sched, specs)
    keys = [k.key for k in kernels]
    assert order == [keys[2], keys[1], keys[3], keys[0]]
    entry = json.loads((tmp_path / "costs.json").read_text())["costs"][keys[2]]
    assert entry[5]["dot"] == 1.0 and entry[5]["tile"] == 15.0 and entry[5]["warps"] == 1.0
