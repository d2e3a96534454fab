"""Cold start: from an empty pool to a first compiled kernel, per start method.

For each way of starting workers, in fresh interpreters (so nothing is cached in-process):
time until the first kernel is compiled (pool start included), time for the next compile
in a second, freshly started worker, and the time a worker takes to start. The ratios
compare each start method with the stdlib's ProcessPoolExecutor under the same work.

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

    async def main():
        async with aiocompile.Scheduler(workers=2, start_method=sys.argv[1]) as sched:
            t1 = time.perf_counter()
            await sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": 256},
                                       target="cuda:90")
            t2 = time.perf_counter()
            # A second worker starts for the second of two concurrent compiles.
            await asyncio.gather(*[sched.compile_triton(add_kernel, signature=ADD_SIGNATURE,
                                                        constexprs={"BLOCK": b}, target="cuda:90")
                                   for b in (512, 1024)])
            t3 = time.perf_counter()
            records = sched.records()
        print(json.dumps({"first_compile": t2 - t0, "pool_created": t1 - t0, "next_two": t3 - t2,
                          "worker_run_times": [r.run_time for r in records]}))

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
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
            loop = asyncio.get_running_loop()
            t1 = time.perf_counter()
            first = await loop.run_in_executor(pool, compile_add, 256)
            t2 = time.perf_counter()
            others = await asyncio.gather(*[loop.run_in_executor(pool, compile_add, b) for b in (512, 1024)])
            t3 = time.perf_counter()
        print(json.dumps({"first_compile": t2 - t0, "pool_created": t1 - t0, "next_two": t3 - t2,
                          "worker_run_times": [first, *others]}))

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
    return {
        "first_compile_s": statistics.median(r["first_compile"] for r in runs),
        "next_two_s": statistics.median(r["next_two"] for r in runs),
        "first_worker_compile_s": statistics.median(r["worker_run_times"][0] for r in runs),
    }


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
    print(f"cold start, median of {args.repeat} fresh interpreters, {os.cpu_count()} CPUs "
          f"(ratio: vs ProcessPoolExecutor forkserver; lower is better)")
    print(f"{'':34} {'import->1st kernel':>19} {'ratio':>6} {'2 more (new worker)':>20} {'ratio':>6}"
          f" {'1st compile in worker':>22}")
    for name, row in rows.items():
        print(f"{name:34} {row['first_compile_s']:17.3f} s {row['first_compile_s'] / base['first_compile_s']:6.2f}"
              f" {row['next_two_s']:18.3f} s {row['next_two_s'] / base['next_two_s']:6.2f}"
              f" {row['first_worker_compile_s']:20.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "repeat": args.repeat, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
