"""A worker's life (``aiocompile._pool.handle``): every transition, one by one, and in the pool a
kill that can only reach the job it was meant for."""

from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import threading
from multiprocessing.connection import Connection

import pytest
from jobs import echo, pid, sleep_then

from aiocompile._pool.handle import TRANSITIONS, Death, InvalidTransition, Retire, State, Worker
from aiocompile._pool.job import Job, Stop
from aiocompile._pool.launch import WorkerProcess
from aiocompile._pool.protocol import Inbox
from aiocompile.lowlevel import WorkerPool


def new_worker(state: State = State.STARTING) -> Worker:
    worker = Worker(WorkerProcess(pid=0, conn=None, alive_w=-1, output_fd=-1))  # type: ignore[arg-type]
    worker.state = state
    return worker


def new_job(job_id: int = 1) -> Job:
    return Job.create(job_id, echo, (job_id,), None, timeout=None, max_crashes=2, name="echo", key=None)


def test_a_worker_starts_then_becomes_idle():
    worker = new_worker()
    worker.ready()
    assert worker.state is State.IDLE and worker.idle


def test_claiming_an_idle_worker_makes_it_busy_with_that_job():
    worker, job = new_worker(State.IDLE), new_job()
    worker.claim(job)
    assert (worker.state, worker.job) == (State.BUSY, job)


def test_a_claim_for_a_job_cancelled_before_it_was_sent_is_released():
    worker = new_worker(State.IDLE)
    worker.claim(new_job())
    worker.deadline = 1.0
    worker.release()
    assert (worker.state, worker.job, worker.deadline) == (State.IDLE, None, None)


def test_an_answer_makes_a_busy_worker_idle_again():
    worker = new_worker(State.IDLE)
    worker.claim(new_job())
    worker.deadline, worker.reader, worker.streaming = 5.0, object(), True
    worker.answered(outgrown=False)
    assert (worker.state, worker.job, worker.deadline, worker.reader, worker.streaming) == (
        State.IDLE, None, None, None, False)


def test_an_answer_from_a_worker_grown_too_big_retires_it():
    worker = new_worker(State.IDLE)
    worker.claim(new_job())
    worker.answered(outgrown=True)
    assert (worker.state, worker.retire_reason, worker.job) == (State.RETIRING, Retire.RECYCLED, None)


def test_a_kill_is_addressed_to_the_job_the_worker_holds():
    worker, job = new_worker(State.IDLE), new_job(1)
    worker.claim(job)
    assert not worker.kill(new_job(2), Stop.TIMEOUT)  # another job: nothing to send
    assert worker.state is State.BUSY
    assert worker.kill(job, Stop.TIMEOUT)
    assert (worker.state, worker.stop, worker.job) == (State.KILLING, Stop.TIMEOUT, job)
    assert not worker.kill(job, Stop.CANCELLED)  # on its way already: sent once
    assert worker.stop is Stop.TIMEOUT


def test_a_worker_being_killed_never_becomes_idle_even_when_its_job_answers_first():
    worker, job = new_worker(State.IDLE), new_job()
    worker.claim(job)
    worker.kill(job, Stop.TIMEOUT)
    for outgrown in (False, True):
        worker.answered(outgrown=outgrown)
        assert (worker.state, worker.job, worker.stop) == (State.KILLING, None, Stop.TIMEOUT)
    assert not worker.idle
    with pytest.raises(InvalidTransition):
        worker.claim(new_job(2))


def test_an_idle_worker_is_never_killed_for_a_job():
    worker = new_worker(State.IDLE)
    assert not worker.kill(new_job(), Stop.TIMEOUT)
    assert worker.state is State.IDLE


def test_retiring_takes_an_idle_worker_only():
    worker = new_worker(State.IDLE)
    worker.retire(Retire.IDLE)
    assert (worker.state, worker.retire_reason) == (State.RETIRING, Retire.IDLE)
    busy = new_worker(State.IDLE)
    busy.claim(new_job())
    with pytest.raises(InvalidTransition):
        busy.retire(Retire.IDLE)


@pytest.mark.parametrize("state", [s for s in State if s is not State.GONE])
def test_a_worker_ends_from_any_state_saying_what_it_held(state):
    worker, job = new_worker(state), new_job()
    if state in (State.BUSY, State.KILLING):
        worker.job, worker.stop = job, (Stop.TIMEOUT if state is State.KILLING else None)
    death = worker.ended()
    assert worker.state is State.GONE and worker.job is None
    assert death.state is state
    assert death.job is (job if state in (State.BUSY, State.KILLING) else None)
    assert death.stop is (Stop.TIMEOUT if state is State.KILLING else None)


def test_every_other_transition_is_refused():
    events = {event for _, event in TRANSITIONS}
    for state in State:
        for event in events:
            if (state, event) in TRANSITIONS:
                continue
            worker = new_worker(state)
            with pytest.raises(InvalidTransition):
                worker._move(event)
            assert worker.state is state


def test_an_undelivered_job_is_a_kill_of_its_own_kind():
    worker, job = new_worker(State.IDLE), new_job()
    worker.claim(job)
    assert worker.kill(job, Stop.UNDELIVERED)
    assert worker.ended() == Death(State.KILLING, job, Stop.UNDELIVERED)


# -- in the pool ---------------------------------------------------------------------------


def test_a_kill_that_lands_after_its_job_answered_costs_the_next_job_nothing():
    """The kill for a timed-out job is held back until the job's answer has been read, as
    when the signal loses the race to the answer. The worker must not take the next job
    meanwhile: that job would be killed and charged a crash (with max_crashes=1, failed)."""
    with WorkerPool(1, preload=(), max_crashes=1) as pool:
        victim = pool.submit(pid).result(timeout=60)
        launcher = pool._supervisor._launcher
        real_kill = launcher.kill
        killed = threading.Event()
        answered = threading.Event()

        def late_kill(worker_process):
            def deliver():
                answered.wait(30)
                real_kill(worker_process)
                killed.set()

            threading.Thread(target=deliver, daemon=True).start()

        launcher.kill = late_kill
        slow = pool.submit_job(sleep_then, (1.0, "late but whole"), timeout=0.3, name="slow")
        # Its deadline passes, the kill is decided and held back; then the job answers.
        assert slow.future.result(timeout=60) == "late but whole"
        answered.set()
        nxt = pool.submit_job(pid, (), name="next")
        assert nxt.future.result(timeout=60) != victim  # a fresh worker: the old one was being killed
        assert killed.wait(30)
        launcher.kill = real_kill
        assert pool.submit(echo, "after").result(timeout=60) == "after"
        counters = pool.counters
        assert (counters.worker_crashes, counters.retries, counters.timeouts) == (0, 0, 0)


def test_jobs_ending_right_at_their_timeouts_never_charge_an_innocent():
    """Many jobs finishing about when their timeout fires: each either times out or
    succeeds, and with max_crashes=1 none fails as a crash."""
    with WorkerPool(4, preload=(), max_crashes=1) as pool:
        for _ in range(4):
            pool.submit(echo, 0).result(timeout=60)
        jobs = [pool.submit_job(sleep_then, (0.05, i), timeout=0.05 + (i % 9 - 4) * 0.001, name="edge")
                for i in range(300)]
        outcomes = {"ok": 0, "timeout": 0}
        for job in jobs:
            try:
                job.future.result(timeout=120)
                outcomes["ok"] += 1
            except cf.TimeoutError:  # JobTimeout is one
                outcomes["timeout"] += 1
        assert sum(outcomes.values()) == 300
        assert pool.counters.worker_crashes == 0


def test_a_wake_up_written_while_the_supervisor_drains_its_pipe_is_never_lost(monkeypatch):
    """A submitter writes its wake-up at the very moment the supervisor reads the pipe
    empty. The supervisor must still hear every later wake-up: here, shutdown's."""
    import os

    from aiocompile._pool import supervisor as _supervisor

    with WorkerPool(1, preload=()) as pool:
        assert pool.submit(echo, 0).result(timeout=60) == 0
        real_read = os.read
        raced = threading.Event()

        def read(fd, size):
            if fd == pool._supervisor._wake_r and not raced.is_set():
                raced.set()
                pool._supervisor.wake()  # another thread's wake-up, landing just as the pipe is read
            return real_read(fd, size)

        monkeypatch.setattr(_supervisor.os, "read", read)
        pool._supervisor.wake()
        assert raced.wait(30)
        monkeypatch.setattr(_supervisor.os, "read", real_read)
        closer = threading.Thread(target=pool.shutdown, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "shutdown's wake-up was lost: the supervisor never heard it"


# -- the worker's end of the job socket -----------------------------------------------------------


def test_the_worker_reads_messages_whole_however_they_arrive_and_stops_at_the_parents_end():
    parent, child = socket.socketpair()
    sender = Connection(os.dup(parent.fileno()))
    inbox = Inbox(child.fileno())
    # Two messages in one go: the second is kept for the next receive, not lost.
    sender.send_bytes(b"first")
    sender.send_bytes(b"second")
    assert bytes(inbox.receive()) == b"first"
    assert bytes(inbox.receive()) == b"second"
    # A message larger than one read, its length first and its body in pieces meanwhile.
    big = bytes(range(256)) * 40000
    writer = threading.Thread(target=sender.send_bytes, args=(big,))
    writer.start()
    assert bytes(inbox.receive()) == big
    writer.join()
    sender.close()
    parent.close()
    with pytest.raises(EOFError):
        inbox.receive()
    child.close()


def test_a_worker_measures_its_memory_after_a_millisecond_of_jobs_not_after_each_trivial_one():
    from aiocompile._pool.child import JobState

    state = JobState()
    measured: list[int] = []
    state.rss = lambda: (measured.append(1), 1000 * len(measured))[1]  # type: ignore[method-assign]
    assert state.rss_after(0.00001) == 1000  # the first job's is measured
    assert [state.rss_after(0.00001) for _ in range(50)] == [1000] * 50  # 0.5 ms more: not yet
    assert state.rss_after(0.0006) == 2000  # past a millisecond of jobs: measured again
    assert state.rss_after(0.5) == 3000  # a long job is always measured
    assert len(measured) == 3
