"""Pre-building the example kernel set: aiocompile beside serial triton.compile and a
stdlib ProcessPoolExecutor driven through run_in_executor, on the same work, in one run.

Each contender runs in a fresh interpreter with an empty Triton cache, so every kernel is
really compiled and every pool starts cold. Reported: wall time from the start of the
interpreter to the last kernel, and the ratio to serial compilation.

    python benchmarks/bench_build.py [--workers N] [--targets cuda:80,cuda:90,hip:gfx942] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMON = textwrap.dedent('''
    import asyncio, importlib.util, json, os, sys, time
    T0 = time.perf_counter()
    ROOT, TARGETS, WORKERS = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import kernels as example_set

    def jobs():
        for target in TARGETS:
            for entry in example_set.KERNELS:
                spec = dict(entry)
                label = spec.pop("label")
                yield label, target, spec

    def compile_one(label, target, spec):
        import triton
        from triton.compiler import ASTSource
        from aiocompile._base.target import parse_target
        spec = dict(spec)
        kernel, signature, constexprs = spec.pop("kernel"), dict(spec.pop("signature")), spec.pop("constexprs", {})
        for name in constexprs:
            signature[name] = "constexpr"
        ordered = {name: signature[name] for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, ordered, constexprs), target=parse_target(target).to_gpu_target(),
                                  options=spec)
        return len(compiled.asm["cubin" if "cubin" in compiled.asm else "hsaco"])

    def report(sizes):
        print(json.dumps({"wall": time.perf_counter() - T0, "kernels": len(sizes), "bytes": sum(sizes)}))
''')

SERIAL = COMMON + textwrap.dedent('''
    report([compile_one(*job) for job in jobs()])
''')

STDLIB = COMMON + textwrap.dedent('''
    import concurrent.futures, multiprocessing

    def compile_by_label(label, target):
        spec = next(s for l, t, s in jobs() if l == label and t == target)
        return compile_one(label, target, spec)

    async def main():
        ctx = multiprocessing.get_context("forkserver")
        with concurrent.futures.ProcessPoolExecutor(WORKERS, mp_context=ctx) as pool:
            loop = asyncio.get_running_loop()
            sizes = await asyncio.gather(*[loop.run_in_executor(pool, compile_by_label, label, target)
                                           for label, target, _ in jobs()])
        report(sizes)

    if __name__ == "__main__":
        asyncio.run(main())
''')

AIOCOMPILE = COMMON + textwrap.dedent('''
    import aiocompile

    async def main():
        async with aiocompile.Scheduler(workers=WORKERS) as sched:
            specs = [dict(spec, target=target) for _, target, spec in jobs()]
            kernels = await sched.compile_many(specs)
        report([len(k.binary) for k in kernels])

    asyncio.run(main())
''')


def run(script: str, targets: str, workers: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache, tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(script)
        f.flush()
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": ROOT, "TRITON_DEFAULT_FP_FUSION": "1"}
        proc = subprocess.run([sys.executable, f.name, ROOT, targets, str(workers)], capture_output=True, text=True,
                              env=env)
        if proc.returncode:
            raise SystemExit(proc.stderr)
        result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--targets", default="cuda:80,cuda:90,hip:gfx942")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    results = {
        "serial triton.compile": run(SERIAL, args.targets, args.workers),
        f"ProcessPoolExecutor({args.workers}) + run_in_executor": run(STDLIB, args.targets, args.workers),
        f"aiocompile Scheduler({args.workers})": run(AIOCOMPILE, args.targets, args.workers),
    }
    serial = results["serial triton.compile"]["wall"]
    kernels = int(results["serial triton.compile"]["kernels"])
    print(f"example set: {kernels} kernels ({args.targets}), {os.cpu_count()} CPUs, cold start included")
    for name, row in results.items():
        assert row["kernels"] == kernels
        print(f"  {name:42} {row['wall']:7.2f} s   {serial / row['wall']:5.2f}x serial")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "workers": args.workers, "targets": args.targets,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
