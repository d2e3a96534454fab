"""The CompiledTritonKernels cache: exact keys, single-flight, bounds, and the disk cache."""

import hashlib
import json
import linecache
import logging
import os
import struct
import subprocess
import sys
import textwrap

import anyio
import jobs
import pytest
from conftest import ROOT, read_only_directory, subprocess_env
from triton_kernels import ADD_SIGNATURE, add_kernel, type_error_kernel

import aiocompile
from aiocompile.backends import Request

ADD = {"signature": ADD_SIGNATURE, "constexprs": {"BLOCK": 128}, "target": "cuda:80"}


def compile_add(sched, **changes):
    return sched.compile_triton(add_kernel, **{**ADD, **changes})


# -- keys ---------------------------------------------------------------------------------


async def test_the_key_is_tritons_own_hash(scheduler):
    kernel = await compile_add(scheduler)
    # Computed here before the compile, by Triton in the worker during it: the same.
    assert kernel.key == kernel.triton_hash == kernel.metadata["hash"]


async def test_the_same_kernel_has_the_same_key_in_another_process(scheduler):
    here = (await compile_add(scheduler)).key
    script = textwrap.dedent("""
        import asyncio, sys
        sys.path.insert(0, sys.argv[1])
        import aiocompile
        from triton_kernels import ADD_SIGNATURE, add_kernel

        async def main():
            async with aiocompile.Scheduler(workers=1) as sched:
                kernel = await sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 128},
                                                    target="cuda:80")
            print(kernel.key)

        asyncio.run(main())
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT / "tests")], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == here


async def test_what_changes_the_binary_changes_the_key(scheduler, monkeypatch):
    base = (await compile_add(scheduler)).key
    variants = {
        "constexpr value": dict(constexprs={"BLOCK": 256}),
        "argument type": dict(signature={**ADD_SIGNATURE, "x_ptr": "*fp16", "y_ptr": "*fp16", "out_ptr": "*fp16"}),
        "option": dict(num_warps=8),
        "another option": dict(num_stages=2),
        "target": dict(target="cuda:90"),
        "another vendor": dict(target="hip:gfx942"),
        "specialisation attribute": dict(attrs={"x_ptr": [("tt.divisibility", 16)]}),
    }
    keys = {name: (await compile_add(scheduler, **change)).key for name, change in variants.items()}
    assert base not in keys.values()
    assert len(set(keys.values())) == len(keys)
    # An environment variable that changes Triton's output changes the key, too.
    monkeypatch.setenv("TRITON_DISABLE_LINE_INFO", "1")
    assert (await compile_add(scheduler)).key not in (base, *keys.values())
    monkeypatch.delenv("TRITON_DISABLE_LINE_INFO")
    assert (await compile_add(scheduler)).key == base


async def test_an_option_given_at_its_default_value_is_the_same_kernel(scheduler):
    # Triton fills in defaults before it hashes options: num_warps=4 is the default.
    assert (await compile_add(scheduler)).key == (await compile_add(scheduler, num_warps=4)).key


HELPER_CELL = """
import triton
import triton.language as tl

FACTOR = tl.constexpr({factor})

@triton.jit
def cell_helper(x):
    return x * {multiplier} + FACTOR
"""

KERNEL_CELL = """
import triton
import triton.language as tl

@triton.jit
def cell_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, cell_helper(tl.load(x_ptr + offsets, mask=mask)), mask=mask)
"""


def run_cell(namespace, number, source):
    """Run a notebook cell the way IPython does: its source in linecache under a file name
    of its own, executed in the notebook's one global namespace."""
    filename = f"/tmp/ipykernel_0/cell{number}.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


async def test_redefining_a_helper_or_a_global_constexpr_gives_a_new_key(scheduler):
    notebook = {"__name__": "__main__"}
    run_cell(notebook, 1, HELPER_CELL.format(factor=1, multiplier=2))
    run_cell(notebook, 2, KERNEL_CELL)
    kernel = notebook["cell_kernel"]

    async def key_of(fn):
        compiled = await scheduler.compile_triton(fn, signature={"x_ptr": "*i32", "n": "i32"},
                                                  constexprs={"BLOCK": 64}, target="cuda:80")
        return compiled.key, compiled.asm["ptx"]

    first, first_ptx = await key_of(kernel)
    assert (await key_of(kernel))[0] == first
    # The helper's cell runs again, changed: the kernel object is the same, what it calls
    # is not.
    run_cell(notebook, 1, HELPER_CELL.format(factor=1, multiplier=3))
    second, second_ptx = await key_of(kernel)
    assert second != first and second_ptx != first_ptx
    # ... and again, with another value for the global constexpr.
    run_cell(notebook, 1, HELPER_CELL.format(factor=5, multiplier=3))
    third, _ = await key_of(kernel)
    assert third not in (first, second)
    # Back to the first version: the first key again (and its kernel, from memory).
    run_cell(notebook, 1, HELPER_CELL.format(factor=1, multiplier=2))
    assert (await key_of(kernel))[0] == first


# -- single flight ------------------------------------------------------------------------------


async def test_a_thousand_concurrent_requests_compile_once():
    async with aiocompile.Scheduler(workers=2) as sched:
        results = [None] * 1000

        async def request(i):
            results[i] = await compile_add(sched, constexprs={"BLOCK": 1024})

        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                for i in range(1000):
                    group.start_soon(request, i)
        assert all(r is results[0] for r in results)
        stats = sched.statistics()
        assert (stats.submitted, stats.compiled, stats.failed) == (1000, 1, 0)
        # A request admitted while the compile runs joins it; one admitted after it ended
        # (its key is computed in a thread, so the order is up to the loop) finds it in
        # memory. Either way nothing compiles twice.
        assert stats.joined + stats.cache_hits == 999
        assert stats.joined > 0
        assert stats.run_time.count == 1


async def test_cancelled_waiters_do_not_cancel_the_compile_for_the_others():
    async with aiocompile.Scheduler(workers=1) as sched:
        got = []

        async def patient():
            got.append(await compile_add(sched, constexprs={"BLOCK": 2048}))

        async def impatient():
            with anyio.move_on_after(0.05):
                await compile_add(sched, constexprs={"BLOCK": 2048})

        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                group.start_soon(patient)
                while sched.statistics().in_flight == 0:  # the compile is under way
                    await anyio.sleep(0.005)
                for _ in range(4):
                    group.start_soon(patient)
                for _ in range(5):
                    group.start_soon(impatient)
        assert len(got) == 5 and all(k is got[0] for k in got)
        assert await compile_add(sched, constexprs={"BLOCK": 2048}) is got[0]
        stats = sched.statistics()
        assert (stats.compiled, stats.cancelled, stats.joined, stats.cache_hits) == (1, 5, 4, 1)


# -- what is remembered, and for how long --------------------------------------------------------


async def test_a_compile_error_is_remembered_briefly():
    config = aiocompile.SchedulerConfig(workers=1, error_ttl=0.5)
    bad = dict(signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 16}, target="cuda:80")
    async with aiocompile.Scheduler(config=config) as sched:
        with pytest.raises(aiocompile.CompileError) as first:
            await sched.compile_triton(type_error_kernel, **bad)
        with pytest.raises(aiocompile.CompileError) as second:
            await sched.compile_triton(type_error_kernel, **bad)
        assert str(second.value) == str(first.value)
        stats = sched.statistics()
        assert (stats.failed, stats.error_hits) == (1, 1)
        await anyio.sleep(0.6)
        with pytest.raises(aiocompile.CompileError):
            await sched.compile_triton(type_error_kernel, **bad)
        assert sched.statistics().failed == 2


async def test_crashes_and_timeouts_are_never_remembered():
    config = aiocompile.SchedulerConfig(workers=1, preload=(), max_crashes=1, error_ttl=60)
    async with aiocompile.Scheduler(config=config) as sched:
        for _ in range(2):
            with pytest.raises(aiocompile.WorkerCrashed):
                await sched.run(jobs.exit_now, 1, key="crashes")
            with pytest.raises(aiocompile.JobTimeout):
                await sched.run(jobs.hang, key="hangs", timeout=0.2)
        stats = sched.statistics()
        assert (stats.failed, stats.error_hits, stats.worker_crashes, stats.timeouts) == (4, 0, 2, 2)


async def test_the_memory_cache_is_bounded_by_entries():
    async with aiocompile.Scheduler(config=aiocompile.SchedulerConfig(workers=2, cache_entries=3)) as sched:
        first = await compile_add(sched, constexprs={"BLOCK": 16})
        for block in (32, 64, 128, 256):
            await compile_add(sched, constexprs={"BLOCK": block})
        stats = sched.statistics()
        assert (stats.cache_entries, stats.cache_evictions) == (3, 2)
        again = await compile_add(sched, constexprs={"BLOCK": 16})
        assert again is not first and again.key == first.key
        assert sched.statistics().compiled == 6


async def test_the_memory_cache_is_bounded_by_bytes():
    async with aiocompile.Scheduler(workers=2) as sched:
        size = (await compile_add(sched, constexprs={"BLOCK": 16})).size
    config = aiocompile.SchedulerConfig(workers=2, cache_bytes=int(size * 2.5))
    async with aiocompile.Scheduler(config=config) as sched:
        for block in (16, 32, 64, 128):
            await compile_add(sched, constexprs={"BLOCK": block})
        stats = sched.statistics()
        assert stats.cache_entries == 2 and stats.cache_evictions == 2
        assert stats.cache_bytes <= size * 2.5


# -- the disk cache -------------------------------------------------------------------------------

SECOND_PROCESS = textwrap.dedent("""
    import asyncio, json, sys
    sys.path.insert(0, sys.argv[2])
    import aiocompile
    from triton_kernels import ADD_SIGNATURE, add_kernel

    async def main():
        async with aiocompile.Scheduler(workers=1, cache_dir=sys.argv[1]) as sched:
            kernels = await sched.compile_many([
                dict(kernel=add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": b}, target="cuda:80")
                for b in (64, 128, 256)])
            print(json.dumps({"keys": [k.key for k in kernels], **sched.statistics().to_dict()}))

    asyncio.run(main())
""")


def second_process(cache_dir):
    proc = subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(cache_dir), str(ROOT / "tests")],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


async def test_a_restart_compiles_nothing(tmp_path):
    async with aiocompile.Scheduler(workers=2, cache_dir=tmp_path) as sched:
        built = [await compile_add(sched, constexprs={"BLOCK": b}) for b in (64, 128, 256)]
        assert sched.statistics().compiled == 3
    files = sorted(p.name for p in tmp_path.rglob("*.aiok"))
    assert files == sorted(f"{k.key}.aiok" for k in built)
    restarted = second_process(tmp_path)
    assert restarted["keys"] == [k.key for k in built]
    assert (restarted["disk_hits"], restarted["compiled"], restarted["workers_started"]) == (3, 0, 0)


def test_two_processes_share_one_directory_at_once(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", SECOND_PROCESS, str(tmp_path), str(ROOT / "tests")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
             for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["keys"] == results[1]["keys"]
    # Each kernel was either compiled or read by each process, and every file is whole.
    for result in results:
        assert result["compiled"] + result["disk_hits"] == 3 and result["failed"] == 0
    for path in tmp_path.rglob("*.aiok"):
        aiocompile.TritonKernel.from_bytes(path.read_bytes())
    assert not list(tmp_path.rglob("*.tmp"))
    third = second_process(tmp_path)
    assert (third["disk_hits"], third["compiled"]) == (3, 0)


async def filled(templates, directory, *blocks):
    """``directory`` as a scheduler leaves it once it has compiled the add kernel with each
    of ``blocks`` there (a copy of the module's template); returns the kernels."""
    async def make(source):
        async with aiocompile.Scheduler(workers=1, cache_dir=source) as sched:
            return [await compile_add(sched, constexprs={"BLOCK": block}) for block in blocks]

    return await templates.copy(directory, f"the add kernel with BLOCK={blocks}", make)


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "empty", "another key's file"])
async def test_a_damaged_file_is_discarded_and_recompiled_never_loaded(tmp_path, damage, templates):
    good, other = await filled(templates, tmp_path, 128, 512)
    path = tmp_path / good.key[:2] / f"{good.key}.aiok"
    data = path.read_bytes()
    if damage == "flip a byte":
        data = data[:500] + bytes([data[500] ^ 0xFF]) + data[501:]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = b""
    else:
        data = (tmp_path / other.key[:2] / f"{other.key}.aiok").read_bytes()
    path.write_bytes(data)
    async with aiocompile.Scheduler(workers=1, cache_dir=tmp_path) as sched:
        again = await compile_add(sched)
        stats = sched.statistics()
    assert again.key == good.key and again.binary == good.binary
    assert (stats.disk_corrupt, stats.disk_hits, stats.compiled) == (1, 0, 1)
    # The recompiled kernel replaced the damaged file.
    assert aiocompile.TritonKernel.from_bytes(path.read_bytes()).key == good.key


def without_header_field(data, field):
    """A Triton cache file's bytes with one field gone from its header and the checksum
    made to match: whole bytes, from a writer that left something out."""
    magic = b"AIOCOMPILE-TRITON\n"
    body = data[len(magic) + 33:]
    (length,) = struct.unpack_from("<I", body)
    header = json.loads(body[4:4 + length])
    del header[field]
    encoded = json.dumps(header).encode()
    body = struct.pack("<I", len(encoded)) + encoded + body[4 + length:]
    return data[:len(magic) + 1] + hashlib.sha256(body).digest() + body


def warnings_about(caplog, text):
    return [r for r in caplog.records if r.name == "aiocompile" and r.levelno == logging.WARNING
            and text in r.getMessage()]


async def test_a_file_with_a_field_missing_from_its_header_is_compiled_not_waited_for(tmp_path, caplog, templates):
    (good,) = await filled(templates, tmp_path, 128)
    path = tmp_path / good.key[:2] / f"{good.key}.aiok"
    path.write_bytes(without_header_field(path.read_bytes(), "triton_hash"))
    async with aiocompile.Scheduler(workers=1, cache_dir=tmp_path) as sched:
        with anyio.fail_after(60):  # such a file once left its request, and every later one, waiting forever
            first = await compile_add(sched)
            later = await compile_add(sched)
        stats = sched.statistics()
    assert first is later and first.binary == good.binary
    assert (stats.disk_corrupt, stats.disk_hits, stats.compiled, stats.cache_hits, stats.in_flight) == (1, 0, 1, 1, 0)
    assert len(warnings_about(caplog, "do not decode")) == 1
    # The compile replaced the file with a whole one.
    assert aiocompile.TritonKernel.from_bytes(path.read_bytes()).triton_hash == good.triton_hash


async def test_a_damaged_file_in_a_read_only_directory_is_compiled_and_left_alone(tmp_path, caplog, templates):
    caplog.set_level(logging.DEBUG, logger="aiocompile")
    (good,) = await filled(templates, tmp_path, 128)
    path = tmp_path / good.key[:2] / f"{good.key}.aiok"
    damaged = path.read_bytes()
    damaged = damaged[:500] + bytes([damaged[500] ^ 0xFF]) + damaged[501:]
    path.write_bytes(damaged)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    # No memory cache: each request reads the directory again.
    config = aiocompile.SchedulerConfig(workers=1, cache_dir=str(tmp_path), cache_entries=0)
    with read_only_directory(tmp_path):
        async with aiocompile.Scheduler(config=config) as sched:
            assert sched.statistics().disk_access == "read-only"
            with anyio.fail_after(60):  # deleting the file failed, and its request waited forever
                first = await compile_add(sched)
                later = await compile_add(sched)
        stats = sched.statistics()
    assert first.binary == later.binary == good.binary
    # Compiled twice, written never: not even tried (no errors), and no costs.json either.
    assert (stats.compiled, stats.disk_corrupt, stats.disk_writes, stats.disk_errors) == (2, 2, 0, 0)
    assert path.read_bytes() == damaged
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    # Once at WARNING for the cause, each file at DEBUG.
    assert len(warnings_about(caplog, "do not decode")) == 1
    assert sum(r.levelno == logging.DEBUG and "does not decode" in r.getMessage() for r in caplog.records) == 2


def _size_with_a_bug(result):
    raise ZeroDivisionError("a bug in the backend's size()")


async def test_a_bug_after_the_disk_read_or_the_compile_fails_the_request_instead_of_hanging(tmp_path):
    # A backend whose size() raises: the scheduler's bookkeeping fails after the disk
    # read, and after the compile. Done-callbacks that raised once left the request, and
    # every later one for its key, waiting forever.
    def request(key):
        return Request(backend="python", key=key, name="echo", target=None, fn=jobs.echo, args=(b"made",),
                       finish=bytes, encode=bytes, decode=bytes, size=_size_with_a_bug)

    on_disk = "ab" * 32
    (tmp_path / on_disk[:2]).mkdir(mode=0o700)
    (tmp_path / on_disk[:2] / f"{on_disk}.aiok").write_bytes(b"read")
    async with aiocompile.Scheduler(workers=1, cache_dir=tmp_path) as sched:
        with anyio.fail_after(60):
            for key in (on_disk, "cd" * 32):
                for _ in range(2):
                    with pytest.raises(ZeroDivisionError):
                        await sched.port.execute(request(key), None)
        stats = sched.statistics()
    assert (stats.failed, stats.in_flight, stats.compiled, stats.disk_hits) == (4, 0, 0, 0)


async def test_the_directory_is_bounded_least_recently_used_first(tmp_path):
    async with aiocompile.Scheduler(workers=2, cache_dir=tmp_path) as sched:
        first = {b: await compile_add(sched, constexprs={"BLOCK": b}) for b in (16, 32, 64)}
    largest = max(len(k.to_bytes()) for k in first.values())
    config = aiocompile.SchedulerConfig(workers=2, cache_dir=str(tmp_path), cache_dir_bytes=4 * largest)
    async with aiocompile.Scheduler(config=config) as sched:
        await compile_add(sched, constexprs={"BLOCK": 16})  # read from the disk: now the most recently used
        later = {b: await compile_add(sched, constexprs={"BLOCK": b}) for b in (128, 256)}
    stats = sched.statistics()  # once closed: every write (and eviction) is done
    # Five files for room for four: the two used longest ago went, to make room for 10%.
    left = {p.name for p in tmp_path.rglob("*.aiok")}
    assert left == {f"{k.key}.aiok" for k in (first[16], later[128], later[256])}
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.aiok")) <= 4 * largest
    assert (stats.disk_hits, stats.disk_evictions) == (1, 2)


async def test_a_thousand_concurrent_requests_read_the_disk_once(tmp_path, templates):
    await filled(templates, tmp_path, 64)
    async with aiocompile.Scheduler(workers=1, cache_dir=tmp_path) as sched:
        results = [None] * 1000

        async def request(i):
            results[i] = await compile_add(sched, constexprs={"BLOCK": 64})

        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for i in range(1000):
                    group.start_soon(request, i)
        assert all(r is results[0] for r in results)
        stats = sched.statistics()
        # One read of the disk: the others shared it, or came after it and found memory.
        assert (stats.disk_hits, stats.joined + stats.cache_hits, stats.compiled, stats.workers_started) == \
            (1, 999, 0, 0)
        assert os.path.exists(tmp_path / results[0].key[:2] / f"{results[0].key}.aiok")
