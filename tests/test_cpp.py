"""compile_cpp: real g++ compiles in real workers, libraries called through ctypes."""

import ctypes
import pickle
import uuid

import anyio
import pytest
from conftest import wait_until
from native_sources import (
    ADD,
    SLOW_CPP,
    SLOW_CPP_FLAGS,
    UNIQUE_SUM,
    VECTOR_ADD,
    compiler_running,
    in_group,
    marked,
    needs_cpp,
    needs_nvcc,
)

import aiocompile

pytestmark = needs_cpp

# No Triton in the fork server: these workers only run compilers.
NATIVE = aiocompile.SchedulerConfig(workers=2, preload=())


@pytest.fixture(scope="module")
def native():
    """One scheduler for the module, shared by its asyncio and trio tests."""
    sched = aiocompile.Scheduler(config=NATIVE)
    yield sched
    sched.close(grace=0)


async def test_a_library_compiles_and_its_functions_are_called_through_ctypes(native):
    with anyio.fail_after(60):
        lib = await native.compile_cpp(UNIQUE_SUM, flags=("-O2", "-std=c++17"), name="unique_sum")
        assert isinstance(lib, aiocompile.NativeLibrary)
        assert lib.binary[:4] == b"\x7fELF" and lib.binary_ext == "so" and lib.size == len(lib.binary)
        assert lib.name == "unique_sum" and len(lib.key) == 64
        assert lib.compiler_version and lib.compiler_version in lib.compiler_identity
        assert lib.target in lib.compiler_identity  # the machine it builds for, x86_64-linux-gnu here
        assert lib.command.startswith(lib.compiler + " -shared -fPIC") and "-O2 -std=c++17" in lib.command
        assert lib.compile_time > 0 and lib.stages[0][0] == "compile"
        assert await lib.load() is lib and lib.loaded
        unique_sum = lib.symbol("unique_sum", restype=ctypes.c_long,
                                argtypes=(ctypes.POINTER(ctypes.c_int), ctypes.c_int))
        values = (ctypes.c_int * 7)(5, 3, 5, 1, 3, 9, 1)
        assert unique_sum(values, 7) == 18
        with pytest.raises(AttributeError, match="extern"):
            lib.symbol("not_there")
    record = next(r for r in native.records() if r.key == lib.key)
    assert record.backend == "cpp" and record.target == lib.target and record.stages


async def test_the_library_pickles_and_its_bytes_are_checked(native):
    with anyio.fail_after(60):
        lib = await native.compile_cpp(ADD, libraries=("m",))
    again = pickle.loads(pickle.dumps(lib))
    assert (again.key, again.binary, again.command, again.libraries) == (lib.key, lib.binary, lib.command, ("-lm",))
    assert again.symbol("add", argtypes=(ctypes.c_int, ctypes.c_int))(40, 2) == 42
    data = lib.to_bytes()
    assert aiocompile.NativeLibrary.from_bytes(data).binary == lib.binary
    corrupted = bytearray(data)
    corrupted[-10] ^= 0xFF
    for bad in (bytes(corrupted), data[:-1], b"", b"AIOCOMPILE-TRITON\n" + data[18:]):
        with pytest.raises(ValueError):
            aiocompile.NativeLibrary.from_bytes(bad)


async def test_each_load_is_a_library_of_its_own(native, tmp_path):
    # Two libraries defining the same symbol, loaded side by side: each call reaches its own.
    with anyio.fail_after(60):
        one = await native.compile_cpp('extern "C" int which() { return 1; }')
        two = await native.compile_cpp('extern "C" int which() { return 2; }')
    assert (one.symbol("which")(), two.symbol("which")()) == (1, 2)


async def test_an_edited_header_compiles_anew_and_an_unchanged_one_is_a_hit(tmp_path):
    include = tmp_path / "include"
    (include / "detail").mkdir(parents=True)
    (include / "scale.h").write_text('#pragma once\n#include "detail/factor.h"\n'
                                     "inline int scale(int x) { return x * FACTOR; }\n")
    factor = include / "detail" / "factor.h"
    factor.write_text("#define FACTOR 3\n")
    source = '#include <scale.h>\nextern "C" int scaled(int x) { return scale(x); }\n'
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with anyio.fail_after(60):
            first = await sched.compile_cpp(source, include_dirs=(include,))
            assert first.symbol("scaled")(5) == 15
            assert {str(include / "scale.h"), str(factor)} <= set(first.dependencies)
            # Nothing changed: the very same library, from memory.
            assert await sched.compile_cpp(source, include_dirs=(str(include),)) is first
            # The header that the header includes changes: another key, another library.
            factor.write_text("#define FACTOR 4\n")
            second = await sched.compile_cpp(source, include_dirs=(include,))
            assert second.key != first.key and second.symbol("scaled")(5) == 20
            # Through -I in the flags, too.
            factor.write_text("#define FACTOR 5\n")
            third = await sched.compile_cpp(source, flags=(f"-I{include}",))
            assert third.symbol("scaled")(5) == 25
            factor.write_text("#define FACTOR 6\n")
            assert (await sched.compile_cpp(source, flags=(f"-I{include}",))).symbol("scaled")(5) == 30
        outcomes = [r.outcome for r in sched.records()]
        assert outcomes == ["compiled", "cache_hit", "compiled", "compiled", "compiled"]
    finally:
        await sched.aclose()


async def test_an_include_named_by_a_macro_is_keyed_through_the_compilers_dependencies(tmp_path):
    (tmp_path / "config.h").write_text("#define LIMIT 7\n")
    source = ('#define CONFIG_HEADER "config.h"\n#include CONFIG_HEADER\n'
              'extern "C" int limit() { return LIMIT; }\n')
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with anyio.fail_after(60):
            first = await sched.compile_cpp(source, include_dirs=(tmp_path,))
            assert first.symbol("limit")() == 7
            (tmp_path / "config.h").write_text("#define LIMIT 8\n")
            second = await sched.compile_cpp(source, include_dirs=(tmp_path,))
            assert second.key != first.key and second.symbol("limit")() == 8
    finally:
        await sched.aclose()


async def test_a_compile_error_carries_the_diagnostics_and_the_command_line():
    source = 'extern "C" int ok() { return 1; }\n\nextern "C" int broken() { return undefined_name; }\n'
    sched = aiocompile.Scheduler(config=NATIVE.with_changes(workers=1))
    try:
        with anyio.fail_after(60):
            with pytest.raises(aiocompile.CompileError) as info:
                await sched.compile_cpp(source, flags=("-O1", "-Wall"), name="broken")
            error = info.value
            assert type(error) is aiocompile.CompileError
            assert "source.cpp:3:" in str(error) and "undefined_name" in str(error)
            assert error.kernel_name == "broken" and len(error.key) == 64
            assert error.command.endswith("-O1 -Wall -o libsource.so source.cpp -MMD -MF source.d")
            assert f"command: {error.command}" in error.message and "undefined_name" in error.output
            again = pickle.loads(pickle.dumps(error))
            assert (again.command, again.output, str(again)) == (error.command, error.output, str(error))
            # The same worker serves the next compile.
            assert (await sched.compile_cpp(ADD)).symbol("add")(1, 2) == 3
        stats = sched.statistics()
        assert (stats.failed, stats.compiled, stats.worker_crashes, stats.workers_started) == (1, 1, 0, 1)
    finally:
        await sched.aclose()


async def test_a_missing_compiler_is_a_clear_error_before_any_worker(tmp_path, monkeypatch):
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with pytest.raises(aiocompile.CompilerNotFound, match="no executable file") as info:
            await sched.compile_cpp(ADD, compiler=tmp_path / "g++")
        assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, aiocompile.CompileError)
        with pytest.raises(aiocompile.CompilerNotFound, match="not on PATH"):
            await sched.compile_cpp(ADD, compiler="no-such-compiler++")
        monkeypatch.setenv("PATH", str(tmp_path))
        with pytest.raises(aiocompile.CompilerNotFound, match="no C\\+\\+ compiler found: looked for c\\+\\+, g\\+\\+"):
            await sched.compile_cpp(ADD)
        stats = sched.statistics()
        assert (stats.submitted, stats.workers_started) == (0, 0) and sched.worker_pids() == []
    finally:
        await sched.aclose()


async def test_a_program_that_is_no_compiler_is_a_clear_error_before_any_worker(native):
    # /bin/true answers --version as GNU software does, and prints nothing for -dumpmachine.
    submitted = native.statistics().submitted
    with pytest.raises(aiocompile.CompilerNotFound, match="/bin/true is not a usable compiler: "
                                                          "'/bin/true -dumpmachine' printed nothing"):
        await native.compile_cpp(ADD, compiler="/bin/true")
    assert native.statistics().submitted == submitted


@pytest.mark.parametrize("flags", [("--help",), ("-Wl,-o,elsewhere",)], ids=["--help", "-Wl,-o"])
async def test_a_compiler_that_exits_0_without_the_library_is_a_compile_error(native, flags):
    with anyio.fail_after(60):
        with pytest.raises(aiocompile.CompileError) as info:
            await native.compile_cpp(ADD, flags=flags, name="nothing")
    error = info.value
    assert type(error) is aiocompile.CompileError and error.kernel_name == "nothing"
    assert "exited with status 0 without writing libsource.so" in error.message
    assert error.command.endswith("-MMD -MF source.d") and "aiocompile-native" not in error.message
    if flags == ("--help",):
        assert "Usage:" in error.message and "Usage:" in error.output  # what it printed instead


@pytest.mark.parametrize(("arguments", "error", "words"), [
    ({"source": b"int x;"}, TypeError, "source must be source text"),
    ({"flags": "-O2"}, TypeError, "flags must be a tuple of compiler flags"),
    ({"flags": ("-O2", "")}, ValueError, "flags\\[1\\] must be a compiler flag"),
    ({"include_dirs": ("",)}, ValueError, "include_dirs\\[0\\] must be a non-empty path"),
    ({"libraries": [3]}, TypeError, "libraries\\[0\\]"),
    ({"name": ""}, ValueError, "name must be a name"),
    ({"compiler": 5}, TypeError, "compiler must be a non-empty path"),
    ({"timeout": 0}, ValueError, "timeout must be a number of seconds > 0"),
    ({"timeout": True}, TypeError, "timeout"),
])
async def test_bad_arguments_are_refused_at_once(native, arguments, error, words):
    submitted = native.statistics().submitted
    with pytest.raises(error, match=words):
        await native.compile_cpp(**{"source": ADD, **arguments})
    assert native.statistics().submitted == submitted


async def test_a_second_scheduler_on_the_same_cache_dir_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    first = aiocompile.Scheduler(config=NATIVE, cache_dir=cache)
    try:
        with anyio.fail_after(60):
            built = await first.compile_cpp(UNIQUE_SUM, flags=("-O2",))
    finally:
        await first.aclose()  # waits for the disk write
    second = aiocompile.Scheduler(config=NATIVE, cache_dir=cache)
    try:
        with anyio.fail_after(60):
            found = await second.compile_cpp(UNIQUE_SUM, flags=("-O2",))
        assert found.key == built.key and found.binary == built.binary and found.command == built.command
        values = (ctypes.c_int * 3)(2, 2, 3)
        assert found.symbol("unique_sum", restype=ctypes.c_long)(values, 3) == 5
        stats = second.statistics()
        assert (stats.compiled, stats.disk_hits, stats.workers_started) == (0, 1, 0)
        assert second.records()[-1].outcome == "disk_hit"
    finally:
        await second.aclose()


async def test_concurrent_identical_requests_share_one_compile():
    sched = aiocompile.Scheduler(config=NATIVE)
    results = [None] * 12

    async def request(index):
        results[index] = await sched.compile_cpp(UNIQUE_SUM, flags=("-O1",))

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for index in range(len(results)):
                    group.start_soon(request, index)
        assert all(result is results[0] for result in results)
        stats = sched.statistics()
        assert (stats.submitted, stats.compiled, stats.joined, stats.workers_started) == (12, 1, 11, 1)
    finally:
        await sched.aclose()


@pytest.mark.parametrize("how", ["timeout", "cancel_running=kill"])
async def test_a_killed_compile_takes_every_compiler_process_with_it(how):
    """g++ runs cc1plus and, with -pipe, as beside it: a compile killed for its timeout,
    or because its last waiter went away, leaves none of them running."""
    marker = f"AIOCOMPILE_SLOW_{uuid.uuid4().hex}"  # in the command lines of g++ and cc1plus
    flags = (*SLOW_CPP_FLAGS, f"-D{marker}")
    sched = aiocompile.Scheduler(config=NATIVE.with_changes(workers=1, cancel_running="kill"))
    found = {}

    async def watch():
        found["group"], found["seen"] = await compiler_running(marker, {"cc1plus", "as"})

    try:
        with anyio.fail_after(90):
            async with anyio.create_task_group() as group:
                group.start_soon(watch)
                if how == "timeout":
                    with pytest.raises(aiocompile.JobTimeout):
                        await sched.compile_cpp(SLOW_CPP, flags=flags, timeout=3)
                else:
                    async with anyio.create_task_group() as compiling:
                        compiling.start_soon(lambda: sched.compile_cpp(SLOW_CPP, flags=flags))
                        while "group" not in found:
                            await anyio.sleep(0.02)
                        compiling.cancel_scope.cancel()  # the only waiter goes: the compile is killed
                group.cancel_scope.cancel()
            assert "group" in found, "the compiler never ran cc1plus and as before the job ended"
            assert {"cc1plus", "as"} <= found["seen"]
            # The worker led the group: it and everything it started are gone.
            assert wait_until(lambda: not in_group(found["group"]), 10), in_group(found["group"])
            assert marked(marker) == []
            # The pool serves the next compile.
            assert (await sched.compile_cpp(ADD)).symbol("add")(1, 2) == 3
        stats = sched.statistics()
        assert (stats.timeouts, stats.cancelled) == ((1, 0) if how == "timeout" else (0, 1))
        assert stats.worker_crashes == 0
    finally:
        await sched.aclose()


@needs_nvcc
async def test_compile_many_takes_cpp_cuda_and_triton_specs_together(native):
    from triton_kernels import ADD_SIGNATURE, add_kernel

    specs = [
        {"kind": "cpp", "source": ADD, "flags": ["-O2"], "label": "add-cpp"},
        {"kind": "cuda", "source": VECTOR_ADD, "arch": "sm_80", "output": "ptx"},
        {"kernel": add_kernel, "signature": ADD_SIGNATURE, "constexprs": {"BLOCK": 64}, "target": "cuda:80"},
        {"kind": "cpp", "source": ADD, "flag": ["-O2"]},
        {"kind": "cuda", "source": VECTOR_ADD, "arch": ("sm_80", "gfx942")},
    ]
    with anyio.fail_after(120):
        results = await native.compile_many(specs, return_exceptions=True)
    assert isinstance(results[0], aiocompile.NativeLibrary) and results[0].symbol("add")(2, 3) == 5
    assert isinstance(results[1], aiocompile.CudaBinary) and ".target sm_80" in results[1].ptx
    assert isinstance(results[2], aiocompile.TritonKernel)
    assert isinstance(results[3], TypeError) and "'flag'" in str(results[3])
    assert isinstance(results[4], ValueError) and "mixes NVIDIA and AMD" in str(results[4])
    with pytest.raises(ValueError, match="kind of spec #0 must be 'triton', 'cpp' or 'cuda', got 'rust'"):
        await native.compile_many([{"kind": "rust", "source": "fn main() {}"}])
    with pytest.raises(TypeError, match="spec #0 has no 'source'"):
        await native.compile_many([{"kind": "cpp", "flags": ["-O2"]}])


async def test_the_module_level_function_uses_the_default_scheduler():
    with anyio.fail_after(60):
        lib = await aiocompile.compile_cpp(ADD, flags=("-O2",))
    assert lib.symbol("add")(20, 22) == 42
    assert any(r.key == lib.key for r in aiocompile.default_scheduler().records())


async def test_with_no_history_a_batch_starts_the_largest_source_first(tmp_path):
    # Three sources of different sizes, each unique to this run (no cache to answer them):
    # with nothing measured, the cost model has only their sizes to go by.
    tag = uuid.uuid4().hex
    sources = [f'extern "C" int f{size}_{tag}(void) {{ return {size}; }}\n' + "// padding\n" * size
               for size in (10, 400, 50)]
    specs = [{"kind": "cpp", "source": source, "flags": ["-O1"]} for source in sources]
    config = aiocompile.SchedulerConfig(workers=1, preload=(), cost_history=str(tmp_path / "costs.json"))
    started = []
    async with aiocompile.Scheduler(config=config) as sched:
        unsubscribe = sched.subscribe(lambda event: started.append(event.key) if getattr(event, "event", None)
                                      == "job_started" and not event.warm_up else None)
        try:
            with anyio.fail_after(120):
                libraries = await sched.compile_many(specs)
        finally:
            unsubscribe()
    keys = [library.key for library in libraries]
    assert started == [keys[1], keys[2], keys[0]]
