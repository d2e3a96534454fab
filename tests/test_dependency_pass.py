"""The compiler's dependency pass (-MM), which keys a source whose include is computed by a
macro: it runs in a worker under the request's timeout, dies when its caller goes or its
parent dies, and stalls no other request. The include names a FIFO that nobody writes, so
the real compiler blocks in it for as long as it is let."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid

import anyio
import pytest
from conftest import ROOT, subprocess_env, wait_until
from native_sources import ADD, marked, needs_cpp

import aiocompile

pytestmark = needs_cpp

NATIVE = aiocompile.SchedulerConfig(workers=2, preload=())


def blocking_source(directory, marker):
    """A source whose include, named by a macro, is a FIFO in ``directory``; and the flags
    that put ``marker`` on the command lines of the compiler driver and cc1plus."""
    os.mkfifo(directory / "blocking.h")
    source = '#define HEADER "blocking.h"\n#include HEADER\nextern "C" int f() { return 1; }\n'
    return source, {"include_dirs": (directory,), "flags": (f"-D{marker}",)}


def compiling(marker):
    """Whether cc1plus runs with ``marker`` on its command line (then its driver does too)."""
    return "cc1plus" in {name for _, name in marked(marker)}


async def wait_for_compiler(marker):
    while not compiling(marker):
        await anyio.sleep(0.02)


def scratch_directories(pids):
    """The scratch directories that workers ``pids`` made and that are still there."""
    root = os.path.join(tempfile.gettempdir(), f"aiocompile-native-{os.getuid()}")
    entries = os.listdir(root) if os.path.isdir(root) else []
    return [entry for entry in entries if entry.split("-", 1)[0] in {str(pid) for pid in pids}]


async def test_a_pass_that_blocks_times_out_while_other_requests_compile(tmp_path):
    from triton_kernels import ADD_SIGNATURE, add_kernel

    marker = f"AIOCOMPILE_DEPS_{uuid.uuid4().hex}"
    source, arguments = blocking_source(tmp_path, marker)
    order = []
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with anyio.fail_after(120):
            # Long enough for the others' compiles on a loaded machine (a first Triton
            # compile in a fresh worker there, beside another test run, outlasted 3 s).
            async def blocked():
                with pytest.raises(aiocompile.JobTimeout) as info:
                    await sched.compile_cpp(source, name="blocked", timeout=15, **arguments)
                order.append("timed out")
                assert "dependency pass" in str(info.value) and info.value.kernel_name == "blocked"
                assert info.value.timeout == 15

            async with anyio.create_task_group() as group:
                group.start_soon(blocked)
                await wait_for_compiler(marker)
                workers = sched.worker_pids()
                # The key thread and the other worker serve everyone else meanwhile.
                library = await sched.compile_cpp(ADD)
                kernel = await sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 64},
                                                    target="cuda:80")
                order.append("others done")
            assert order == ["others done", "timed out"]
            assert library.symbol("add")(2, 3) == 5 and kernel.name == "add_kernel"
            assert wait_until(lambda: not marked(marker), 10), marked(marker)
        stats = sched.statistics()
        assert (stats.submitted, stats.compiled, stats.failed) == (2, 2, 0)  # the pass is no request of its own
    finally:
        await sched.aclose()
    # The killed worker could not remove its scratch directory; the closing scheduler did.
    assert scratch_directories(workers) == []


async def test_cancelling_the_caller_kills_the_pass_and_the_pool_serves_on(tmp_path):
    marker = f"AIOCOMPILE_DEPS_{uuid.uuid4().hex}"
    source, arguments = blocking_source(tmp_path, marker)
    sched = aiocompile.Scheduler(config=NATIVE.with_changes(workers=1))  # cancel_running stays "keep"
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: sched.compile_cpp(source, **arguments))  # no timeout at all
                await wait_for_compiler(marker)
                group.cancel_scope.cancel()
            assert wait_until(lambda: not marked(marker), 10), marked(marker)
            # The one worker was killed with the pass; a fresh one compiles the next request.
            assert (await sched.compile_cpp(ADD, flags=("-O1",))).symbol("add")(1, 2) == 3
    finally:
        await sched.aclose()


async def test_compile_many_bounds_each_pass_by_its_specs_timeout(tmp_path):
    marker = f"AIOCOMPILE_DEPS_{uuid.uuid4().hex}"
    source, arguments = blocking_source(tmp_path, marker)
    (tmp_path / "fine.h").write_text("#define VALUE 7\n")
    computed = '#define HEADER "fine.h"\n#include HEADER\nextern "C" int value() { return VALUE; }\n'
    specs = [{"kind": "cpp", "source": source, "timeout": 2, **arguments},
             {"kind": "cpp", "source": computed, "include_dirs": (tmp_path,)},
             {"kind": "cpp", "source": ADD}]
    sched = aiocompile.Scheduler(config=NATIVE)
    try:
        with anyio.fail_after(60):
            results = await sched.compile_many(specs, return_exceptions=True)
        assert isinstance(results[0], aiocompile.JobTimeout) and "dependency pass" in str(results[0])
        assert results[1].symbol("value")() == 7 and results[2].symbol("add")(2, 2) == 4
        assert wait_until(lambda: not marked(marker), 10), marked(marker)
    finally:
        await sched.aclose()


SCRIPT = textwrap.dedent('''
    import asyncio, os, sys
    import aiocompile

    source = '#define HEADER "blocking.h"\\n#include HEADER\\nextern "C" int f() { return 1; }\\n'

    def compiling():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if sys.argv[2].encode() in f.read() and open(f"/proc/{pid}/comm").read().strip() == "cc1plus":
                        return True
            except OSError:
                pass
        return False

    async def main():
        task = asyncio.ensure_future(aiocompile.compile_cpp(source, include_dirs=(sys.argv[1],),
                                                            flags=("-D" + sys.argv[2],)))
        while not compiling():
            await asyncio.sleep(0.02)
        print("compiling", flush=True)
        if sys.argv[3] == "SIGKILL":
            await task
        # main() returns while the pass blocks, its key still being made: asyncio.run
        # cancels the task, and the program exits.

    asyncio.run(main())
''')


@pytest.mark.parametrize("ending", ["returns", "SIGKILL"])
def test_a_pass_ends_with_its_program(tmp_path, ending):
    """A program whose main() returns while a dependency pass blocks exits, and one killed
    by SIGKILL leaves no compiler running."""
    marker = f"AIOCOMPILE_DEPS_{uuid.uuid4().hex}"
    os.mkfifo(tmp_path / "blocking.h")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), marker, ending], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert proc.stdout.readline().strip() == "compiling"
        if ending == "SIGKILL":
            proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == (-signal.SIGKILL if ending == "SIGKILL" else 0)
    finally:
        proc.kill()
        proc.wait()
    assert wait_until(lambda: not marked(marker), 10), marked(marker)
