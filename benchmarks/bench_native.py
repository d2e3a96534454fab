"""Building 32 C++ translation units into shared libraries: aiocompile beside a stdlib
``ProcessPoolExecutor`` running the same compiler command, and beside a serial loop, in
one run.

The units are generated (``_cpp_units.py``: 380 to 490 lines each of class hierarchies,
class and function templates, STL containers and algorithms) and are the same on every
run. Every way runs the very command line aiocompile runs
(``c++ -shared -fPIC -pipe -O2 -std=c++17 -o libsource.so source.cpp -MMD -MF source.d``)
in a fresh directory per unit and brings the library's bytes back to the parent:

- serial: one compile after another, in this process;
- ``ProcessPoolExecutor(N)`` (forkserver) driven by ``loop.run_in_executor``, one job per
  unit, the pool started inside the timed region;
- ``aiocompile Scheduler(N)``: ``compile_many`` of 32 ``"kind": "cpp"`` specs, the
  scheduler started inside the timed region, memory cache empty, no disk cache; twice:
  with its workers (and so the compilers they run) at the priority of the pool's
  (``worker_nice=0``), and as configured by default (``worker_nice=10``: ten steps nicer
  than the serving process). On an idle machine the two are alike; on a machine busy with
  other work, nicer compilers get a far smaller share of the CPUs (a tenth of a nice-0
  process's, with Linux's weights), which is what the default is for, and which the
  first row leaves out of the comparison with the pool.

Modules are imported before the clock starts; starting each pool is timed.

While each pool compiles, a ticker on the event loop wakes every 1 ms and notes how late
it woke (the loop's lag); the CPU time this process used meanwhile (its threads, not its
workers) is what each way takes from the CPUs the compilers need. The ways run in turn, in
a rotated order each round; the median of ``--repeat`` rounds is reported, with the
ratios.

    python benchmarks/bench_native.py [--workers N] [--repeat R] [--units 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from _cpp_units import UNITS, compile_unit, unit  # noqa: E402

FLAGS = ("-O2", "-std=c++17")


class Ticker:
    """Wakes every ``period`` seconds and keeps how late each wake-up was."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.lags: list[float] = []
        self._stop = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop:
            due = loop.time() + self.period
            await asyncio.sleep(self.period)
            self.lags.append(max(0.0, loop.time() - due))

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.lags) or [0.0]
        return {"lag_max_ms": ordered[-1] * 1000, "lag_p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1000,
                "lag_p50_ms": ordered[len(ordered) // 2] * 1000, "ticks": len(self.lags)}


def _cpu() -> float:
    """CPU seconds this process (all its threads, not its children) has used: what a way
    takes from the CPUs its compilers need, beyond the compilers themselves."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _ticking(work):  # type: ignore[no-untyped-def]
    ticker = Ticker()
    tick = asyncio.create_task(ticker.run())
    await asyncio.sleep(0.01)
    started, cpu = time.perf_counter(), _cpu()
    result = await work()
    wall, cpu = time.perf_counter() - started, _cpu() - cpu
    ticker._stop = True
    await tick
    return result, {"wall": wall, "parent_cpu": cpu, **ticker.summary()}


def command() -> list[str]:
    """The command line aiocompile runs with ``FLAGS`` (the source is always
    ``source.cpp``): taken from its C++ backend, so that every way runs the very same one."""
    from aiocompile.backends.cpp import CppBackend

    backend = CppBackend()
    plan = backend.plan(backend.check(source=unit(0), flags=FLAGS))
    return list(plan.finish(backend.headers.scan(plan.dependency_pass.source, plan.search)).args[0].argv)


def serial(argv: list[str], sources: list[str]) -> tuple[list[bytes], dict[str, float]]:
    started, cpu = time.perf_counter(), _cpu()
    built = [compile_unit(argv, source) for source in sources]
    return built, {"wall": time.perf_counter() - started, "parent_cpu": _cpu() - cpu}


def stdlib_pool(argv: list[str], sources: list[str], workers: int) -> tuple[list[bytes], dict[str, float]]:
    async def work() -> list[bytes]:
        loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("forkserver")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            return list(await asyncio.gather(*(loop.run_in_executor(pool, compile_unit, argv, source)
                                               for source in sources)))

    result: tuple[list[bytes], dict[str, float]] = asyncio.run(_ticking(work))
    return result


def with_aiocompile(sources: list[str], workers: int, nice: int) -> tuple[list[bytes], dict[str, float]]:
    import aiocompile

    specs = [{"kind": "cpp", "source": source, "flags": FLAGS, "name": f"unit{n}"} for n, source in enumerate(sources)]

    async def work() -> list[bytes]:
        config = aiocompile.SchedulerConfig(workers=workers, preload=(), worker_nice=nice)
        async with aiocompile.Scheduler(config=config) as sched:
            libraries = await sched.compile_many(specs)
        return [library.binary for library in libraries]

    result: tuple[list[bytes], dict[str, float]] = asyncio.run(_ticking(work))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=1, help="rounds (default 1); the median is reported")
    parser.add_argument("--units", type=int, default=UNITS, help=f"translation units (default {UNITS})")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()

    # What each way imports, imported before any clock starts.
    import multiprocessing.forkserver  # noqa: F401

    import anyio._backends._asyncio  # noqa: F401 - anyio's asyncio backend, imported on first use

    import aiocompile._core.scheduler  # noqa: F401
    from aiocompile.backends._native import _compiler

    compiler = _compiler.identify(_compiler.find("cpp", None))
    sources = [unit(n) for n in range(args.units)]
    argv = command()
    lines = sorted(len(source.splitlines()) for source in sources)
    pool_name = f"ProcessPoolExecutor({args.workers}) + run_in_executor"
    ours_name = f"aiocompile Scheduler({args.workers}, worker_nice=0)"
    default_name = f"aiocompile Scheduler({args.workers}), default worker_nice=10"
    ways = {
        "serial": lambda: serial(argv, sources),
        pool_name: lambda: stdlib_pool(argv, sources, args.workers),
        ours_name: lambda: with_aiocompile(sources, args.workers, 0),
        default_name: lambda: with_aiocompile(sources, args.workers, 10),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
    reference: list[bytes] | None = None
    names = list(ways)
    for round_ in range(args.repeat):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            built, figures = ways[name]()
            assert len(built) == len(sources) and all(data[:4] == b"\x7fELF" for data in built), name
            if reference is None:
                reference = built
            # Same command, same source, same compiler: the same library, byte for byte
            # (the scratch directory's name is nowhere in it).
            same = sum(a == b for a, b in zip(built, reference))
            figures["identical_libraries"] = same
            runs[name].append(figures)
            print(f"round {round_ + 1}: {name:48} {figures['wall']:7.2f} s, this process's CPU "
                  f"{figures['parent_cpu']:5.2f} s"
                  + (f"   loop lag max {figures['lag_max_ms']:6.1f} ms" if "lag_max_ms" in figures else ""),
                  file=sys.stderr)

    def median(name: str, field: str) -> float:
        return statistics.median(run[field] for run in runs[name])

    results = {}
    for name in ways:
        row = {"wall": median(name, "wall"), "walls": [run["wall"] for run in runs[name]],
               "parent_cpu": median(name, "parent_cpu"),
               "identical_libraries": min(run["identical_libraries"] for run in runs[name])}
        if "lag_max_ms" in runs[name][0]:
            row.update({"lag_max_ms": max(run["lag_max_ms"] for run in runs[name]),
                        "lag_p99_ms": median(name, "lag_p99_ms")})
        results[name] = row
    serial_wall, pool_wall, ours_wall, default_wall = (results[name]["wall"] for name in names)
    report = {
        "units": len(sources), "lines_min": lines[0], "lines_median": lines[len(lines) // 2], "lines_max": lines[-1],
        "compiler": compiler.path, "compiler_version": compiler.version, "flags": list(FLAGS),
        "command": " ".join(argv), "cpus": os.cpu_count(), "workers": args.workers,
        "repeat": args.repeat, "results": results,
        "ratios": {"aiocompile / ProcessPoolExecutor": ours_wall / pool_wall,
                   "aiocompile default nice / ProcessPoolExecutor": default_wall / pool_wall,
                   "serial / aiocompile": serial_wall / ours_wall,
                   "serial / ProcessPoolExecutor": serial_wall / pool_wall},
        "load_average_after": list(os.getloadavg()),
    }
    print(f"{len(sources)} C++ units ({lines[0]}-{lines[-1]} lines), {compiler.name} {compiler.version} "
          f"{' '.join(FLAGS)}, {args.workers} workers, {os.cpu_count()} CPUs, median of {args.repeat}")
    for name, row in results.items():
        lag = (f"   loop lag max {row['lag_max_ms']:6.1f} ms, p99 {row['lag_p99_ms']:5.2f} ms"
               if "lag_max_ms" in row else "")
        print(f"  {name:48} {row['wall']:7.2f} s   {serial_wall / row['wall']:5.2f}x serial   "
              f"this process's CPU {row['parent_cpu']:5.2f} s{lag}")
    print(f"  aiocompile / ProcessPoolExecutor wall: {ours_wall / pool_wall:.3f} at the same priority, "
          f"{default_wall / pool_wall:.3f} with the default worker_nice; load average now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
