"""Kernels defined in __main__ (a script, a notebook cell) are shipped to workers by source.

Each case runs a real script in a fresh interpreter, under each start method, and checks
what it printed.
"""

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import subprocess_env

SCRIPT = textwrap.dedent('''
    import asyncio, json, os, sys
    import triton
    import triton.language as tl
    import aiocompile

    # Top-level code with a side effect and no __main__ guard: workers must not run it.
    with open(os.environ["MARKER"], "a") as f:
        f.write(f"{os.getpid()}\\n")

    SCALE = tl.constexpr(3.0)
    BLOCK_DEFAULT = tl.constexpr(128)


    @triton.jit
    def scaled(x):
        return x * SCALE


    @triton.jit(noinline=True)
    def add_then_scale(a, b):
        return scaled(a + b)


    @triton.jit
    def main_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask)
        y = tl.load(y_ptr + offsets, mask=mask)
        factor = add_then_scale(n * 1.0, 2.0)
        tl.store(out_ptr + offsets, (x + y) * factor, mask=mask)


    async def main():
        results = {}
        async with aiocompile.Scheduler(workers=2, start_method=sys.argv[1]) as sched:
            for target in ("cuda:80", "hip:gfx942"):
                kernel = await sched.compile_triton(
                    main_kernel,
                    signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
                    constexprs={"BLOCK": 256},
                    target=target,
                )
                results[target] = {"name": kernel.name, "binary": len(kernel.binary),
                                   "asm": sorted(kernel.asm)}
            ptx = (await sched.compile_triton(
                main_kernel, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
                constexprs={"BLOCK": 256}, target="cuda:80")).asm["ptx"]
            results["calls_noinline_helper"] = ".func" in ptx and "add_then_scale" in ptx
            results["multiplies_by_3"] = "0f40400000" in ptx
            results["parent_cache_key"] = main_kernel.cache_key
            results["workers"] = sched.statistics().workers_started
        print(json.dumps(results))


    asyncio.run(main())
''')

# The same kernels, defined the way a notebook defines them: code compiled from a cell
# whose "file" exists only in linecache.
NOTEBOOK = textwrap.dedent('''
    import asyncio, json, linecache, sys
    import triton.language as tl
    import aiocompile

    CELL = """
    import triton
    import triton.language as tl

    OFFSET = tl.constexpr(7)

    @triton.jit
    def cell_helper(x):
        return x + OFFSET

    @triton.jit
    def cell_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out_ptr + offsets, cell_helper(tl.load(x_ptr + offsets, mask=mask)), mask=mask)
    """
    filename = "/tmp/ipykernel_4242/1234567890.py"
    linecache.cache[filename] = (len(CELL), None, CELL.splitlines(True), filename)
    exec(compile(CELL, filename, "exec"), globals())

    async def main():
        async with aiocompile.Scheduler(workers=1, start_method=sys.argv[1]) as sched:
            kernel = await sched.compile_triton(cell_kernel, signature={"x_ptr": "*i32", "out_ptr": "*i32",
                                                                        "n": "i32"},
                                                constexprs={"BLOCK": 64}, target="cuda:90")
            print(json.dumps({"name": kernel.name, "adds_7": "add.s32" in kernel.asm["ptx"],
                              "line_of_kernel": kernel.asm["ttir"].count("1234567890.py")}))

    asyncio.run(main())
''')


def _run(tmp_path, source, start_method):
    script = tmp_path / "script.py"
    script.write_text(source)
    marker = tmp_path / "marker"
    env = subprocess_env(MARKER=str(marker))
    proc = subprocess.run([sys.executable, str(script), start_method], capture_output=True, text=True, env=env,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), marker


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_kernel_defined_in_a_script(tmp_path, start_method):
    result, marker = _run(tmp_path, SCRIPT, start_method)
    assert result["cuda:80"]["name"] == "main_kernel" and result["cuda:80"]["binary"] > 1000
    assert "hsaco" in result["hip:gfx942"]["asm"]
    assert result["calls_noinline_helper"], "the noinline helper must stay a called function"
    assert result["multiplies_by_3"], "the global constexpr SCALE = 3.0 must reach the worker"
    # The script ran once, in the parent only, although it has no __main__ guard.
    assert len(marker.read_text().split()) == 1


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_kernel_defined_in_a_notebook_cell(tmp_path, start_method):
    result, _ = _run(tmp_path, NOTEBOOK, start_method)
    assert result["name"] == "cell_kernel"
    assert result["adds_7"]
    assert result["line_of_kernel"] > 0, "line info must name the cell the kernel came from"
