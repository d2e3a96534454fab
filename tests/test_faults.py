"""The fault-injection suite: real faults, beside real innocent work, through the scheduler.

Every test runs under asyncio and under trio, every await is bounded, and each test
checks that every innocent job succeeded, the exact counts in ``statistics()``, and that
no process of the scheduler is left once it is closed.
"""

import contextlib
import logging
import os
import signal
import time

import anyio
import jobs
import pytest
from conftest import alive, owned_pids, wait_until
from triton_kernels import ADD_SIGNATURE, add_kernel

import aiocompile

NO_PRELOAD = aiocompile.SchedulerConfig(workers=2, preload=())


def innocent_compile(sched, block):
    return sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": block}, target="cuda:80")


async def gather(*coroutine_functions):
    """Run them concurrently; return each result or exception, in order."""
    results = [None] * len(coroutine_functions)

    async def one(i, fn):
        try:
            results[i] = await fn()
        except Exception as exc:  # noqa: BLE001 - collected for the test to inspect
            results[i] = exc

    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            for i, fn in enumerate(coroutine_functions):
                group.start_soon(one, i, fn)
    return results


async def close_and_check(sched):
    pids = owned_pids(sched)
    await sched.aclose()
    assert not alive(pids), f"left running after aclose(): {alive(pids)}"


# -- crashes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "args", "exitcode"),
    [(jobs.kill_self, (), -signal.SIGKILL), (jobs.segfault, (), -signal.SIGSEGV), (jobs.exit_now, (7,), 7)],
    ids=["SIGKILL", "SIGSEGV", "os._exit"],
)
async def test_a_crashing_job_fails_alone_and_innocents_succeed(fault, args, exitcode):
    sched = aiocompile.Scheduler(workers=2)
    try:
        results = await gather(
            *[lambda b=b: innocent_compile(sched, b) for b in (64, 128, 256)],
            lambda: sched.run(fault, *args),
            *[lambda b=b: innocent_compile(sched, b) for b in (512, 1024)],
        )
        poison = results[3]
        assert isinstance(poison, aiocompile.WorkerCrashed), poison
        assert poison.exitcode == exitcode and poison.attempts == 2
        assert poison.kernel_name == fault.__qualname__
        # A run()'s job is a function's, named as such; the count in words.
        assert str(poison).startswith(f"function {fault.__qualname__!r}: killed its worker 2 times, last with ")
        innocents = results[:3] + results[4:]
        assert all(isinstance(k, aiocompile.TritonKernel) for k in innocents), innocents
        stats = sched.statistics()
        assert (stats.submitted, stats.compiled, stats.failed) == (6, 5, 1)
        assert (stats.worker_crashes, stats.retries, stats.timeouts, stats.in_flight) == (2, 1, 0, 0)
        # The pool replaced the dead workers and carries on.
        assert (await innocent_compile(sched, 2048)).binary
        assert wait_until(lambda: len(sched.worker_pids()) == 2)
    finally:
        await close_and_check(sched)


async def test_a_crash_and_its_retry_log_nothing_alarming(caplog):
    # Every logger at every level: a retried job's future is RUNNING already, and the
    # stdlib logs "Future ... in unexpected state" at CRITICAL if it is started again.
    caplog.set_level(logging.DEBUG)
    sched = aiocompile.Scheduler(workers=1, max_crashes=2)
    try:
        with anyio.fail_after(60), pytest.raises(aiocompile.WorkerCrashed) as info:
            await sched.run(os.abort)
        assert info.value.attempts == 2
    finally:
        await close_and_check(sched)
    alarming = [(r.name, r.levelname, r.getMessage()) for r in caplog.records
                if r.levelno >= logging.ERROR or not r.name.startswith("aiocompile")]
    assert alarming == []
    # What it did log: each death, as a warning.
    assert sum("exited (crashed" in r.getMessage() for r in caplog.records) == 2


async def test_a_worker_killed_from_outside_like_the_oom_killer(tmp_path):
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    marker = tmp_path / "pids"
    try:
        async def kill_the_victim_twice():
            def started(attempt):
                return marker.exists() and len(marker.read_text().split()) >= attempt

            for attempt in (1, 2):
                await anyio.to_thread.run_sync(lambda a=attempt: wait_until(lambda: started(a), 60))
                os.kill(int(marker.read_text().split()[attempt - 1]), signal.SIGKILL)

        results = await gather(
            lambda: sched.run(jobs.mark_then_sleep, str(marker), 60),
            lambda: sched.run(jobs.sleep_then, 0.5, "innocent"),
            kill_the_victim_twice,
        )
        assert isinstance(results[0], aiocompile.WorkerCrashed)
        assert results[0].exitcode == -signal.SIGKILL and results[0].signal_name == "SIGKILL"
        assert results[1] == "innocent"
        stats = sched.statistics()
        assert (stats.compiled, stats.failed, stats.worker_crashes, stats.retries) == (1, 1, 2, 1)
    finally:
        await close_and_check(sched)


async def test_what_a_dying_worker_printed_comes_with_the_error():
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(max_crashes=1))
    try:
        with pytest.raises(aiocompile.WorkerCrashed) as info:
            with anyio.fail_after(60):
                await sched.run(jobs.print_then_exit, "ptxas fatal: out of registers (pretend)", 3)
        assert "ptxas fatal: out of registers (pretend)" in info.value.output
        assert "native write before death" in info.value.output
        assert info.value.attempts == 1
        assert str(info.value) == "function 'print_then_exit': killed its worker with exit code 3"
    finally:
        await close_and_check(sched)


async def test_the_fork_server_dying_is_not_the_jobs_fault():
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(max_crashes=1))
    try:
        async def kill_fork_server():
            await anyio.to_thread.run_sync(lambda: wait_until(lambda: len(sched.worker_pids()) == 2, 60))
            await anyio.sleep(0.2)
            os.kill(sched.port._pool._supervisor._launcher._proc.pid, signal.SIGKILL)

        results = await gather(
            lambda: sched.run(jobs.sleep_then, 1.0, "a"),
            lambda: sched.run(jobs.sleep_then, 1.0, "b"),
            kill_fork_server,
        )
        # Even with max_crashes=1, neither job is blamed for the workers that died with
        # the fork server: both were re-run on workers of a new one.
        assert results[:2] == ["a", "b"]
        stats = sched.statistics()
        assert (stats.compiled, stats.failed, stats.retries) == (2, 0, 2)
    finally:
        await close_and_check(sched)


# -- timeouts -----------------------------------------------------------------------------


async def test_a_timeout_kills_that_worker_only_and_the_pool_stays_at_full_size():
    sched = aiocompile.Scheduler(workers=2)
    try:
        await sched.warm("cuda:80")
        before = set(sched.worker_pids())
        started = time.monotonic()
        results = await gather(
            lambda: sched.run(jobs.hang, timeout=0.5),
            *[lambda b=b: innocent_compile(sched, b) for b in (64, 128, 256, 512)],
        )
        assert isinstance(results[0], aiocompile.JobTimeout) and isinstance(results[0], TimeoutError)
        assert time.monotonic() - started < 30
        assert all(isinstance(k, aiocompile.TritonKernel) for k in results[1:])
        stats = sched.statistics()
        assert (stats.compiled, stats.failed, stats.timeouts, stats.worker_crashes) == (4, 1, 1, 0)
        assert wait_until(lambda: len(sched.worker_pids()) == 2)
        assert len(before - set(sched.worker_pids())) == 1  # exactly one worker was replaced
    finally:
        await close_and_check(sched)


async def test_the_scheduler_default_timeout_applies():
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(timeout=0.3))
    try:
        with pytest.raises(aiocompile.JobTimeout) as info:
            with anyio.fail_after(60):
                await sched.run(jobs.hang)
        assert info.value.timeout == 0.3
        assert await sched.run(jobs.echo, "fine") == "fine"
    finally:
        await close_and_check(sched)


# -- cancellation -----------------------------------------------------------------------------


async def test_cancelling_a_queued_request_removes_it_from_the_queue(tmp_path):
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(workers=1))
    marker = tmp_path / "ran"
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(sched.run, jobs.sleep_then, 0.5)
            await anyio.sleep(0.1)
            with anyio.move_on_after(0.1) as scope:
                await sched.run(jobs.mark_then_sleep, str(marker), 0)
            assert scope.cancelled_caught
        assert await sched.run(jobs.echo, "after") == "after"
        assert not marker.exists(), "a cancelled queued job must never run"
        stats = sched.statistics()
        assert (stats.submitted, stats.compiled, stats.cancelled, stats.in_flight) == (3, 2, 1, 0)
    finally:
        await close_and_check(sched)


async def test_cancelling_the_only_waiter_of_a_running_job_keeps_its_result(tmp_path):
    sched = aiocompile.Scheduler(config=NO_PRELOAD)
    marker = tmp_path / "ran"
    try:
        async with anyio.create_task_group() as group:
            async def only_waiter() -> None:
                await sched.run(jobs.mark_then_sleep, str(marker), 2.0, "value", key="k")

            group.start_soon(only_waiter)
            # Cancelled once the job runs (its mark written), not while it waits for a worker
            # to start: a queued job whose only waiter leaves is dropped, not kept.
            with anyio.fail_after(60):
                while not marker.exists():
                    await anyio.sleep(0.01)
            group.cancel_scope.cancel()
        with anyio.fail_after(60):
            assert await sched.run(jobs.mark_then_sleep, str(marker), 2.0, "value", key="k") == "value"
        assert len(marker.read_text().split()) == 1, "the job must have run once, for both callers"
        stats = sched.statistics()
        assert stats.cancelled == 1 and stats.cache_hits + stats.joined == 1 and stats.compiled == 0
        assert stats.worker_crashes == 0
    finally:
        await close_and_check(sched)


async def test_cancel_running_kill_kills_the_worker(tmp_path):
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(cancel_running="kill"))
    marker = tmp_path / "ran"
    try:
        with anyio.move_on_after(0.5):
            await sched.run(jobs.mark_then_sleep, str(marker), 30, key="k")
        victim = int(marker.read_text().split()[0])
        assert wait_until(lambda: not alive({victim}))
        # The key is not remembered: the next request runs the job afresh.
        with anyio.fail_after(60):
            assert await sched.run(jobs.echo, "fresh", key="k") == "fresh"
        stats = sched.statistics()
        assert (stats.cancelled, stats.compiled, stats.worker_crashes) == (1, 1, 0)
    finally:
        await close_and_check(sched)


async def test_a_cancelled_waiter_never_cancels_the_job_for_the_others(tmp_path):
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(cancel_running="kill"))
    marker = tmp_path / "ran"
    try:
        outcome = {}

        async def patient():
            outcome["value"] = await sched.run(jobs.mark_then_sleep, str(marker), 1.0, "shared", key="k")

        async def impatient():
            with anyio.move_on_after(0.2):
                await sched.run(jobs.mark_then_sleep, str(marker), 1.0, "shared", key="k")

        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(patient)
                await anyio.sleep(0.05)
                for _ in range(3):
                    group.start_soon(impatient)
        assert outcome["value"] == "shared"
        assert len(marker.read_text().split()) == 1
        stats = sched.statistics()
        assert (stats.submitted, stats.compiled, stats.joined, stats.cancelled) == (4, 1, 0, 3)
    finally:
        await close_and_check(sched)


# -- shutdown and lifecycle ------------------------------------------------------------------


async def test_aclose_lets_running_jobs_finish_within_the_grace_period_then_kills():
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(workers=2))
    try:
        results = {}

        async def call(name, *args):
            try:
                results[name] = await sched.run(*args)
            except Exception as exc:  # noqa: BLE001
                results[name] = exc

        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(call, "quick", jobs.sleep_then, 0.3, "quick")
                group.start_soon(call, "stuck", jobs.hang)
                group.start_soon(call, "queued", jobs.echo, "queued")
                await anyio.to_thread.run_sync(lambda: wait_until(lambda: len(sched.worker_pids()) == 2, 30))
                await anyio.sleep(0.1)
                started = time.monotonic()
                await close_and_check_graceful(sched, grace=1.0)
                assert time.monotonic() - started < 10
        assert results["quick"] == "quick"
        assert isinstance(results["stuck"], aiocompile.SchedulerClosed)
        assert isinstance(results["queued"], (aiocompile.SchedulerClosed, str))
        assert sched.statistics().in_flight == 0
        with pytest.raises(aiocompile.SchedulerClosed):
            await sched.run(jobs.echo, 1)
    finally:
        await sched.aclose()


async def close_and_check_graceful(sched, grace):
    pids = owned_pids(sched)
    await sched.aclose(grace=grace)
    assert not alive(pids)


def open_elsewhere(semaphores):
    """Those of the named semaphores (``sem.*`` in /dev/shm) that a live process other than
    this one has mapped. By inode: glibc maps a semaphore's file under a temporary name
    before it links it to its own, so the mapping shows the temporary one."""
    inodes = {}
    for name in semaphores:
        with contextlib.suppress(OSError):
            inodes[os.stat(f"/dev/shm/{name}").st_ino] = name
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                lines = [line.split() for line in f if "/dev/shm/" in line]
        except OSError:
            continue
        found |= {inodes[int(fields[4])] for fields in lines if int(fields[4]) in inodes}
    return found


async def test_no_descriptor_or_semaphore_leaks():
    def fds():
        return len(os.listdir("/proc/self/fd"))

    def semaphores():
        return {name for name in os.listdir("/dev/shm") if name.startswith("sem.")} if os.path.isdir("/dev/shm") \
            else set()

    for _ in range(2):  # the first round may open descriptors that stay (thread pools, ...)
        fd_before, sem_before = fds(), semaphores()
        sched = aiocompile.Scheduler(config=NO_PRELOAD)
        with anyio.fail_after(60):
            assert await sched.run(jobs.echo, 1) == 1
            with pytest.raises(aiocompile.WorkerCrashed):
                await sched.run(jobs.exit_now, 1)
        await close_and_check(sched)
    assert fds() == fd_before
    # /dev/shm is the machine's: other processes' semaphores come and go meanwhile (another
    # test process's stdlib pool or Dask cluster, say). None of the ones there now may be
    # new, unless a live process other than this one has it open: then it is in use, not
    # one that our processes left behind (they are gone, and this process holds none).
    new = semaphores() - sem_before
    assert not new - open_elsewhere(new), new


async def test_a_worker_that_grows_too_big_is_replaced_after_its_job():
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(workers=1, max_worker_rss=150 * 1024 * 1024))
    try:
        with anyio.fail_after(60):
            small = await sched.run(jobs.allocate_and_keep, 10)
            assert await sched.run(jobs.pid) == small  # still under the limit: same worker
            big = await sched.run(jobs.allocate_and_keep, 200)
            assert big == small  # the job that grew it completed, with its result
            after = await sched.run(jobs.pid)
        assert after != big
        assert not alive({big})
        stats = sched.statistics()
        assert (stats.workers_recycled, stats.worker_crashes, stats.failed) == (1, 0, 0)
    finally:
        await close_and_check(sched)


async def test_idle_workers_are_stopped_and_started_again_on_demand():
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(workers=2, idle_timeout=0.3))
    try:
        with anyio.fail_after(60):
            first = await sched.run(jobs.pid)
            assert await anyio.to_thread.run_sync(lambda: wait_until(lambda: not sched.worker_pids(), 10))
            # Out of the pool's list first, then killed and reaped: give it that moment.
            assert await anyio.to_thread.run_sync(lambda: wait_until(lambda: not alive({first}), 10))
            second = await sched.run(jobs.pid)
        assert second != first
        stats = sched.statistics()
        assert stats.workers_idle_stopped >= 1 and stats.workers_started == 2 and stats.worker_crashes == 0
    finally:
        await close_and_check(sched)


# -- bad results ----------------------------------------------------------------------------


async def test_bad_results_are_clear_errors_and_never_break_the_pool():
    sched = aiocompile.Scheduler(config=NO_PRELOAD.with_changes(workers=1))
    try:
        with anyio.fail_after(120):
            with pytest.raises(aiocompile.JobError, match="Unpicklable.*could not be pickled"):
                await sched.run(jobs.raise_unpicklable)
            with pytest.raises(TypeError, match="could not be pickled"):
                await sched.run(jobs.return_unpicklable)
            assert len(await sched.run(jobs.big_result, 100)) == 100 * 1024 * 1024
            assert await sched.run(jobs.echo, "still serving") == "still serving"
        stats = sched.statistics()
        assert (stats.workers_started, stats.worker_crashes, stats.compiled, stats.failed) == (1, 0, 2, 2)
    finally:
        await close_and_check(sched)


def tree_pids(path):
    """The pids ``jobs.start_tree_then_hang`` wrote to ``path``, once the line is whole."""
    text = path.read_text() if path.exists() else ""
    return [int(pid) for pid in text.split()] if text.endswith("\n") else []


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
@pytest.mark.parametrize("how", ["timeout", "cancel_running=kill"])
async def test_a_killed_job_takes_the_processes_it_started_with_it(how, start_method, tmp_path):
    """A worker killed for its job (its timeout, or its last caller gone with
    cancel_running="kill") leads a process group, and the whole group goes: no compiler
    it started outlives the job."""
    pids_file = tmp_path / "pids"
    config = NO_PRELOAD.with_changes(workers=1, cancel_running="kill", start_method=start_method)
    sched = aiocompile.Scheduler(config=config)
    try:
        with anyio.fail_after(60):
            if how == "timeout":
                with pytest.raises(aiocompile.JobTimeout):
                    await sched.run(jobs.start_tree_then_hang, str(pids_file), timeout=1)
            else:
                async with anyio.create_task_group() as group:
                    group.start_soon(lambda: sched.run(jobs.start_tree_then_hang, str(pids_file)))
                    # Once the tree runs, its only caller goes.
                    while len(tree_pids(pids_file)) < 2:
                        await anyio.sleep(0.01)
                    group.cancel_scope.cancel()
            tree = tree_pids(pids_file)
            assert len(tree) == 2
            assert wait_until(lambda: not alive(tree), 10), f"outlived the job: {alive(tree)}"
            assert await sched.run(jobs.echo, "after") == "after"
    finally:
        await close_and_check(sched)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
async def test_a_worker_that_dies_takes_the_processes_it_started_with_it(start_method, tmp_path):
    """A worker killed from outside in the middle of its job (an OOM kill, say) leaves no
    compiler of its own running: its process group goes with it, before the job could run
    again and write the same files."""
    pids_file = tmp_path / "pids"
    config = NO_PRELOAD.with_changes(workers=1, max_crashes=1, start_method=start_method)
    sched = aiocompile.Scheduler(config=config)
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:

                async def kill_the_worker_once_its_tree_runs():
                    while not pids_file.exists() or len(pids_file.read_text().split()) < 2:
                        await anyio.sleep(0.01)
                    (worker,) = sched.worker_pids()
                    os.kill(worker, signal.SIGKILL)  # the worker alone, not its group

                group.start_soon(kill_the_worker_once_its_tree_runs)
                with pytest.raises(aiocompile.WorkerCrashed):
                    await sched.run(jobs.start_tree_then_hang, str(pids_file))
            tree = [int(pid) for pid in pids_file.read_text().split()]
            assert wait_until(lambda: not alive(tree), 10), f"outlived their worker: {alive(tree)}"
            assert await sched.run(jobs.echo, "after") == "after"
    finally:
        await close_and_check(sched)
