"""Admission in bounded slices of the event loop's time (``aiocompile._core.admission``), and
bursts of requests that must neither hold the loop nor lose a wake-up of the pool."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest
from jobs import echo

import aiocompile
from aiocompile._core import admission
from aiocompile._core.admission import Gate


class Soon:
    """A stand-in for a loop's call_soon: callbacks wait until the test runs them."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def __call__(self, callback) -> None:
        self.callbacks.append(callback)

    def run(self) -> None:
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


class Waiter:
    def __init__(self) -> None:
        self.woken = False
        self.cancelled = False

    def wake(self) -> None:
        self.woken = True


def test_a_lone_request_and_a_trickle_never_wait():
    soon = Soon()
    gate = Gate(soon, budget=10.0)
    for _ in range(3):
        assert gate.open()
        soon.run()  # the loop's next iteration
    assert gate.held == 0


def test_a_request_admitted_alone_asks_the_loop_nothing_and_closes_its_slice_once_it_waited():
    soon = Soon()
    gate = Gate(soon, budget=10.0)
    for _ in range(3):
        assert gate.open()
        assert not soon.callbacks  # alone so far: no turn of the loop needed to end its slice
        gate.close_lone()  # its task waited for its job meanwhile: the loop has gone round
    assert gate.held == 0


def test_a_second_admission_in_a_slice_asks_the_loop_when_its_iteration_ends():
    soon = Soon()
    gate = Gate(soon, budget=10.0)
    assert gate.open() and gate.open()
    assert len(soon.callbacks) == 1
    gate.close_lone()  # not alone: the slice lasts until the loop's next iteration says so
    assert gate.open() and len(soon.callbacks) == 1
    soon.run()
    assert gate.open() and not soon.callbacks


def test_past_the_budget_requests_wait_their_turn_first_come_first_served():
    soon = Soon()
    gate = Gate(soon, budget=0.0)
    assert gate.open()  # the first of an iteration always passes
    waiters = [Waiter() for _ in range(5)]
    for waiter in waiters:
        assert not gate.open()
        gate.wait(waiter)
    assert gate.held == 5 and not any(w.woken for w in waiters)
    # One admission fitted the slice: each later iteration lets one more through, in order.
    for turn in range(5):
        soon.run()
        assert [w.woken for w in waiters] == [i <= turn for i in range(5)]
    soon.run()
    assert not soon.callbacks  # nobody waits: the gate is at rest


def test_nobody_overtakes_a_waiting_request():
    soon = Soon()
    gate = Gate(soon, budget=0.0)
    assert gate.open()
    first = Waiter()
    assert not gate.open()
    gate.wait(first)
    soon.run()
    assert first.woken
    # Arriving while the woken one has not run yet: the slice is the woken one's.
    assert not gate.open()


def test_a_cancelled_waiter_is_skipped_and_costs_no_turn():
    soon = Soon()
    gate = Gate(soon, budget=0.0)
    gate.open()
    gone, kept = Waiter(), Waiter()
    for waiter in (gone, kept):
        gate.open()
        gate.wait(waiter)
    gone.cancelled = True
    soon.run()
    assert kept.woken and not gone.woken


async def test_a_burst_is_admitted_a_slice_at_a_time_while_the_loop_keeps_serving(monkeypatch):
    # No time at all per slice: one admission per turn of the loop, whatever the machine.
    monkeypatch.setattr(admission, "BUDGET", 0.0)
    async with aiocompile.Scheduler(workers=2, config=aiocompile.SchedulerConfig(preload=())) as sched:
        await sched.run(echo, -1)
        seen: list[int] = []  # requests admitted so far, at each turn of a ticker

        async def ticker():
            # Until all are admitted only: a loop kept busy all along would make every other
            # thread wait a switch interval for the interpreter lock at each system call.
            while not seen or seen[-1] < 301:
                seen.append(sched.statistics().submitted)
                await anyio.sleep(0)

        async def one(i: int, results: dict) -> None:
            results[i] = await sched.run(echo, i)

        results: dict[int, int] = {}
        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                group.start_soon(ticker)
                await anyio.sleep(0)
                async with anyio.create_task_group() as burst:
                    for i in range(300):
                        burst.start_soon(one, i, results)
        assert results == {i: i for i in range(300)}
        # All 300 arrived at once; between two turns of the ticker, at most a couple were
        # admitted (without the gate, all 300 in one turn).
        steps = [b - a for a, b in zip(seen, seen[1:])]
        assert seen[-1] == 301 and max(steps) <= 3, max(steps)
        stats = sched.statistics()
        assert (stats.submitted, stats.compiled, stats.in_flight) == (301, 301, 0)


async def test_one_request_after_another_costs_the_loop_no_turn_of_its_own(monkeypatch, async_runner):
    if async_runner != "asyncio":
        pytest.skip("under trio each slice still ends with a callback in the next iteration")
    turns: list[int] = []
    original = Gate._next_slice
    monkeypatch.setattr(Gate, "_next_slice", lambda self: (turns.append(1), original(self))[1])
    async with aiocompile.Scheduler(workers=1, config=aiocompile.SchedulerConfig(preload=())) as sched:
        with anyio.fail_after(60):
            for i in range(20):
                assert await sched.run(echo, i) == i
    assert turns == []


async def test_a_request_cancelled_while_it_waits_its_turn_is_never_counted(monkeypatch):
    monkeypatch.setattr(admission, "BUDGET", 0.0)
    async with aiocompile.Scheduler(workers=1, config=aiocompile.SchedulerConfig(preload=())) as sched:
        await sched.run(echo, -1)
        with anyio.fail_after(60):
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:
                    for i in range(50):
                        group.start_soon(sched.run, echo, i)
                    await anyio.sleep(0)  # a few are admitted; most wait their turn
                    scope.cancel()
            stats = sched.statistics()
            # Only those that had passed the gate were counted, each in one outcome.
            assert stats.submitted < 51 and stats.in_flight == 0
            assert stats.submitted == sum(stats.outcomes.values())
            assert await sched.run(echo, "after") == "after"
        assert sched.statistics().in_flight == 0


@pytest.mark.parametrize("rounds", [3])
def test_bursts_from_several_loops_in_threads_then_close_never_hang(rounds):
    """Thousands of submissions from loops in four threads at once, each loop with its own
    gate, then close(): every request answered once, and the pool closes."""
    config = aiocompile.SchedulerConfig(workers=2, preload=())
    for _ in range(rounds):
        sched = aiocompile.Scheduler(config=config)
        errors: list[BaseException] = []

        def burst(offset: int, sched: aiocompile.Scheduler = sched, errors: list = errors) -> None:
            async def main() -> None:
                results = await asyncio.gather(*(sched.run(echo, offset + i) for i in range(500)))
                assert results == [offset + i for i in range(500)]

            try:
                asyncio.run(main())
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=burst, args=(n * 1000,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
            assert not thread.is_alive(), "a burst did not finish"
        assert not errors, errors
        closer = threading.Thread(target=sched.close, daemon=True)
        closer.start()
        closer.join(60)
        assert not closer.is_alive(), "close() hung"
        assert sched.statistics().compiled == 2000
