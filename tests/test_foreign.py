"""A foreign executor behind the scheduler: a stdlib ProcessPoolExecutor survives its own
breakage, the poison job is found, and no innocent job fails."""

import concurrent.futures as cf
import multiprocessing
import sys
import time

import anyio
import jobs
import pytest
from conftest import alive, child_pids, wait_until
from test_faults import gather
from triton_kernels import ADD_SIGNATURE, add_kernel

import aiocompile
from aiocompile._foreign.pool import ForeignPool
from aiocompile.errors import RemoteTraceback


def stdlib_pool(workers=2):
    return cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"))


@pytest.mark.parametrize("given", ["factory", "instance"])
async def test_a_poison_job_is_isolated_and_no_innocent_fails(given):
    executor = (lambda: stdlib_pool()) if given == "factory" else stdlib_pool()
    sched = aiocompile.Scheduler(executor=executor, max_crashes=2)
    try:
        innocents = [lambda i=i: sched.run(jobs.sleep_then, 0.3, i) for i in range(6)]
        results = await gather(lambda: sched.run(jobs.exit_now, 3), *innocents)
        assert isinstance(results[0], aiocompile.WorkerCrashed), results[0]
        assert results[0].attempts >= 2 and results[0].kernel_name == "exit_now"
        assert results[1:] == list(range(6))
        stats = sched.statistics()
        # One break with everyone in it, then two with the poison alone.
        assert (stats.worker_crashes, stats.compiled, stats.failed, stats.in_flight) == (3, 6, 1, 0)
        assert stats.retries >= 2
        # The rebuilt executor keeps serving.
        assert await sched.run(jobs.echo, "after") == "after"
    finally:
        await sched.aclose()


async def test_a_segfault_among_real_compiles_in_a_stdlib_pool():
    sched = aiocompile.Scheduler(executor=lambda: stdlib_pool(2), max_crashes=1)
    try:
        compiles = [
            lambda b=b: sched.compile_triton(add_kernel, signature=ADD_SIGNATURE, constexprs={"BLOCK": b},
                                             target="cuda:90")
            for b in (64, 128, 256, 512)
        ]
        results = await gather(*compiles[:2], lambda: sched.run(jobs.segfault), *compiles[2:])
        assert isinstance(results[2], aiocompile.WorkerCrashed)
        kernels = results[:2] + results[3:]
        assert all(isinstance(k, aiocompile.TritonKernel) and k.binary for k in kernels), kernels
        assert [k.constexprs["BLOCK"] for k in kernels] == [64, 128, 256, 512]
    finally:
        await sched.aclose()


async def test_a_timeout_fails_the_await_although_the_job_runs_on():
    sched = aiocompile.Scheduler(executor=lambda: stdlib_pool(2))
    try:
        started = time.monotonic()
        with pytest.raises(aiocompile.JobTimeout):
            with anyio.fail_after(60):
                await sched.run(jobs.sleep_then, 2.0, timeout=0.3)
        assert time.monotonic() - started < 1.5
        assert await sched.run(jobs.echo, 1) == 1
        assert sched.statistics().timeouts == 1
    finally:
        await sched.aclose()


async def test_aclose_kills_a_stdlib_pool_that_outlives_the_grace_period():
    sched = aiocompile.Scheduler(executor=lambda: stdlib_pool(1))
    outcome = {}

    async def stuck():
        try:
            await sched.run(jobs.hang)
        except aiocompile.SchedulerClosed as exc:
            outcome["error"] = exc

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(stuck)
            while not sched.worker_pids():  # the pool is up, its worker on the job
                await anyio.sleep(0.01)
            pids = sched.worker_pids()
            assert pids
            await sched.aclose(grace=0.2)
    assert isinstance(outcome["error"], aiocompile.SchedulerClosed)
    from conftest import alive, wait_until

    assert wait_until(lambda: not alive(set(pids)))


async def test_a_thread_pool_works_too():
    with cf.ThreadPoolExecutor(2) as executor:
        async with aiocompile.Scheduler(executor=executor) as sched:
            assert await sched.run(jobs.echo, "threads") == "threads"
            with pytest.raises(ValueError):
                await sched.run(int, "not a number")


class _AlwaysBroken(cf.Executor):
    def submit(self, fn, /, *args, **kwargs):
        future = cf.Future()
        future.set_exception(cf.BrokenExecutor("broken on purpose"))
        return future


async def test_an_executor_that_breaks_and_cannot_be_rebuilt_fails_clearly():
    sched = aiocompile.Scheduler(executor=_AlwaysBroken())
    with anyio.fail_after(30):
        with pytest.raises(aiocompile.SchedulerClosed, match="pass a factory"):
            await sched.run(jobs.echo, 1)
    await sched.aclose()


def test_bad_executor_argument():
    with pytest.raises(TypeError):
        ForeignPool(42)


async def test_aclose_leaves_no_process_of_a_stdlib_pool_behind():
    before = child_pids()
    async with aiocompile.Scheduler(executor=cf.ProcessPoolExecutor(2)) as sched:
        assert await sched.run(jobs.echo, 1) == 1
        workers = set(sched.worker_pids())
        assert workers and workers <= child_pids()
    # aclose() returned once each process's sentinel said it had ended; the kernel marks
    # a process ended (a zombie) a moment after it closes its descriptors.
    assert await anyio.to_thread.run_sync(lambda: wait_until(lambda: not alive(workers), 5))
    # (Processes of earlier tests may end meanwhile: only new ones count.)
    assert not child_pids() - before


async def test_jobs_still_queued_in_a_stdlib_pool_fail_at_close_rather_than_hang():
    sched = aiocompile.Scheduler(executor=cf.ProcessPoolExecutor(1))
    errors = []

    async def call(seconds):
        try:
            await sched.run(jobs.sleep_then, seconds)
        except aiocompile.SchedulerClosed as exc:
            errors.append(exc)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            for _ in range(4):  # one runs, one waits in the pool's call queue, the others are queued
                group.start_soon(call, 30.0)
            await anyio.sleep(1.0)
            await sched.aclose(grace=0.2)
    assert len(errors) == 4


# -- timeouts: a job's clock starts when a worker is free for it --------------------------


class _Delegating(cf.Executor):
    """An executor of a kind the pool does not know: how many jobs it runs at once, and in
    which order, are its own business."""

    def __init__(self, inner):
        self._inner = inner

    def submit(self, fn, /, *args, **kwargs):
        return self._inner.submit(fn, *args, **kwargs)

    def shutdown(self, wait=True, *, cancel_futures=False):
        self._inner.shutdown(wait, cancel_futures=cancel_futures)


async def until_submitted(sched, count):
    """Until ``count`` requests have been handed to the pool (each is sent as it is counted)."""
    while sched.statistics().submitted < count:
        await anyio.sleep(0.005)


EXECUTORS = {
    "process pool": lambda: stdlib_pool(1),
    "factory of process pools": lambda: (lambda: stdlib_pool(1)),
    "thread pool": lambda: cf.ThreadPoolExecutor(1),
}


@pytest.mark.parametrize("kind", list(EXECUTORS))
async def test_a_short_job_queued_behind_a_long_one_does_not_time_out_for_its_wait(kind):
    sched = aiocompile.Scheduler(executor=EXECUTORS[kind]())
    results = {}

    async def call(label, seconds, timeout=None):
        results[label] = await sched.run(jobs.sleep_then, seconds, label, timeout=timeout)

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(call, "long", 2.0)
                await until_submitted(sched, 1)
                group.start_soon(call, "short", 0.1, 1)
        assert results == {"long": "long", "short": "short"}
        assert sched.statistics().timeouts == 0
        # The worker's own start corrects the records: the short job waited about 2 s.
        short = next(r for r in sched.records() if r.run_time is not None and r.run_time < 1)
        assert short.queue_wait > 1.5, short
    finally:
        await sched.aclose()


async def test_a_job_past_its_timeout_fails_that_long_after_it_starts_and_keeps_its_worker():
    sched = aiocompile.Scheduler(executor=stdlib_pool(1))
    ended = {}

    async def first():
        assert await sched.run(jobs.sleep_then, 1.0, "first") == "first"
        ended["first"] = time.monotonic()

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(first)
                await until_submitted(sched, 1)
                sent = time.monotonic()
                with pytest.raises(aiocompile.JobTimeout):
                    await sched.run(jobs.sleep_then, 2.0, timeout=0.5)
                failed = time.monotonic()
            # It failed about 0.5 s into its own run, after waiting 1 s for the worker.
            assert failed - sent > 1.0
            assert 0.3 < failed - ended["first"] < 1.2
            # The executor cannot stop it: the next job waits for the worker it holds.
            assert await sched.run(jobs.echo, "next") == "next"
            assert time.monotonic() - ended["first"] > 1.7
        stats = sched.statistics()
        assert (stats.timeouts, stats.worker_crashes) == (1, 0)
    finally:
        await sched.aclose()


async def test_jobs_with_timeouts_queued_behind_long_ones_all_succeed():
    sched = aiocompile.Scheduler(executor=stdlib_pool(2))
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for _ in range(2):  # one on each worker
                    group.start_soon(sched.run, jobs.sleep_then, 1.5)
                await until_submitted(sched, 2)
                # Each waits 1.5 s or more, longer than its timeout, then runs 0.3 s.
                queued = [lambda i=i: sched.run(jobs.sleep_then, 0.3, i, timeout=1.0) for i in range(6)]
                results = await gather(*queued, lambda: sched.run(jobs.sleep_then, 0.3, "no timeout"))
        assert results == [0, 1, 2, 3, 4, 5, "no timeout"]
        stats = sched.statistics()
        assert (stats.timeouts, stats.failed, stats.compiled) == (0, 0, 9)
    finally:
        await sched.aclose()


async def test_with_an_executor_of_unknown_order_the_clock_starts_at_the_hand_over():
    sched = aiocompile.Scheduler(executor=_Delegating(cf.ThreadPoolExecutor(1)))
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(sched.run, jobs.sleep_then, 1.0)
                await until_submitted(sched, 1)
                with pytest.raises(aiocompile.JobTimeout):
                    await sched.run(jobs.sleep_then, 0.05, timeout=0.3)
    finally:
        await sched.aclose()


# -- exceptions that this process cannot rebuild ------------------------------------------


@pytest.mark.parametrize("failure", ["class only the worker imports", "exception that does not pickle"])
async def test_an_exception_that_cannot_be_rebuilt_here_fails_its_job_alone(failure, tmp_path):
    (tmp_path / f"{jobs.WORKER_ONLY_MODULE}.py").write_text(jobs.WORKER_ONLY_SOURCE)
    executor = stdlib_pool(2)
    sched = aiocompile.Scheduler(executor=executor)
    if failure == "exception that does not pickle":
        poison, expected = (lambda: sched.run(jobs.raise_unpicklable)), "Unpicklable: this exception holds a lock"
    else:
        message = "raised by a class that only the worker can import"
        poison = lambda: sched.run(jobs.raise_worker_only, str(tmp_path), message)  # noqa: E731
        expected = f"OnlyHere: {message}"
    try:
        innocents = [lambda i=i: sched.run(jobs.sleep_then, 0.3, i) for i in range(4)]
        results = await gather(*innocents[:2], poison, *innocents[2:])
        error = results.pop(2)
        assert type(error) is aiocompile.JobError, error
        assert expected in str(error)
        assert isinstance(error.__cause__, RemoteTraceback) and expected in error.__cause__.tb
        assert results == [0, 1, 2, 3]
        stats = sched.statistics()
        assert (stats.worker_crashes, stats.retries, stats.compiled, stats.failed) == (0, 0, 4, 1)
        assert sched.port._pool._executor is executor  # never broken, never rebuilt
    finally:
        await sched.aclose()


@pytest.mark.parametrize("kind", ["process pool", "thread pool"])
async def test_an_ordinary_exception_arrives_as_itself_with_the_workers_traceback(kind):
    executor = stdlib_pool(1) if kind == "process pool" else cf.ThreadPoolExecutor(1)
    async with aiocompile.Scheduler(executor=executor) as sched:
        with anyio.fail_after(60):
            with pytest.raises(ValueError, match="invalid literal") as info:
                await sched.run(int, "not a number")
            assert isinstance(info.value.__cause__, RemoteTraceback)
            assert "invalid literal" in info.value.__cause__.tb
            # A job that exits fails as it does in aiocompile's own pool.
            with pytest.raises(RuntimeError, match="SystemExit"):
                await sched.run(sys.exit, 3)
            pid = await sched.run(jobs.pid)
        record = next(r for r in sched.records() if r.outcome == "error")
        assert record.worker_pid == pid and record.run_time is not None
        assert sched.statistics().worker_crashes == 0


async def test_behind_workers_held_by_jobs_past_their_timeouts_a_job_times_out_rather_than_wait_forever():
    sched = aiocompile.Scheduler(executor=stdlib_pool(1))
    try:
        with anyio.fail_after(30):
            with pytest.raises(aiocompile.JobTimeout):
                await sched.run(jobs.hang, timeout=0.3)
            # The only worker is held for good: the next job's clock starts at once.
            started = time.monotonic()
            with pytest.raises(aiocompile.JobTimeout):
                await sched.run(jobs.echo, 1, timeout=0.5)
            assert time.monotonic() - started < 2.0
            assert sched.statistics().timeouts == 2
    finally:
        await sched.aclose(grace=0.2)


async def test_cancelling_a_request_queued_in_the_executor_drops_its_job(tmp_path):
    """The job is still PENDING in the stdlib pool (behind three others on one worker) when
    its only caller gives up: it is withdrawn and never runs, and the caller sees its own
    cancellation, nothing else."""
    marker = tmp_path / "ran"
    sched = aiocompile.Scheduler(executor=stdlib_pool(1))
    try:
        with anyio.fail_after(60):
            await sched.run(jobs.echo, 0)  # the worker is up
            async with anyio.create_task_group() as group:
                for _ in range(3):  # one running, two filling the stdlib pool's call queue
                    group.start_soon(sched.run, jobs.sleep_then, 1.0)
                await anyio.sleep(0.1)
                with anyio.move_on_after(0.2):
                    await sched.run(jobs.mark_then_sleep, str(marker), 0)
            assert await sched.run(jobs.echo, "after") == "after"
        assert not marker.exists()
        stats = sched.statistics()
        assert stats.outcomes["cancelled"] == 1 and stats.in_flight == 0
    finally:
        await sched.aclose()


# -- a job's life in a foreign executor ----------------------------------------------------


def test_a_job_in_a_foreign_executor_moves_only_as_its_table_allows():
    from aiocompile._foreign.sent import TRANSITIONS, Move, State

    assert TRANSITIONS.reachable(State.WAITING) == set(State)
    # Every state but GONE can end or be withdrawn; GONE is final.
    assert all({Move.WITHDRAW, Move.ENDED} <= TRANSITIONS.events(state) for state in State if state is not State.GONE)
    assert not TRANSITIONS.events(State.GONE)
    # A job is failed and stopped once: a kill only before a timeout or a kill, a timeout
    # only once its clock runs (and in the moment a kill is failing it).
    assert {state for state, move in TRANSITIONS if move is Move.KILL} == {State.WAITING, State.RUNNING}
    assert {state for state, move in TRANSITIONS if move is Move.TIME_OUT} == {State.RUNNING, State.KILLED}


class _StoppablePool(cf.ProcessPoolExecutor):
    """A stdlib pool (its jobs run in the order sent) that says it can stop a job: it only
    notes the request, and the job runs on."""

    def __init__(self):
        super().__init__(1, mp_context=multiprocessing.get_context("forkserver"))
        self.stopped = []

    def kill(self, future):
        self.stopped.append(future)


def test_a_job_killed_while_it_waits_for_a_worker_still_takes_its_turn():
    executor = _StoppablePool()
    pool = ForeignPool(executor)
    try:
        first = pool.submit_job(jobs.sleep_then, (1.0, "first"))
        second = pool.submit_job(jobs.echo, ("second",), timeout=30)
        # Both are RUNNING in the executor (the second in its call queue, beyond cancel()'s
        # reach), but only the first has the worker.
        assert wait_until(lambda: pool.snapshot()["busy_workers"] == 2, timeout=60)
        pool.kill(second)
        with pytest.raises(cf.CancelledError):
            second.future.result(timeout=5)
        assert first.future.result(timeout=60) == "first"
        assert pool.submit_job(jobs.echo, ("third",), timeout=30).future.result(timeout=60) == "third"
        assert len(executor.stopped) == 1 and pool.counters.killed == 1 and pool.counters.timeouts == 0
        assert wait_until(lambda: pool.snapshot()["queue_depth"] == 0 and pool.snapshot()["busy_workers"] == 0)
    finally:
        pool.shutdown()
