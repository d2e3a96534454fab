"""Every file a C++ compile reads is in its key: a response file named in flags (and one it
names), a header found through CPATH, a linker version script, an object and an archive
among the flags or found by -l. Each is edited between compiles with real g++: the next
compile builds anew, in the same scheduler (not answered from memory) and in a fresh one
on the same cache_dir (not answered from disk). What cannot be keyed is refused."""

import os
import subprocess

import anyio
import pytest
from native_sources import ADD, needs_cpp

import aiocompile
from aiocompile.backends._native._inputs import split_response_file

pytestmark = needs_cpp

NATIVE = aiocompile.SchedulerConfig(workers=1, preload=())
VALUE = 'extern "C" int value() { return VALUE; }\n'


def archive(directory, value):
    """``part.o`` and ``libpart.a`` in ``directory``, whose ``part()`` returns ``value``."""
    source = directory / "part.cpp"
    source.write_text(f'extern "C" int part() {{ return {value}; }}\n')
    subprocess.run(["c++", "-c", "-fPIC", "-o", str(directory / "part.o"), str(source)], check=True)
    (directory / "libpart.a").unlink(missing_ok=True)
    subprocess.run(["ar", "rcs", str(directory / "libpart.a"), str(directory / "part.o")], check=True)


def response_files(directory, value):
    # Relative names, from the caller's directory: the outer file names the inner one.
    (directory / "inner.rsp").write_text(f"'-DVALUE={value}' -DNAME=\\\"a\\ b\\\"\n")
    (directory / "opts.rsp").write_text('-O1 "@inner.rsp"\n')


def version_script(directory, value):
    # An odd value exports other() beside value(); each value writes other bytes.
    exported = "value; other;" if value % 2 else "value;"
    (directory / "exports.map").write_text(f"/* {value} */ {{ global: {exported} local: *; }};\n")


def exports_other(lib):
    try:
        lib.symbol("other")
    except AttributeError:
        return 0
    return 1


CALLS_PART = 'extern "C" int part();\nextern "C" int value() { return part(); }\n'
CASES = {
    # name: (write the files for a value, the compile's arguments, what the library says of the value)
    "response file": (response_files, {"source": VALUE, "flags": ("@opts.rsp",)},
                      lambda lib, value: lib.symbol("value")() == value),
    "header through CPATH": (lambda d, value: (d / "value.h").write_text(f"#define VALUE {value}\n"),
                             {"source": "#include <value.h>\n" + VALUE},
                             lambda lib, value: lib.symbol("value")() == value),
    "version script": (version_script,
                       {"source": VALUE.replace("VALUE", "1") + 'extern "C" int other() { return 2; }\n',
                        "flags": ("-Wl,--version-script=exports.map",)},
                       lambda lib, value: exports_other(lib) == value % 2),
    "version script in a linker response file": (
        lambda d, value: (version_script(d, value), (d / "link.rsp").write_text("--version-script exports.map\n")),
        {"source": VALUE.replace("VALUE", "1") + 'extern "C" int other() { return 2; }\n',
         "flags": ("-Wl,@link.rsp",)},
        lambda lib, value: exports_other(lib) == value % 2),
    "object among the flags": (archive, {"source": CALLS_PART, "flags": ("part.o",)},
                               lambda lib, value: lib.symbol("value")() == value),
    "archive found by -l": (archive, {"source": CALLS_PART, "flags": ("-L.",), "libraries": ("part",)},
                            lambda lib, value: lib.symbol("value")() == value),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_an_edited_input_compiles_anew_not_from_memory_nor_from_disk(case, tmp_path, monkeypatch):
    write, arguments, shows = CASES[case]
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    monkeypatch.chdir(inputs)  # relative paths are the caller's
    monkeypatch.setenv("CPATH", str(inputs))
    write(inputs, 1)
    cache = tmp_path / "cache"
    first = aiocompile.Scheduler(config=NATIVE, cache_dir=cache)
    try:
        with anyio.fail_after(120):
            one = await first.compile_cpp(**arguments)
            assert await first.compile_cpp(**arguments) is one  # nothing changed: the same library
            write(inputs, 2)
            two = await first.compile_cpp(**arguments)
        assert shows(one, 1) and shows(two, 2) and two.key != one.key
        assert [r.outcome for r in first.records()] == ["compiled", "cache_hit", "compiled"]
    finally:
        await first.aclose()  # waits for the disk writes
    write(inputs, 3)
    second = aiocompile.Scheduler(config=NATIVE, cache_dir=cache)
    try:
        with anyio.fail_after(120):
            three = await second.compile_cpp(**arguments)
        assert shows(three, 3) and three.key not in (one.key, two.key)
        assert [r.outcome for r in second.records()] == ["compiled"]
    finally:
        await second.aclose()


async def test_the_compile_sees_the_environment_it_was_keyed_with(tmp_path, monkeypatch):
    """CPATH set after the workers started reaches the compile as it reached the key."""
    (tmp_path / "value.h").write_text("#define VALUE 41\n")
    monkeypatch.delenv("CPATH", raising=False)
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with anyio.fail_after(60):
            assert (await sched.compile_cpp(ADD)).symbol("add")(1, 1) == 2  # the worker runs, without CPATH
            monkeypatch.setenv("CPATH", str(tmp_path))
            lib = await sched.compile_cpp("#include <value.h>\n" + VALUE)
            assert lib.symbol("value")() == 41
            monkeypatch.delenv("CPATH")
            with pytest.raises(aiocompile.CompileError, match="value.h"):
                await sched.compile_cpp("#include <value.h>\n" + VALUE)
    finally:
        await sched.aclose()


def test_response_files_split_as_gcc_splits_them():
    text = "'-DC=\"x y\"' -DD=a\\ b \"-DE=1\"\n\t-O2 'it''s' \"\" \\\n-g"
    assert split_response_file(text) == ['-DC="x y"', "-DD=a b", "-DE=1", "-O2", "its", "", "\n-g"]


@pytest.mark.parametrize("what", ["a FIFO", "itself", "nvcc options file", "nvcc host response file"])
async def test_what_cannot_be_keyed_is_refused_before_any_worker(what, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with anyio.fail_after(60):
            if what == "a FIFO":
                os.mkfifo("opts.rsp")
                with pytest.raises(ValueError, match="@opts.rsp is not a regular file"):
                    await sched.compile_cpp(ADD, flags=("@opts.rsp",))
            elif what == "itself":
                (tmp_path / "a.rsp").write_text("-O1 @b.rsp\n")
                (tmp_path / "b.rsp").write_text("@a.rsp\n")
                with pytest.raises(ValueError, match="names itself"):
                    await sched.compile_cpp(ADD, flags=("@a.rsp",))
            elif what == "nvcc options file":
                (tmp_path / "opts").write_text("-O1\n")
                with pytest.raises(ValueError, match="--options-file cannot be keyed"):
                    await sched.compile_cuda("__global__ void k() {}", flags=("--options-file", "opts"))
            else:
                with pytest.raises(ValueError, match="response file passed on by -Xcompiler"):
                    await sched.compile_cuda("__global__ void k() {}", flags=("-Xcompiler", "-O2,@opts"))
        assert sched.statistics().workers_started == 0
    finally:
        await sched.aclose()
