"""Whatever a job answers, its caller gets a result or an exception, and nothing else is
touched (``aiocompile._pool.protocol``, ``aiocompile._pool.roster``): exceptions this
process cannot rebuild, large answers streamed by an answers thread, and a worker that dies
while its answer is read.

Under asyncio an idle worker's answer is read by the event loop, under trio by the pool's
supervisor; a queued job's answer is always the supervisor's. Each case runs both ways.
"""

from __future__ import annotations

import os
import signal

import anyio
import jobs
import pytest

import aiocompile
from aiocompile import JobError
from aiocompile._pool.roster import Roster
from aiocompile.errors import RemoteTraceback

CONFIG = aiocompile.SchedulerConfig(workers=1, preload=())


@pytest.fixture
def worker_only_dir(tmp_path):
    """A directory holding a module that this process never imports (it is not on this
    process's sys.path); jobs put it on their worker's."""
    (tmp_path / f"{jobs.WORKER_ONLY_MODULE}.py").write_text(jobs.WORKER_ONLY_SOURCE)
    return str(tmp_path)


async def run_beside_a_queued_innocent(sched, fn, *args):
    """Run ``fn`` twice: alone (an idle worker: the loop reads the answer under asyncio),
    and queued behind a job (the supervisor reads it). Returns both outcomes, and checks
    that the innocent queued beside it succeeded."""
    outcomes = []
    try:
        outcomes.append(await sched.run(fn, *args))
    except Exception as exc:
        outcomes.append(exc)
    results: dict[str, object] = {}

    async def innocent():
        results["innocent"] = await sched.run(jobs.sleep_then, 0.3, "innocent")

    async def queued():
        try:
            results["queued"] = await sched.run(fn, *args)
        except Exception as exc:
            results["queued"] = exc

    async with anyio.create_task_group() as group:
        group.start_soon(innocent)
        await anyio.sleep(0.05)  # the innocent holds the only worker: the next one queues
        group.start_soon(queued)
    assert results["innocent"] == "innocent"
    outcomes.append(results["queued"])
    return outcomes


async def test_an_exception_whose_class_only_the_worker_can_import_reaches_its_caller(worker_only_dir):
    async with aiocompile.Scheduler(config=CONFIG) as sched:
        with anyio.fail_after(60):
            await sched.run(jobs.echo, 0)
            outcomes = await run_beside_a_queued_innocent(sched, jobs.raise_worker_only, worker_only_dir, "why")
            for exc in outcomes:
                assert isinstance(exc, JobError)
                assert f"{jobs.WORKER_ONLY_MODULE}.OnlyHere: why" in str(exc)
                assert "could not be rebuilt here" in str(exc)
                assert isinstance(exc.__cause__, RemoteTraceback) and "raise_worker_only" in exc.__cause__.tb
            assert await sched.run(jobs.echo, "still serving") == "still serving"
        assert not sched.closed
        stats = sched.statistics()
        assert (stats.worker_crashes, stats.workers_started, stats.failed) == (0, 1, 2)


async def test_an_exception_whose_output_is_read_only_arrives_as_itself():
    async with aiocompile.Scheduler(config=CONFIG) as sched:
        with anyio.fail_after(60):
            await sched.run(jobs.echo, 0)
            for exc in await run_beside_a_queued_innocent(sched, jobs.raise_read_only_output, "printed first"):
                assert isinstance(exc, jobs.ReadOnlyOutput) and str(exc) == "output is not mine to set"
                assert isinstance(exc.__cause__, RemoteTraceback)
            assert await sched.run(jobs.echo, 1) == 1
        assert sched.statistics().worker_crashes == 0


async def test_a_large_answer_arrives_whole_and_the_worker_serves_on():
    async with aiocompile.Scheduler(config=CONFIG) as sched:
        with anyio.fail_after(120):
            first = await sched.run(jobs.pid)
            outcomes = await run_beside_a_queued_innocent(sched, jobs.big_result, 8)
            assert outcomes == [b"\x01" * (8 << 20)] * 2
            with pytest.raises(ValueError) as info:
                await sched.run(jobs.raise_big, 2)
            assert str(info.value) == "e" * (2 << 20)
            assert await sched.run(jobs.pid) == first  # the same worker, never lost
        assert sched.statistics().worker_crashes == 0


async def test_a_large_answer_that_cannot_be_unpickled_here_fails_alone_and_leaves_the_socket_clean(
    worker_only_dir,
):
    async with aiocompile.Scheduler(config=CONFIG) as sched:
        with anyio.fail_after(120):
            first = await sched.run(jobs.pid)
            for exc in await run_beside_a_queued_innocent(
                sched, jobs.big_result_holding_a_worker_only_object, worker_only_dir, 4
            ):
                assert isinstance(exc, TypeError) and "could not be unpickled here" in str(exc)
            # What followed the failed object was read and dropped: the next answer is whole.
            assert await sched.run(jobs.echo, "next") == "next"
            assert await sched.run(jobs.pid) == first
        assert sched.statistics().worker_crashes == 0


async def test_a_worker_that_dies_while_its_large_answer_is_read_is_a_crash_and_the_job_is_retried(
    monkeypatch,
):
    read_stream = Roster._read_stream
    killed: list[int] = []

    def kill_first_then_read(roster, worker, done, fd):
        if not killed:
            # The header is read; most of the 16 MB is still in the worker, blocked on
            # the socket: it dies halfway through its answer.
            killed.append(worker.proc.pid)
            os.kill(worker.proc.pid, signal.SIGKILL)
        read_stream(roster, worker, done, fd)

    monkeypatch.setattr(Roster, "_read_stream", kill_first_then_read)
    async with aiocompile.Scheduler(config=CONFIG) as sched:
        with anyio.fail_after(120):
            assert await sched.run(jobs.big_result, 16) == b"\x01" * (16 << 20)
            assert await sched.run(jobs.pid) != killed[0]
        stats = sched.statistics()
        assert (stats.worker_crashes, stats.retries, stats.compiled) == (1, 1, 2)
