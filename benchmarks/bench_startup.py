"""Start-up: how long until a kernel is compiled, when no worker is ready for it.

For each way of starting workers, in fresh interpreters (so nothing is cached in-process):

- import -> 1st kernel: from the start of the program to its first compiled kernel, a cold
  pool started on the way;
- kernel on a new worker: a pool that has been up for 3 s gets a request, and a worker
  starts for it (as after a crash, an idle stop, or when the pool grows); with it, how much
  of that was the compile itself, as measured in the worker.

The ratios compare each with the stdlib's ProcessPoolExecutor doing the same.

    python benchmarks/bench_startup.py [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

AIOCOMPILE = textwrap.dedent('''
    import asyncio, json, sys, time
    t0 = time.perf_counter()
    import aiocompile
    sys.path.insert(0, sys.argv[2])
    from triton_kernels import ADD_SIGNATURE, add_kernel

    def compile_add(sched, block):
        return sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": block},
                                    target="cuda:90")

    async def main():
        async with aiocompile.Scheduler(workers=2, start_method=sys.argv[1]) as sched:
            await compile_add(sched, 256)
            t1 = time.perf_counter()
        # A pool that has been up a while gets a request that needs a new worker.
        async with aiocompile.Scheduler(workers=2, start_method=sys.argv[1]) as sched:
            await asyncio.sleep(3)
            t2 = time.perf_counter()
            await compile_add(sched, 512)
            t3 = time.perf_counter()
            run_time = sched.records()[-1].run_time
        print(json.dumps({"first_kernel": t1 - t0, "on_demand": t3 - t2, "on_demand_run": run_time}))

    asyncio.run(main())
''')

STDLIB = textwrap.dedent('''
    import asyncio, concurrent.futures, json, multiprocessing, sys, time
    t0 = time.perf_counter()
    sys.path.insert(0, sys.argv[2])
    import triton_kernels  # an application holds its kernels, as the aiocompile script does

    def compile_add(block):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton_kernels import ADD_SIGNATURE, add_kernel
        signature = dict(ADD_SIGNATURE, BLOCK="constexpr")
        started = time.perf_counter()
        triton.compile(ASTSource(add_kernel, signature, {"BLOCK": block}), target=GPUTarget("cuda", 90, 32))
        return time.perf_counter() - started

    async def main():
        ctx = multiprocessing.get_context(sys.argv[1])
        loop = asyncio.get_running_loop()
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
            await loop.run_in_executor(pool, compile_add, 256)
            t1 = time.perf_counter()
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
            await asyncio.sleep(3)
            t2 = time.perf_counter()
            run_time = await loop.run_in_executor(pool, compile_add, 512)
            t3 = time.perf_counter()
        print(json.dumps({"first_kernel": t1 - t0, "on_demand": t3 - t2, "on_demand_run": run_time}))

    if __name__ == "__main__":
        asyncio.run(main())
''')


def measure(script: str, method: str, repeat: int) -> dict[str, float]:
    runs = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as cache, tempfile.NamedTemporaryFile("w", suffix=".py") as f:
            f.write(script)
            f.flush()
            env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": ROOT, "TRITON_DEFAULT_FP_FUSION": "1"}
            proc = subprocess.run([sys.executable, f.name, method, os.path.join(ROOT, "tests")],
                                  capture_output=True, text=True, env=env, check=True)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    rows = {
        "aiocompile forkserver": measure(AIOCOMPILE, "forkserver", args.repeat),
        "aiocompile spawn": measure(AIOCOMPILE, "spawn", args.repeat),
        "ProcessPoolExecutor forkserver": measure(STDLIB, "forkserver", args.repeat),
        "ProcessPoolExecutor spawn": measure(STDLIB, "spawn", args.repeat),
    }
    base = rows["ProcessPoolExecutor forkserver"]
    print(f"start-up, median of {args.repeat} fresh interpreters, {os.cpu_count()} CPUs "
          f"(ratio: vs ProcessPoolExecutor forkserver; lower is better)")
    print(f"{'':32} {'import -> 1st kernel':>21} {'ratio':>6} {'kernel on a new worker':>23} {'ratio':>6}"
          f" {'of which compiling':>19}")
    for name, row in rows.items():
        print(f"{name:32} {row['first_kernel']:19.3f} s {row['first_kernel'] / base['first_kernel']:6.2f}"
              f" {row['on_demand']:21.3f} s {row['on_demand'] / base['on_demand']:6.2f}"
              f" {row['on_demand_run']:17.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "repeat": args.repeat, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
