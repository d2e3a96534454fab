"""Real Triton compiles on the CPU, for explicit targets, through real worker processes."""

import math
import os
import pickle

import anyio
import jobs
import pytest
from conftest import example_spec
from triton_kernels import ADD_SIGNATURE, add_kernel, type_error_kernel

import aiocompile
from aiocompile.errors import RemoteTraceback

TARGETS = {
    # target: (binary, assembly, what the assembly must say)
    "cuda:80": ("cubin", "ptx", ".target sm_80"),
    "cuda:90": ("cubin", "ptx", ".target sm_90a"),
    "hip:gfx942": ("hsaco", "amdgcn", "gfx942"),
}


@pytest.mark.parametrize("target", sorted(TARGETS))
async def test_vector_add_compiles_for_each_target(scheduler, target):
    binary, assembly, marker = TARGETS[target]
    kernel = await scheduler.compile_triton(
        add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 256}, target=target, num_warps=4
    )
    assert isinstance(kernel, aiocompile.TritonKernel)
    assert kernel.name == "add_kernel"
    assert kernel.target == target
    assert len(kernel.key) == 64 and int(kernel.key, 16) >= 0
    assert {"ttir", "ttgir", "llir", assembly, binary} <= set(kernel.asm)
    assert marker in kernel.asm[assembly]
    assert kernel.binary_ext == binary and kernel.binary == kernel.asm[binary] and len(kernel.binary) > 1000
    assert kernel.metadata["num_warps"] == 4 and kernel.metadata["name"] == "add_kernel"
    assert kernel.compile_time > 0
    assert kernel.gpu_target.arch == kernel.metadata["target"]["arch"]


@pytest.mark.parametrize(
    ("target", "instruction"), [("cuda:80", "mma.sync"), ("cuda:90", "wgmma"), ("hip:gfx942", "v_mfma")]
)
async def test_matmul_uses_the_targets_matrix_units(scheduler, target, instruction):
    spec = example_spec("matmul_fp16_64x64x32")
    kernel = await scheduler.compile_triton(target=target, **spec)
    assert instruction in (kernel.asm.get("ptx") or kernel.asm["amdgcn"])
    assert kernel.metadata["num_stages"] == 3


@pytest.mark.parametrize("label", ["softmax_1024", "layer_norm_1024", "matmul_fp32_64x64x32"])
async def test_example_kernels_compile(scheduler, label):
    kernel = await scheduler.compile_triton(target="cuda:90", **example_spec(label))
    assert kernel.binary and kernel.asm["ptx"]


async def test_triton_source(scheduler):
    source = '''
import triton
import triton.language as tl

SCALE = tl.constexpr(3.0)

@triton.jit
def scale(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * SCALE, mask=mask)
'''
    kernel = await scheduler.compile_triton(
        aiocompile.TritonSource(source, "scale"),
        signature={"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
        constexprs={"BLOCK": 128},
        target="cuda:80",
    )
    assert kernel.name == "scale"
    assert "mul.f32" in kernel.asm["ptx"]


async def test_compile_error_carries_tritons_message_and_the_pool_carries_on():
    async with aiocompile.Scheduler(workers=1) as sched:
        with pytest.raises(aiocompile.CompileError) as info:
            await sched.compile_triton(
                type_error_kernel, signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 64}, target="cuda:80"
            )
        error = info.value
        assert type(error) is aiocompile.CompileError
        assert error.kernel_name == "type_error_kernel"
        assert error.target == "cuda:80"
        assert error.key and len(error.key) == 64
        # Triton's own message, pointing at the offending line of the kernel:
        assert "x_ptr * x_ptr" in str(error)
        assert isinstance(error.__cause__, RemoteTraceback)
        # The same worker serves the next job.
        kernel = await sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64},
                                            target="cuda:80")
        assert kernel.binary
        stats = sched.statistics()
        assert (stats.failed, stats.compiled, stats.worker_crashes, stats.workers_started) == (1, 1, 0, 1)


async def test_an_undefined_name_is_a_compile_error(scheduler):
    source = '''
import triton
import triton.language as tl

@triton.jit
def broken(x_ptr):
    tl.store(x_ptr, not_defined_anywhere)
'''
    with pytest.raises(aiocompile.CompileError, match="not_defined_anywhere"):
        await scheduler.compile_triton(aiocompile.TritonSource(source, "broken"), signature={"x_ptr": "*fp32"},
                                       target="cuda:80")


async def test_concurrent_requests_share_one_compile_and_later_ones_hit_memory():
    async with aiocompile.Scheduler(workers=2) as sched:
        results = [None] * 20

        async def request(i):
            results[i] = await sched.compile_triton(
                add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 512}, target="cuda:90"
            )

        async with anyio.create_task_group() as group:
            for i in range(20):
                group.start_soon(request, i)
        assert all(result is results[0] for result in results)
        again = await sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 512},
                                           target="cuda:90")
        assert again is results[0]
        stats = sched.statistics()
        # The last request hits memory; of the 20 concurrent ones, those admitted before the
        # compile ended join it and any admitted after find it in memory.
        assert (stats.submitted, stats.compiled, stats.joined + stats.cache_hits) == (21, 1, 20)
        assert stats.cache_hits >= 1
        assert stats.run_time.count == 1 and stats.run_time.total > 0


async def test_different_specialisations_are_different_kernels(scheduler):
    a = await scheduler.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64},
                                       target="cuda:80")
    b = await scheduler.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 128},
                                       target="cuda:80")
    c = await scheduler.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64},
                                       target="cuda:80", num_warps=2)
    assert len({a.key, b.key, c.key}) == 3
    assert c.metadata["num_warps"] == 2


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has an NVIDIA GPU")
async def test_launching_without_a_gpu_says_so(scheduler):
    kernel = await scheduler.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64},
                                            target="cuda:90")
    # As the README launches it, on a machine that only builds: said, not "0 active drivers" alone.
    said = ("add_kernel is compiled for cuda:90: loading and launching it needs a GPU of that kind, "
            "and this machine has none")
    with pytest.raises(RuntimeError, match=said):
        kernel[(1,)](0, 0, 0, 1)
    with pytest.raises(RuntimeError, match=said):
        await kernel.load()
    assert kernel.binary  # what it has without a GPU


async def test_kernels_pickle_and_round_trip_through_bytes(scheduler):
    kernel = await scheduler.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64},
                                            target="hip:gfx942")
    for copy in (pickle.loads(pickle.dumps(kernel)), aiocompile.TritonKernel.from_bytes(kernel.to_bytes())):
        assert copy is not kernel
        assert (copy.name, copy.key, copy.target, copy.metadata) == (kernel.name, kernel.key, kernel.target,
                                                                      kernel.metadata)
        assert copy.asm == kernel.asm and copy.binary == kernel.binary
        assert copy.constexprs == {"BLOCK": 64} and copy.arg_names == kernel.arg_names


async def test_corrupted_or_truncated_bytes_are_refused(scheduler):
    kernel = await scheduler.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64},
                                            target="cuda:80")
    data = bytearray(kernel.to_bytes())
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(ValueError, match="corrupted"):
        aiocompile.TritonKernel.from_bytes(bytes(data))
    with pytest.raises(ValueError):
        aiocompile.TritonKernel.from_bytes(kernel.to_bytes()[:-10])
    with pytest.raises(ValueError):
        aiocompile.TritonKernel.from_bytes(b"not a kernel")


async def test_compile_many_keeps_order_and_reports_failures(scheduler):
    specs = [
        {"kernel": add_kernel, "signature": ADD_SIGNATURE, "constexprs": {"BLOCK": 32 * 2**i}, "target": "cuda:80"}
        for i in range(4)
    ]
    bad = {"kernel": type_error_kernel, "signature": {"x_ptr": "*fp32", "n": "i32"}, "constexprs": {"BLOCK": 16},
           "target": "cuda:80"}
    results = await scheduler.compile_many(specs + [bad], return_exceptions=True)
    assert [k.constexprs["BLOCK"] for k in results[:4]] == [32, 64, 128, 256]
    assert isinstance(results[4], aiocompile.CompileError)
    with pytest.raises(aiocompile.CompileError):
        await scheduler.compile_many([bad] + specs)
    with pytest.raises(TypeError):
        await scheduler.compile_many([{"signature": ADD_SIGNATURE}])


async def test_compile_many_checks_every_spec_before_any_compile_starts(scheduler):
    """The specs are checked and keyed together; one that fails its checks takes its
    exception's place (or raises, with nothing compiled), the others are unaffected."""
    good = [{"kernel": add_kernel, "signature": ADD_SIGNATURE, "constexprs": {"BLOCK": 32 * 2**i},
             "target": "cuda:90"} for i in range(3)]
    misnamed = {"kernel": add_kernel, "signature": {**ADD_SIGNATURE, "nope": "i32"}, "constexprs": {"BLOCK": 16},
                "target": "cuda:90"}
    bad_option = {"kernel": add_kernel, "signature": ADD_SIGNATURE, "constexprs": {"BLOCK": 16},
                  "target": "cuda:90", "num_warps": 3}
    before = scheduler.statistics().submitted
    with pytest.raises(ValueError, match="nope"):
        await scheduler.compile_many([good[0], misnamed, good[1], bad_option])
    assert scheduler.statistics().submitted == before  # nothing was started

    results = await scheduler.compile_many([good[0], misnamed, good[1], bad_option, good[2]],
                                           return_exceptions=True)
    assert [type(r).__name__ for r in results] == ["TritonKernel", "ValueError", "TritonKernel", "ValueError",
                                                   "TritonKernel"]
    assert "nope" in str(results[1]) and "num_warps" in str(results[3])
    assert [k.constexprs["BLOCK"] for k in (results[0], results[2], results[4])] == [32, 64, 128]
    assert scheduler.statistics().submitted == before + 3


async def test_run_any_picklable_callable(scheduler):
    assert await scheduler.run(math.factorial, 20) == math.factorial(20)
    with pytest.raises(ValueError, match="math domain error") as info:
        await scheduler.run(math.sqrt, -1)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "sqrt" in info.value.__cause__.tb or "math domain" in info.value.__cause__.tb


async def test_jobs_carry_the_triton_environment_of_their_submission(scheduler, monkeypatch):
    monkeypatch.setenv("TRITON_AIOCOMPILE_TEST_MARK", "first")
    assert await scheduler.run(jobs.getenv, "TRITON_AIOCOMPILE_TEST_MARK") == "first"
    monkeypatch.setenv("TRITON_AIOCOMPILE_TEST_MARK", "second")
    assert await scheduler.run(jobs.getenv, "TRITON_AIOCOMPILE_TEST_MARK") == "second"
    monkeypatch.delenv("TRITON_AIOCOMPILE_TEST_MARK")
    assert await scheduler.run(jobs.getenv, "TRITON_AIOCOMPILE_TEST_MARK") is None

    with_lines = await scheduler.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64},
                                                target="cuda:90")
    monkeypatch.setenv("TRITON_DISABLE_LINE_INFO", "1")
    without_lines = await scheduler.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64},
                                                   target="cuda:90")
    assert with_lines.key != without_lines.key
    assert ".loc" in with_lines.asm["ptx"] and ".loc" not in without_lines.asm["ptx"]


async def test_a_job_that_sets_a_triton_variable_leaves_it_to_no_later_job():
    # One worker, so that every job below meets what the one before it did; the parent's
    # environment stays the same throughout, so the later jobs are sent without one.
    async with aiocompile.Scheduler(workers=1) as sched:
        for _ in range(3):
            assert await sched.run(jobs.setenv_then_get, "TRITON_AIOCOMPILE_TEST_LEAK", "set by a job") is None
        assert await sched.run(jobs.getenv, "TRITON_AIOCOMPILE_TEST_LEAK") is None
