"""The cache: what a compile costs once it has been done before, in one run.

- memory hit: ``await sched.compile_triton(...)`` of a kernel compiled earlier in this
  process (validation and key computation included);
- disk hit: the same with the memory cache emptied first, so the kernel comes from
  ``cache_dir`` (as after a restart);
- 1000 concurrent identical requests: once cold (one compile, 999 joins) and once warm;
- beside them, a plain ``triton.compile`` of the same kernel with Triton's own disk cache
  warm, which is what a process that compiled it before pays without aiocompile.

    python benchmarks/bench_cache.py [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda p: ordered[min(len(ordered) - 1, int(p * len(ordered)))]  # noqa: E731
    return {"p50_us": pick(0.50) * 1e6, "p95_us": pick(0.95) * 1e6, "p99_us": pick(0.99) * 1e6,
            "n": len(ordered)}


async def measure(cache_dir: str) -> dict[str, dict[str, float]]:
    from triton_kernels import ADD_SIGNATURE, add_kernel

    import aiocompile

    args = dict(signature=ADD_SIGNATURE, constexprs={"BLOCK": 256}, target="cuda:90")
    results: dict[str, dict[str, float]] = {}
    async with aiocompile.Scheduler(workers=2, cache_dir=cache_dir) as sched:
        started = time.perf_counter()
        await asyncio.gather(*[sched.compile_triton(add_kernel, **dict(args, constexprs={"BLOCK": 512}))
                               for _ in range(1000)])
        results["1000 concurrent, cold"] = {"total_ms": (time.perf_counter() - started) * 1000,
                                            "compiles": sched.statistics().compiled}
        await sched.compile_triton(add_kernel, **args)
        samples = []
        for _ in range(20000):
            t = time.perf_counter()
            await sched.compile_triton(add_kernel, **args)
            samples.append(time.perf_counter() - t)
        results["memory hit"] = percentiles(samples)
        started = time.perf_counter()
        await asyncio.gather(*[sched.compile_triton(add_kernel, **args) for _ in range(1000)])
        total = time.perf_counter() - started
        results["1000 concurrent, warm"] = {"total_ms": total * 1000, "per_request_us": total / 1000 * 1e6}

    # No result kept in memory: every request reads the disk.
    no_memory = aiocompile.SchedulerConfig(cache_entries=0)
    async with aiocompile.Scheduler(workers=1, cache_dir=cache_dir, config=no_memory) as sched:
        samples = []
        for _ in range(300):
            t = time.perf_counter()
            await sched.compile_triton(add_kernel, **args)
            samples.append(time.perf_counter() - t)
        results["disk hit"] = percentiles(samples)
        assert sched.statistics().compiled == 0
    return results


def triton_warm_cache() -> dict[str, float]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton_kernels import ADD_SIGNATURE, add_kernel

    signature = dict(ADD_SIGNATURE, BLOCK="constexpr")
    target = GPUTarget("cuda", 90, 32)
    triton.compile(ASTSource(add_kernel, signature, {"BLOCK": 256}), target=target)  # fill Triton's cache
    samples = []
    for _ in range(300):
        t = time.perf_counter()
        triton.compile(ASTSource(add_kernel, signature, {"BLOCK": 256}), target=target)
        samples.append(time.perf_counter() - t)
    return percentiles(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as triton_cache, tempfile.TemporaryDirectory() as cache_dir:
        os.environ["TRITON_CACHE_DIR"] = triton_cache
        results = asyncio.run(measure(cache_dir))
        results["triton.compile, warm Triton cache"] = triton_warm_cache()
    baseline = results["triton.compile, warm Triton cache"]["p50_us"]
    print(f"cache latencies, {os.cpu_count()} CPUs (ratio: p50 against triton.compile with a warm Triton cache)")
    for name in ("memory hit", "disk hit", "triton.compile, warm Triton cache"):
        row = results[name]
        print(f"  {name:36} p50 {row['p50_us']:9.1f} us  p95 {row['p95_us']:9.1f} us  p99 {row['p99_us']:9.1f} us"
              f"  ratio {row['p50_us'] / baseline:.3f}")
    cold, warm = results["1000 concurrent, cold"], results["1000 concurrent, warm"]
    print(f"  1000 concurrent identical requests, cold: {cold['total_ms']:.0f} ms for {cold['compiles']} compile(s)")
    print(f"  1000 concurrent identical requests, warm: {warm['total_ms']:.1f} ms "
          f"({warm['per_request_us']:.1f} us each)")
    print(f"  p50 targets: memory hit under 20 us: {'met' if results['memory hit']['p50_us'] < 20 else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
