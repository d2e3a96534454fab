"""Where a trivial ``run()``'s round trip goes, step by step, beside anyio's round trip and a
bare asyncio ping-pong (no pool, no supervision: the floor for two processes and a loop).

Also the same ``run()`` with the scheduler's metrics off (no request records), and the
pool alone (the job submitted to ``WorkerPool`` and its future awaited: no admission, no
cache, no record), which split aiocompile's round trip by layer.

For aiocompile (``abs``, and ``negate``, a function of this script's ``__main__``), three
steps, from timestamps taken in this process: ``call -> written`` (the parent's work
before the job's write, the write included), ``written -> readable``
(the worker's wake-up, its work and answer, the parent's wake-up) and ``readable ->
resumed`` (the parent's work from the answer to the caller's next line). The timestamps
come from wrapping two internal functions (the job's write and the loop's read), so this is
a diagnostic, not a figure to compare pools by: ``bench_dispatch.py`` is that.

    python benchmarks/dispatch_steps.py [--calls 1000] [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def negate(x: int) -> int:
    """A function of the program's ``__main__`` (run as a script): sent by value once."""
    return -x


def _bare_worker(jobs: int, answers: int) -> None:
    while True:
        data = os.read(jobs, 4096)
        if not data:
            return
        fn, args = pickle.loads(data)
        os.write(answers, pickle.dumps(fn(*args)))


async def measure(calls: int, rounds: int) -> dict[str, list[float]]:
    import anyio
    import anyio.to_process

    import aiocompile
    from aiocompile._pool import loop_reads, roster

    marks: dict[str, float] = {}
    write_all, on_readable = roster._write_all, loop_reads.LoopReads.on_readable

    def timed_write(fd: int, parts: list[bytes]) -> None:
        write_all(fd, parts)
        marks["written"] = time.perf_counter()

    def timed_read(reads: object, worker: object, reader: object) -> None:
        marks["readable"] = time.perf_counter()
        on_readable(reads, worker, reader)  # type: ignore[arg-type]

    roster._write_all = timed_write
    loop_reads.LoopReads.on_readable = timed_read  # type: ignore[method-assign]

    loop = asyncio.get_running_loop()
    sched = aiocompile.Scheduler(workers=1)
    limiter = anyio.CapacityLimiter(1)
    jobs_r, jobs_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(jobs_w)
        os.close(answers_r)
        try:
            _bare_worker(jobs_r, answers_w)
        finally:
            os._exit(0)
    os.close(jobs_r)
    os.close(answers_w)
    os.set_blocking(answers_r, False)

    async def bare() -> object:
        answered: asyncio.Future[object] = loop.create_future()

        def read() -> None:
            loop.remove_reader(answers_r)
            answered.set_result(pickle.loads(os.read(answers_r, 4096)))

        loop.add_reader(answers_r, read)
        os.write(jobs_w, pickle.dumps((abs, (-1,))))
        return await answered

    # The same round trip with the scheduler's request records off, and the pool's own
    # (the job submitted to the pool and its future awaited: no admission, cache, record).
    quiet = aiocompile.Scheduler(workers=1, config=aiocompile.SchedulerConfig(metrics=False))
    pool = sched.port._pool  # a diagnostic, as the wrapped functions above are

    async def pool_alone() -> object:
        from aiocompile._base import bridge

        job = pool.submit_job(abs, (-1,), direct=True)
        job.look_for_answer()  # as the scheduler does: the answer looked for before the await
        return await bridge.wait(job.future)

    split = ("call -> written", "written -> readable", "readable -> resumed", "aiocompile")
    steps: dict[str, list[float]] = {name: [] for name in (
        *split, *(f"{name}, __main__" for name in split), "aiocompile, metrics off",
        "the pool alone", "anyio to_process", "anyio __main__", "bare")}
    try:
        for _ in range(200):
            await sched.run(abs, -1)
            await sched.run(negate, -1)
            await anyio.to_process.run_sync(negate, -1, limiter=limiter)
            await quiet.run(abs, -1)
            await pool_alone()
            await anyio.to_process.run_sync(abs, -1, limiter=limiter)
            await bare()
        for _ in range(rounds):
            for fn, suffix in ((abs, ""), (negate, ", __main__")):
                for _ in range(calls):
                    started = time.perf_counter()
                    await sched.run(fn, -1)
                    resumed = time.perf_counter()
                    steps["call -> written" + suffix].append(marks["written"] - started)
                    steps["written -> readable" + suffix].append(marks["readable"] - marks["written"])
                    steps["readable -> resumed" + suffix].append(resumed - marks["readable"])
                    steps["aiocompile" + suffix].append(resumed - started)
            for name, call in (("aiocompile, metrics off", lambda: quiet.run(abs, -1)),
                               ("the pool alone", pool_alone),
                               ("anyio to_process", lambda: anyio.to_process.run_sync(abs, -1, limiter=limiter)),
                               ("anyio __main__", lambda: anyio.to_process.run_sync(negate, -1, limiter=limiter)),
                               ("bare", bare)):
                for _ in range(calls):
                    started = time.perf_counter()
                    await call()
                    steps[name].append(time.perf_counter() - started)
    finally:
        os.close(jobs_w)
        os.waitpid(pid, 0)
        await sched.aclose()
        await quiet.aclose()
        roster._write_all = write_all
        loop_reads.LoopReads.on_readable = on_readable  # type: ignore[method-assign]
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000, help="calls per way and round")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    steps = asyncio.run(measure(args.calls, args.rounds))
    print(f"{args.calls * args.rounds} calls each, one worker, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    for name, values in steps.items():
        values.sort()
        pick = lambda p: values[int(p * (len(values) - 1))] * 1e6  # noqa: B023, E731
        print(f"{name:31} p50 {pick(0.5):7.1f} µs   p10 {pick(0.1):7.1f}   p90 {pick(0.9):7.1f}")


if __name__ == "__main__":
    main()
