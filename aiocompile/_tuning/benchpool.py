"""Benchmark processes, one per device, and the queue of configurations they time.

Each device has a *slot*: at most one benchmark process (``benchproc``) and a thread that
drives it. The thread takes the oldest configuration it may time (a configuration names
the devices it may run on: one for ``autotune(device=i)``, every device of the same model
otherwise), sends the tuning's tensors if the process does not have them yet, sends the
configuration, and waits for the answer until the configuration's deadline. So one
device times one configuration at a time (timings taken side by side on one GPU would
disturb each other), and a batch of tunings spreads over every device allowed.

What can go wrong, and what it costs:

- the configuration raises (out of resources, a bad launch): ``error``, its reason; the
  process goes on;
- it leaves the device unusable (an illegal address): ``fault``; the process exits and
  the next configuration gets a fresh one;
- it kills the process (a segfault): ``crashed``, with the exit status and the end of the
  process's output; replaced;
- it runs past its deadline (a hang): ``timeout``; the process is killed and replaced;
- the process dies while idle: noticed within a second, and replaced at once;
- the process dies or cannot be reached before the configuration was sent (while
  starting, or while taking the tensors): not the configuration's fault, so it is sent
  again to a fresh process, once; a process that cannot start fails the configuration
  with the reason (``start_failed``), and a device whose process failed to start twice in
  a row fails what it is given at once for a while, rather than paying a start each time.

Every configuration's future is answered with a :class:`Timed`, never an exception,
and never left waiting: closing the pool answers what is queued (``closed``) and kills the
processes, which ends what runs.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from aiocompile._tuning.benchproc import BenchProcess, Lost, State, describe_exit, launch
from aiocompile._tuning.inputs import Inputs, SharedInputs, share, unshare
from aiocompile._tuning.task import (
    Bench,
    BenchTask,
    CallTask,
    Drop,
    FromProcess,
    Init,
    InputsFailed,
    InputsLoaded,
    LoadInputs,
    Ready,
    Result,
    StartFailed,
    Status,
)
from aiocompile._tuning.timing import Timing
from aiocompile.records import BenchmarkOutcome

_log = logging.getLogger("aiocompile")

START_TIMEOUT = 180.0
"""Seconds a benchmark process may take to start (importing torch and Triton, creating its
device's context) on a machine busy compiling."""
_FAILED_STARTS = 2
_IDLE_CHECK_SECONDS = 1.0
"""How often a device's thread looks whether its idle process is still alive."""
_EARLY_POLL_SECONDS = 0.05
"""How often a starting process's thread looks for tensors to send it ahead."""
_FAST_FAIL_SECONDS = 30.0


@dataclass(frozen=True)
class Timed:
    """What became of one configuration in a benchmark process."""

    status: BenchmarkOutcome
    """Any but ``COMPILE_ERROR`` (a configuration that did not compile never comes here)."""
    timings: tuple[float, ...] | None
    """Triton's (median, 20th percentile, 80th percentile), in milliseconds, when ``ok``."""
    reason: str | None
    device: int
    device_name: str | None
    pid: int | None
    attempt: int
    started_at: float
    """Wall-clock (``time.time()``) when it was sent to the process (or given up)."""
    finished_at: float
    phases: dict[str, float] | None = None
    """Where the process's time went (``seconds`` in all, ``load_s``, ``bench_s``), when ``ok``."""

    @property
    def ok(self) -> bool:
        return self.status is BenchmarkOutcome.OK




class Session:
    """One tuning's tensors: sent to a process before its first configuration."""

    _ids = itertools.count(1)

    def __init__(self, inputs: Inputs) -> None:
        self.id = next(self._ids)
        self.inputs = inputs
        self._lock = threading.Lock()
        self._wire: Inputs | SharedInputs | None = None
        self._closed = False
        self.sent: dict[int, tuple[float, float]] = {}
        """Device -> (wall-clock start, seconds) of sending the tensors there (for profiles)."""

    def wire(self) -> Inputs | SharedInputs:
        """The tensors as they are sent: written to shared memory once, for every
        process (``share``)."""
        with self._lock:
            if self._wire is None:
                self._wire = self.inputs if self._closed else share(self.inputs)
            return self._wire

    def close(self) -> None:
        """The tuning is over: its shared memory goes (a process that has mapped it
        keeps what it mapped)."""
        with self._lock:
            self._closed = True
            wire = self._wire
        if isinstance(wire, SharedInputs):
            unshare(wire.path)


@dataclass(eq=False)
class _Task:
    id: int
    devices: frozenset[int]
    session: Session
    payload: BenchTask | CallTask
    future: cf.Future[Timed]
    attempts: int = 0


class _Slot:
    """One device: its process (if any) and the thread that drives it."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.process: BenchProcess | None = None
        self.thread: threading.Thread | None = None
        self.drops: collections.deque[int] = collections.deque()
        self.offers: collections.deque[Session] = collections.deque()
        self.failed_starts = 0
        self.failed_at = 0.0
        self.last_failure = ""


class BenchPool:
    """The benchmark processes of one scheduler, started on demand, one per device."""

    def __init__(self, timing: Timing, devices: list[int], *, timeout: float | None,
                 on_process: Callable[[str, int, int, str | None], None] | None = None,
                 start_timeout: float = START_TIMEOUT) -> None:
        self.timing = timing
        self.timeout = timeout
        self.start_timeout = start_timeout
        self._on_process = on_process
        self._lock = threading.Condition()
        self._slots = {device: _Slot(device) for device in devices}
        self._queue: list[_Task] = []
        self._ids = itertools.count(1)
        self._closed = False
        self.started = 0
        self.lost = 0
        self.starts: collections.deque[dict[str, Any]] = collections.deque(maxlen=32)
        """The latest processes' starts: device, pid, wall-clock launch and ready times,
        and the process's own account of its start (for profiles)."""

    @property
    def devices(self) -> list[int]:
        return list(self._slots)

    def submit(self, session: Session, payload: BenchTask | CallTask, devices: frozenset[int]) -> cf.Future[Timed]:
        """Queue one configuration for any of ``devices``; its future is always answered
        with a ``Timed`` (cancel it to withdraw it while it waits)."""
        future: cf.Future[Timed] = cf.Future()
        task = _Task(next(self._ids), devices, session, payload, future)
        with self._lock:
            if self._closed:
                future.set_running_or_notify_cancel()
                future.set_result(_given_up(task, min(devices), BenchmarkOutcome.CLOSED, "the scheduler was closed"))
                return future
            self._queue.append(task)
            for device in devices:
                self._ensure_thread(self._slots[device])
            self._lock.notify_all()
        return future

    def start(self, devices: frozenset[int]) -> None:
        """Have these devices' processes start now, without waiting (``warm()``)."""
        with self._lock:
            if self._closed:
                return
            for device in devices:
                self._ensure_thread(self._slots[device])

    def offer(self, session: Session, devices: frozenset[int]) -> None:
        """Send a tuning's tensors to these devices' processes as soon as they are idle,
        ahead of its first configuration (which is still compiling)."""
        with self._lock:
            if self._closed:
                return
            for device in devices:
                slot = self._slots[device]
                slot.offers.append(session)
                self._ensure_thread(slot)
            self._lock.notify_all()

    def drop(self, session: Session) -> None:
        """The tuning is over: its tensors may go (told to each process before its next
        configuration; a process keeps only the latest few anyway)."""
        with self._lock:
            for slot in self._slots.values():
                slot.drops.append(session.id)
        session.close()

    def ready(self) -> set[int]:
        """The devices whose process is up and idle."""
        with self._lock:
            return {device for device, slot in self._slots.items()
                    if slot.process is not None and slot.process.state is State.IDLE}

    def processes(self) -> dict[int, int]:
        """Device -> pid of its live benchmark process."""
        with self._lock:
            return {device: slot.process.pid for device, slot in self._slots.items()
                    if slot.process is not None and slot.process.state is not State.GONE}

    def close(self, timeout: float = 30.0) -> None:
        """Answer what is queued with ``closed``, end every process, and wait for the
        driving threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            queued, self._queue = self._queue, []
            self._lock.notify_all()
            threads = [slot.thread for slot in self._slots.values() if slot.thread is not None]
            for slot in self._slots.values():
                process = slot.process
                if process is not None and process.state is not State.GONE:
                    from aiocompile._pool.procs import kill_group

                    kill_group(process.pid)
        for task in queued:
            if task.future.set_running_or_notify_cancel():
                task.future.set_result(_given_up(task, min(task.devices), BenchmarkOutcome.CLOSED,
                                                 "the scheduler was closed"))
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    # -- the driving threads ---------------------------------------------------------------

    def _ensure_thread(self, slot: _Slot) -> None:
        # Under the lock.
        if slot.thread is None or not slot.thread.is_alive():
            slot.thread = threading.Thread(target=self._drive, args=(slot,), daemon=True,
                                           name=f"aiocompile-bench-{slot.device}")
            slot.thread.start()

    def _take(self, slot: _Slot) -> _Task | None:
        with self._lock:
            while True:
                if self._closed:
                    return None
                for index, task in enumerate(self._queue):
                    if slot.device in task.devices:
                        del self._queue[index]
                        if task.future.set_running_or_notify_cancel():
                            return task
                        break  # withdrawn: look again
                else:
                    if slot.offers:
                        return _OFFER
                    if slot.process is None and slot.failed_starts == 0:
                        # Nothing to do yet: start the process meanwhile (and after one
                        # was lost, its replacement), so that no configuration waits for it.
                        return _WARM
                    idle = slot.process is not None and slot.process.state is State.IDLE
                    if idle and slot.process is not None and slot.process.popen.poll() is not None:
                        # It died waiting (killed, out of memory): replaced now, not when
                        # a configuration finds it gone.
                        return _REPLACE
                    self._lock.wait(_IDLE_CHECK_SECONDS if idle else None)

    def _drive(self, slot: _Slot) -> None:
        try:
            while True:
                task = self._take(slot)
                if task is None:
                    break
                if task is _WARM:
                    self._start_for(slot)
                    continue
                if task is _OFFER:
                    self._send_offers(slot)
                    continue
                if task is _REPLACE:
                    if slot.process is not None:
                        self._ended(slot, slot.process, "died while idle")
                    continue
                try:
                    outcome = self._run(slot, task)
                except Exception as exc:  # a bug here must not leave the configuration unanswered
                    _log.exception("timing a configuration on device %d failed", slot.device)
                    self._abandon(slot)
                    outcome = _given_up(task, slot.device, BenchmarkOutcome.ERROR, f"{type(exc).__name__}: {exc}")
                task.future.set_result(outcome)
        finally:
            self._retire(slot)

    def _abandon(self, slot: _Slot) -> None:
        """After an unexpected error: a process that may be in the middle of something
        is killed, so that the next configuration starts from a known state."""
        process = slot.process
        if process is None or process.state in (State.IDLE, State.GONE):
            return
        if process.state in (State.STARTING, State.BUSY):
            process.kill()
        self._ended(slot, process, None)

    def _retire(self, slot: _Slot) -> None:
        process = slot.process
        if process is None:
            return
        if process.state is State.IDLE:
            process.stop()
        elif process.state not in (State.GONE, State.KILLING, State.EXITING):
            process.kill()
        if process.state is not State.GONE:
            self._ended(slot, process, None, timeout=5.0)

    def _start_for(self, slot: _Slot) -> BenchProcess | str:
        """The slot's process, started now if need be; or why it could not be."""
        process = slot.process
        if process is not None and process.state is State.IDLE:
            return process
        if slot.failed_starts >= _FAILED_STARTS and time.monotonic() - slot.failed_at < _FAST_FAIL_SECONDS:
            return slot.last_failure
        launched_at = time.time()
        try:
            process = launch(slot.device, self.timing.env(slot.device))
        except OSError as exc:
            return self._start_failed(slot, f"could not start a benchmark process: {exc}")
        with self._lock:
            slot.process = process
            closed = self._closed
        if closed:
            process.kill()
            self._ended(slot, process, None)
            return "the scheduler was closed"
        message: FromProcess | None = None
        lost = False
        try:
            process.send(Init(tuple(sys.path), self.timing.timer, slot.device))
            deadline = time.monotonic() + self.start_timeout
            early: dict[Session, tuple[float, float]] = {}
            while True:
                # A tuning's tensors offered meanwhile go at once: the process takes
                # them while it starts, and builds them as soon as it is ready.
                self._send_early(slot, process, early)
                message = process.receive(min(deadline, time.monotonic() + _EARLY_POLL_SECONDS))
                if message is not None or time.monotonic() >= deadline:
                    break
            if isinstance(message, Ready):
                for session, (sending, began) in early.items():
                    answer = process.receive(deadline)
                    if answer is None:
                        raise Lost("the benchmark process did not take the tensors in time")
                    if isinstance(answer, InputsLoaded):
                        process.sessions.add(session.id)
                        session.sent[slot.device] = (sending, time.perf_counter() - began)
        except Lost:
            lost = True
        if isinstance(message, Ready) and not lost:
            process.ready(message.device_name)
            slot.failed_starts = 0
            self.started += 1
            self.starts.append({"device": slot.device, "pid": process.pid, "launched_at": launched_at,
                                "ready_at": time.time(), **message.startup})
            self._event("started", slot.device, process.pid, process.device_name)
            return process
        if lost:
            why = ""  # said once its exit status is known, below
        elif message is None:
            process.kill()
            why = f"did not start within {self.start_timeout:g} s"
        elif isinstance(message, StartFailed):
            why = f"could not start: {message.reason}"
        else:
            why = "died while starting"
        _, code = self._ended(slot, process, None if self._closed else "start")
        if self._closed:
            return "the scheduler was closed"
        tail = process.output_tail()
        if lost:
            why = f"{describe_exit(code)} while starting"
        return self._start_failed(slot, f"the benchmark process for device {slot.device} {why}" +
                                  (f"\n{tail}" if tail and not isinstance(message, StartFailed) else ""))

    def _send_early(self, slot: _Slot, process: BenchProcess, early: dict[Session, tuple[float, float]]) -> None:
        """Send the tensors offered to a starting process (their answers are read once
        it is ready)."""
        with self._lock:
            offers = [session for session in slot.offers if session.id not in slot.drops and session not in early]
            slot.offers.clear()
        for session in offers:
            early[session] = (time.time(), time.perf_counter())
            process.send(LoadInputs(session.id, session.wire()))

    def _start_failed(self, slot: _Slot, reason: str) -> str:
        slot.failed_starts += 1
        slot.failed_at = time.monotonic()
        slot.last_failure = reason
        _log.warning("%s", reason)
        return reason

    def _ended(self, slot: _Slot, process: BenchProcess, lost: str | None,
               timeout: float = 30.0) -> tuple[State, int | None]:
        """Reap ``process``; ``lost`` says why it counts as lost (a crash, a fault, a
        hang, a failed start), None for an end on purpose."""
        before, code = process.ended(timeout)
        with self._lock:
            if slot.process is process:
                slot.process = None
            self._lock.notify_all()  # its thread may start a replacement
        if lost is not None:
            self.lost += 1
            self._event("lost", slot.device, process.pid, f"{lost}: it {describe_exit(code)}")
        return before, code

    def _event(self, what: str, device: int, pid: int, detail: str | None) -> None:
        if self._on_process is not None:
            try:
                self._on_process(what, device, pid, detail)
            except Exception:  # a listener's bug must not stop a device
                _log.exception("a benchmark process listener raised")

    def _run(self, slot: _Slot, task: _Task) -> Timed:
        """Time ``task`` in the slot's process; every way it can end becomes a Timed."""
        while True:
            task.attempts += 1
            started = time.time()
            process = self._start_for(slot)
            if isinstance(process, str):
                return _given_up(task, slot.device,
                                 BenchmarkOutcome.CLOSED if self._closed else BenchmarkOutcome.START_FAILED, process,
                                 started)
            try:
                self._send_drops(slot, process)
                if task.session.id not in process.sessions:
                    problem = self._send_inputs(process, task.session)
                    if problem is not None:
                        return self._outcome(task, process, BenchmarkOutcome.ERROR, None, problem, started)
                process.claim(task)
                process.send(Bench(task.id, task.session.id, task.payload))
                deadline = None if self.timeout is None else time.monotonic() + self.timeout
                message = process.receive(deadline)
            except Lost:
                if process.state is State.BUSY:
                    return self._crashed(slot, task, process, started)
                self._ended(slot, process, None if self._closed else "lost while taking the tensors")
                if task.attempts < 2 and not self._closed:
                    continue  # lost before the configuration was sent: not its fault
                return _given_up(task, slot.device,
                                 BenchmarkOutcome.CLOSED if self._closed else BenchmarkOutcome.CRASHED,
                                 "the benchmark process died before it could time this configuration", started)
            if message is None:
                process.kill()
                self._ended(slot, process, "timeout")
                return self._outcome(task, process, BenchmarkOutcome.TIMEOUT, None,
                                     f"timed out: still running after {self.timeout:g} s (the benchmark process was "
                                     "killed)", started)
            if not isinstance(message, Result):
                raise TypeError(f"a benchmark process answered a configuration with {type(message).__name__}")
            if message.status is Status.NEED_INPUTS:
                process.answered()
                process.sessions.discard(task.session.id)
                task.attempts -= 1
                continue
            if message.status is Status.FAULT:
                process.faulted()
                self._ended(slot, process, "fault")
                return self._outcome(task, process, BenchmarkOutcome.FAULT, None,
                                     f"{message.reason} (the device was left unusable; its benchmark process was "
                                     "replaced)", started)
            process.answered()
            return self._outcome(task, process, _ANSWERED[message.status], message.timings, message.reason, started,
                                 message.phases)

    def _crashed(self, slot: _Slot, task: _Task, process: BenchProcess, started: float) -> Timed:
        _, code = self._ended(slot, process, None if self._closed else "crashed")
        if self._closed:
            return self._outcome(task, process, BenchmarkOutcome.CLOSED, None, "the scheduler was closed", started)
        tail = process.output_tail()
        reason = f"the benchmark process {describe_exit(code)} while timing this configuration"
        return self._outcome(task, process, BenchmarkOutcome.CRASHED, None, reason + (f"\n{tail}" if tail else ""),
                             started)

    def _send_offers(self, slot: _Slot) -> None:
        with self._lock:
            offers = list(slot.offers)
            slot.offers.clear()
        process = self._start_for(slot)
        if isinstance(process, str):
            return
        try:
            self._send_drops(slot, process)
            for session in offers:
                if session.id not in process.sessions and session.id not in slot.drops:
                    self._send_inputs(process, session)  # a failure shows again with its first configuration
        except Lost:
            self._ended(slot, process, None if self._closed else "lost while taking the tensors")

    def _send_drops(self, slot: _Slot, process: BenchProcess) -> None:
        while slot.drops:
            session = slot.drops.popleft()
            if session in process.sessions:
                process.sessions.discard(session)
                process.send(Drop(session))

    def _send_inputs(self, process: BenchProcess, session: Session) -> str | None:
        """Send a tuning's tensors; None once they are there, or why they could not be
        built (raises ``Lost`` if the process died meanwhile)."""
        sending, began = time.time(), time.perf_counter()
        process.send(LoadInputs(session.id, session.wire()))
        message = process.receive(time.monotonic() + self.start_timeout)
        session.sent[process.device] = (sending, time.perf_counter() - began)
        if message is None:
            process.kill()
            raise Lost("the benchmark process did not take the tensors in time")
        if isinstance(message, InputsFailed):
            return f"the benchmark process could not build the launch's tensors: {message.reason}"
        process.sessions.add(session.id)
        return None

    def _outcome(self, task: _Task, process: BenchProcess, status: BenchmarkOutcome, timings: tuple[float, ...] | None,
                 reason: str | None, started: float, phases: dict[str, float] | None = None) -> Timed:
        return Timed(status, timings, reason, process.device, process.device_name, process.pid, task.attempts,
                     started, time.time(), phases)


# What an answer that leaves the process working means for its configuration.
_ANSWERED = {Status.OK: BenchmarkOutcome.OK, Status.ERROR: BenchmarkOutcome.ERROR}

_WARM: Any = object()
_OFFER: Any = object()
_REPLACE: Any = object()


def _given_up(task: _Task, device: int, status: BenchmarkOutcome, reason: str,
              started: float | None = None) -> Timed:
    now = time.time()
    return Timed(status, None, reason, device, None, None, max(task.attempts, 1), started or now, now)
