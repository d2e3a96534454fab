"""Answers read by the event loop itself.

``Scheduler.run`` awaited from an asyncio loop, with a worker idle, has the worker's answer
read by that loop (``add_reader``), not by the pool's supervisor thread. Under trio the
supervisor reads it, as it does for every compile. These tests run real workers and check
both paths end the same way, and that the loop path gives the socket back to the
supervisor for everything that is not one whole, small answer: a crash, a timeout, a large
answer, a worker too big to keep, and a loop that stops reading (blocked, or closed).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import anyio
import pytest
from jobs import big_result, echo, exit_now, pid, sleep_then

import aiocompile
from aiocompile import JobTimeout, WorkerCrashed
from aiocompile._pool.loop_reads import LOOP_GRACE as _LOOP_GRACE
from aiocompile._pool.pool import WorkerPool
from aiocompile._pool.roster import Roster


class Reads:
    """Counts who read each answer: the loop (``Roster.answered`` called from
    ``LoopReads.on_readable`` with a whole answer), the supervisor (``Roster.answered``
    from its own read), or an answers thread (``Roster._read_stream``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop = 0
        self.supervisor = 0
        self.streamed = 0
        answered, read_stream = Roster.answered, Roster._read_stream

        def count_answered(roster, worker, done, *, in_loop):
            if in_loop:
                self.loop += not done.follows  # a whole answer, not a header of one to stream
            else:
                self.supervisor += 1
            return answered(roster, worker, done, in_loop=in_loop)

        def streamed(roster, worker, done, fd):
            self.streamed += 1
            read_stream(roster, worker, done, fd)

        monkeypatch.setattr(Roster, "answered", count_answered)
        monkeypatch.setattr(Roster, "_read_stream", streamed)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_run_is_answered_in_the_loop_under_asyncio_and_by_the_supervisor_under_trio(
    monkeypatch, async_runner
):
    reads = Reads(monkeypatch)
    async with aiocompile.Scheduler(workers=1) as sched:
        await sched.run(echo, 0)  # start the worker: the first job waits for it
        before = (reads.loop, reads.supervisor)
        results = [await sched.run(echo, i) for i in range(50)]
        assert results == list(range(50))
        loop_reads, supervisor_reads = reads.loop - before[0], reads.supervisor - before[1]
        if async_runner == "asyncio":
            assert (loop_reads, supervisor_reads) == (50, 0)
        else:
            assert (loop_reads, supervisor_reads) == (0, 50)
        stats = sched.statistics()
        assert stats.outcomes["compiled"] == 51 and stats.in_flight == 0


async def test_many_concurrent_runs_with_crashes_each_get_their_own_answer():
    async with aiocompile.Scheduler(workers=2, max_crashes=1) as sched:
        async def one(i: int):
            try:
                return await (sched.run(exit_now, 3) if i % 10 == 3 else sched.run(echo, i))
            except WorkerCrashed:
                return "crashed"

        results: dict[int, object] = {}

        async def store(i: int) -> None:
            results[i] = await one(i)

        async with anyio.create_task_group() as tg:
            for i in range(120):
                tg.start_soon(store, i)
        assert results == {i: ("crashed" if i % 10 == 3 else i) for i in range(120)}
        stats = sched.statistics()
        assert stats.outcomes["crashed"] == 12 and stats.outcomes["compiled"] == 108 and stats.in_flight == 0
        assert await sched.run(echo, "after") == "after"


async def test_a_crash_and_a_timeout_go_back_to_the_supervisor_and_the_next_run_is_read_in_the_loop(
    monkeypatch, async_runner
):
    reads = Reads(monkeypatch)
    async with aiocompile.Scheduler(workers=1, max_crashes=1) as sched:
        first = await sched.run(pid)
        with pytest.raises(WorkerCrashed):
            await sched.run(exit_now, 7)
        with pytest.raises(JobTimeout):
            await sched.run(sleep_then, 30, timeout=0.5)
        second = await sched.run(pid)  # read by either: its worker may still be starting
        assert second != first  # two workers were lost and replaced
        before = reads.loop
        assert await sched.run(echo, "next") == "next"  # its worker idle now
        assert reads.loop - before == (1 if async_runner == "asyncio" else 0)
        stats = sched.statistics()
        assert (stats.outcomes["crashed"], stats.outcomes["timeout"], stats.in_flight) == (1, 1, 0)


async def test_a_large_answer_is_streamed_by_an_answers_thread_not_read_in_the_loop(monkeypatch):
    reads = Reads(monkeypatch)
    async with aiocompile.Scheduler(workers=1) as sched:
        await sched.run(echo, 0)
        before = (reads.loop, reads.streamed)
        data = await sched.run(big_result, 2)
        assert data == b"\x01" * (2 * 1024 * 1024)
        assert (reads.loop - before[0], reads.streamed - before[1]) == (0, 1)
        assert await sched.run(echo, 1) == 1


async def test_a_worker_too_big_after_a_run_is_replaced_by_the_supervisor():
    config = aiocompile.SchedulerConfig(workers=1, max_worker_rss=1)  # every worker is too big
    async with aiocompile.Scheduler(config=config) as sched:
        pids = [await sched.run(pid) for _ in range(3)]
        assert len(set(pids)) == 3
        assert sched.statistics().workers_recycled >= 2


async def test_an_idle_worker_killed_between_runs_costs_no_job():
    async with aiocompile.Scheduler(workers=1) as sched:
        victim = await sched.run(pid)
        os.kill(victim, signal.SIGKILL)
        await anyio.sleep(0.2)
        assert await sched.run(echo, "still here") == "still here"
        assert sched.statistics().outcomes.get("crashed", 0) == 0


def test_a_blocked_loop_holds_a_shared_answer_for_at_most_the_grace_period():
    """Loop A starts a keyed run and then blocks its thread; a caller in loop B, which
    joined the same job, gets the answer from the supervisor after ``_LOOP_GRACE``, not
    when A wakes up."""
    sched = aiocompile.Scheduler(workers=1)
    try:
        async def warm():
            await sched.run(echo, 0)

        asyncio.run(warm())
        joined_at: list[float] = []
        started = threading.Event()

        async def in_b():
            started.wait(10)
            await asyncio.sleep(0.05)
            assert await sched.run(sleep_then, 0.2, "shared", key="shared-job") == "shared"
            joined_at.append(time.monotonic())

        b = threading.Thread(target=lambda: asyncio.run(in_b()))
        b.start()

        async def in_a():
            task = asyncio.ensure_future(sched.run(sleep_then, 0.2, "shared", key="shared-job"))
            await asyncio.sleep(0)  # admitted, sent, its answer to be read by this loop
            started.set()
            blocked_at = time.monotonic()
            time.sleep(_LOOP_GRACE + 2.0)  # this loop reads nothing meanwhile
            assert await task == "shared"
            return blocked_at

        blocked_at = asyncio.run(in_a())
        b.join(10)
        assert joined_at, "the joining caller got no answer"
        waited = joined_at[0] - blocked_at
        assert waited < _LOOP_GRACE + 1.5, f"B waited {waited:.2f} s, as long as A was blocked"
        stats = sched.statistics()
        assert stats.outcomes["compiled"] == 2 and stats.outcomes["joined"] == 1 and stats.in_flight == 0
    finally:
        sched.close(grace=0)


def test_a_job_whose_loop_closed_is_taken_back_and_the_pool_closes():
    pool = WorkerPool(1)
    try:
        assert pool.submit(echo, 0).result(30) == 0

        async def abandon():
            job = pool.submit_job(sleep_then, (0.5, "late"), direct=True)
            return job

        job = asyncio.run(abandon())  # the loop that was to read the answer is closed now
        assert job.future.result(10) == "late"
        assert pool.submit(echo, 1).result(10) == 1
    finally:
        started = time.monotonic()
        pool.shutdown(wait=True)
        assert time.monotonic() - started < 10


def test_answers_read_in_loops_leave_no_descriptor_behind():
    """Each loop that reads answers holds one duplicate of a worker's socket while it keeps
    using that worker; one closed loop's is closed by the next loop's first job there, and
    all of them when the scheduler closes."""

    async def many(sched):
        for i in range(300):
            assert await sched.run(echo, i) == i

    start = open_fds()
    sched = aiocompile.Scheduler(workers=2)
    try:
        asyncio.run(many(sched))
        after_one_loop = open_fds()
        for _ in range(3):
            asyncio.run(many(sched))
        assert open_fds() == after_one_loop
    finally:
        sched.close(grace=0)
    assert open_fds() == start


def test_runs_under_uvloop_are_read_in_the_loop(monkeypatch):
    uvloop = pytest.importorskip("uvloop")
    reads = Reads(monkeypatch)

    async def main():
        async with aiocompile.Scheduler(workers=1, max_crashes=1) as sched:
            await sched.run(echo, 0)
            before = reads.loop
            assert [await sched.run(echo, i) for i in range(20)] == list(range(20))
            assert reads.loop - before == 20
            with pytest.raises(WorkerCrashed):
                await sched.run(exit_now, 9)
            assert await sched.run(echo, "after") == "after"

    uvloop.run(main())


def test_the_loop_looks_for_an_answer_no_longer_than_its_linger_and_reads_it_when_it_is_there(monkeypatch):
    """``LoopReads.linger``, the loop's look at a worker's socket right after a job is sent:
    it reads the answer as soon as it is readable (``on_readable``, without another turn
    of the loop), returns at once when the answer is no longer the loop's to read, and
    after ``LINGER`` seconds, reading nothing, when nothing comes."""
    import socket
    import types

    from aiocompile._pool import loop_reads
    from aiocompile._pool.handle import LoopReader

    class Reads(loop_reads.LoopReads):
        def __init__(self) -> None:
            self.read: list[tuple] = []

        def on_readable(self, worker, reader) -> None:
            self.read.append((worker, reader))

    reads = Reads()
    ours, workers_end = socket.socketpair()
    try:
        reader = LoopReader(None, os.dup(ours.fileno()))
        worker = types.SimpleNamespace(reader=reader)
        monkeypatch.setattr(loop_reads, "LINGER", 0.2)
        began = time.perf_counter()
        reads.linger(worker, reader)  # nothing comes: the whole linger, and nothing read
        assert 0.2 <= time.perf_counter() - began < 2.0
        assert reads.read == []

        monkeypatch.setattr(loop_reads, "LINGER", 30.0)
        worker.reader = None  # read by someone else meanwhile: no look at all
        began = time.perf_counter()
        reads.linger(worker, reader)
        assert time.perf_counter() - began < 1.0 and reads.read == []

        worker.reader = reader
        workers_end.send(b"answer")  # the answer is there: the look ends at once, and reads it
        began = time.perf_counter()
        reads.linger(worker, reader)
        assert time.perf_counter() - began < 1.0
        assert reads.read == [(worker, reader)]
        reader.close()
    finally:
        ours.close()
        workers_end.close()


async def test_a_run_that_takes_long_holds_the_loop_no_longer_than_the_linger():
    """A job's answer that takes long to come is not waited for in the loop: the loop's
    longest tick while it runs stays far under the job's time (a second; half of it allowed
    for what else a loaded machine's test process meets, a full garbage collection of a
    process with torch imported among them: 124 ms once beside the other test process)."""
    gaps: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await anyio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with aiocompile.Scheduler(workers=1) as sched:
        await sched.run(echo, 0)  # the worker started and, under asyncio, the loop's reader registered
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(ticker)
            await anyio.sleep(0.01)
            assert await sched.run(sleep_then, 1.0, "late") == "late"
            done.set()
    assert max(gaps) < 0.5, max(gaps)


async def test_runs_back_to_back_let_the_loop_go_now_and_then():
    """A run's answer that is back by the time the task looks for it returns without a
    turn of the loop; runs awaited back to back still let the loop go every
    ``Turns.HOLD_MAX`` seconds, so that another task keeps running beside them."""
    turns = 0
    done = False

    async def other() -> None:
        nonlocal turns
        while not done:
            await anyio.sleep(0)
            turns += 1

    async with aiocompile.Scheduler(workers=1) as sched:
        await sched.run(echo, 0)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(other)
            await anyio.sleep(0)
            began = time.perf_counter()
            for i in range(400):
                assert await sched.run(echo, i) == i
            took = time.perf_counter() - began
            seen = turns
            done = True
    # Each run takes tens of microseconds at least: 400 of them span many HOLD_MAX.
    assert seen >= max(2, int(took / 0.0005 / 4)), (seen, took)
