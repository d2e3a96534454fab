"""The supervisor: the one thread that owns a pool's worker processes.

It waits on every worker socket that no one else reads, the launcher's control socket and a
wake-up pipe at once (``multiprocessing.connection.wait``), so a death is noticed the
moment a socket closes, not by polling. Each turn it takes the commands other threads left
(``roster.Command``), hands queued jobs to idle workers, starts workers where jobs wait,
reads answers, enforces deadlines and deals with each death and stop. Other threads reach
it only through the roster's commands and ``wake()``.

The supervisor shares with the other threads only what is in the ``Roster`` (under its
lock); the launcher, the wake-up pipe, the retry pacing and the shutdown deadline are its
own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import wait as wait_for_any
from typing import Any

from aiocompile._pool import procs
from aiocompile._pool.handle import Death, Retire, State, Worker
from aiocompile._pool.job import Job, Stop, death_statuses, emit_event, signal_name
from aiocompile._pool.launch import Launcher, LauncherError, make_launcher
from aiocompile._pool.loop_reads import AUDIT_PERIOD, LoopReads, readable_now
from aiocompile._pool.protocol import Ready, read_answer
from aiocompile._pool.roster import Command, KillJob, Prepare, Roster, Shutdown, Submit
from aiocompile.errors import SchedulerClosed

logger = logging.getLogger("aiocompile")

# How long a worker that closed its socket may take to be reaped before we stop waiting.
_REAP_TIMEOUT = 5.0
# Consecutive worker start failures after which queued jobs fail instead of waiting for a
# worker that will never come.
_MAX_START_FAILURES = 3


class Supervisor:
    """The thread that drives one pool's workers (started on the first command)."""

    def __init__(self, *, max_workers: int, start_method: str | None, preload: tuple[str, ...],
                 idle_timeout: float | None, worker_nice: int, max_worker_rss: int | None,
                 worker_idle: bool = False) -> None:
        self.max_workers = max_workers
        self.idle_timeout = idle_timeout
        self.worker_nice = worker_nice
        self.worker_idle = worker_idle
        self._start_method = start_method
        self._preload = preload
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._woken = False  # a wake-up is written and not yet drained
        self.roster = Roster(max_worker_rss=max_worker_rss, wake=self.wake)
        self.loop_reads = LoopReads(self.roster)
        self._thread: threading.Thread | None = None
        # The thread's own:
        self._launcher: Launcher | None = None
        self._interrupted = False  # interrupt_start(): the pool closes, nothing queued to run
        self._start_failures = 0
        self._retry_start_at: float | None = None
        self._reported_problems: set[str] = set()
        self._shutdown_deadline: float | None = None
        self._stopping = False

    # -- what other threads call ------------------------------------------------------------

    def command(self, command: Command) -> None:
        """Leave ``command`` for the thread (starting it on the first one) and wake it.
        ``SchedulerClosed`` for a job submitted to a closed pool."""
        roster = self.roster
        with roster.lock:
            if roster.closed and isinstance(command, Submit):
                raise SchedulerClosed("the worker pool is shut down")
            roster.commands.append(command)
            if self._thread is None:
                self._thread = threading.Thread(target=self._supervise, name="aiocompile-supervisor", daemon=True)
                roster.supervised = True
                self._thread.start()
        self.wake()

    def wake(self) -> None:
        # One write until the supervisor has drained it: the write is a system call, which
        # lets the interpreter lock go, and taking it back from a busy supervisor can take
        # an event loop's thread a whole switch interval per submission in a burst.
        if self._woken:
            return
        self._woken = True
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a full pipe already means "wake up"

    def close(self, wait: bool) -> threading.Thread | None:
        """Mark the roster closed (the caller has queued a ``Shutdown``); the thread, if
        there is one, to join. With no thread, the descriptors are closed now."""
        thread = self._thread
        if thread is None:
            self._close_fds()
            return None
        self.wake()
        if wait:
            thread.join()
        return thread

    def forget(self) -> None:
        """In a forked child: the processes belong to the parent. Drop this process's copies
        of the descriptors without telling anyone anything."""
        self.roster.closed = True
        for worker in self.roster.workers:
            worker.drop_peek()
            if worker.registration is not None:
                worker.registration.close()  # this process's copy; the parent's stays
                worker.registration = None
            worker.proc.close()
        self.roster.workers = []
        if self._launcher is not None:
            self._launcher.forget()
            self._launcher = None
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    # -- the thread's loop ---------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # pragma: no cover - a bug here must not hang callers
            self._fail_everything(RuntimeError(f"the aiocompile supervisor failed: {exc!r}"))
            raise
        finally:
            self._teardown()

    def _loop(self) -> None:
        roster = self.roster
        while True:
            self._run_commands()
            if self._stopping and self._finished_stopping():
                return
            self._retire_marked()
            self._dispatch()
            waitables: list[Any] = [self._wake_r]
            with roster.lock:
                # Not the sockets that others read (an event loop, a streaming thread):
                # those are looked at here only by the audit below. Under the lock, so that
                # a loop taking a worker knows whether the supervisor watches its socket.
                for w in roster.workers:
                    w.watched = w.reader is None and not w.streaming
                    if w.watched:
                        waitables.append(w.proc.conn)
            if self._launcher is not None and (fd := self._launcher.fileno()) is not None:
                waitables.append(fd)
            ready = wait_for_any(waitables, self._next_timeout())
            for index, obj in enumerate(ready):
                if index:
                    # Answers handled one after another run Python back to back (a
                    # kernel's result is unpickled and made ready here): let a waiting
                    # event loop have the interpreter lock between them.
                    time.sleep(0)
                if isinstance(obj, int):
                    if obj == self._wake_r:
                        self._drain_wake()
                    elif self._launcher is not None:
                        self._launcher.on_readable()
                else:
                    worker = next((w for w in roster.workers if w.proc.conn is obj), None)
                    if worker is not None:
                        self._on_readable(worker)
            self._check_deadlines()
            self.loop_reads.audit(roster.workers)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        # After the pipe is empty, and before the commands are read (the next turn of the
        # loop): cleared first, a write landing meanwhile would be drained with the flag
        # left set, and no wake-up written again.
        self._woken = False

    def _run_commands(self) -> None:
        roster = self.roster
        while True:
            with roster.lock:
                if not roster.commands:
                    return
                command = roster.commands.popleft()
                if isinstance(command, Submit):
                    # Queued under the lock: a submitter that finds neither a command nor a
                    # queued job may send its own job at once, and must not overtake this.
                    job = command.job
                    (roster.warm_pending if job.warm_only else roster.pending).append(job)
            if isinstance(command, Submit):
                depth = len(roster.pending)
                if depth > roster.counters.queue_depth_max:
                    roster.counters.queue_depth_max = depth
            elif isinstance(command, KillJob):
                self._kill_job(command.job, command.stop)
            elif isinstance(command, Prepare):
                self._prepare_launcher()
            elif isinstance(command, Shutdown):
                self._begin_shutdown(command.cancel_futures, command.grace)

    def _next_timeout(self) -> float | None:
        workers = self.roster.workers
        deadlines = [w.deadline for w in workers if w.deadline is not None]
        if any(w.reader is not None for w in workers):
            deadlines.append(time.monotonic() + AUDIT_PERIOD)
        if self.idle_timeout is not None:
            deadlines.extend(w.last_used + self.idle_timeout for w in workers if w.idle)
        if self._shutdown_deadline is not None:
            deadlines.append(self._shutdown_deadline)
        if self._retry_start_at is not None and (self.roster.pending or self.roster.warm_pending):
            deadlines.append(self._retry_start_at)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    # -- starting work ----------------------------------------------------------------------

    def _dispatch(self) -> None:
        roster = self.roster
        self._drop_cancelled()
        # Warm-up jobs go only to workers that have not been warmed, one each; once every
        # slot holds a warmed worker, the ones left have nothing to do.
        while roster.warm_pending:
            job = roster.warm_pending[0]
            worker = roster.claim(_unwarmed, job)
            if worker is None:
                if len(roster.workers) >= self.max_workers and all(w.warmed for w in roster.workers):
                    roster.warm_pending.popleft().succeed(None)
                    continue
                break
            roster.warm_pending.popleft()
            roster.start_job(worker, job)
        while roster.pending:
            job = roster.pending[0]
            worker = roster.claim(_any, job)
            if worker is None:
                break
            roster.pending.popleft()
            roster.start_job(worker, job)
        wanted = len(roster.pending) + len(roster.warm_pending)
        starting = sum(1 for w in roster.workers if w.state is State.STARTING)
        if self._retry_start_at is not None and time.monotonic() < self._retry_start_at:
            return
        while wanted > starting and len(roster.workers) < self.max_workers:
            if not self._launch_worker():
                break
            starting += 1

    def _drop_cancelled(self) -> None:
        # Only after a cancellation: looking at every queued future on every turn held the
        # interpreter lock for most of a burst of thousands of jobs (each look takes the
        # future's lock), and an event loop waited for it.
        roster = self.roster
        if not roster.cancelled:
            return
        roster.cancelled = 0
        for queue in (roster.pending, roster.warm_pending):
            if any(job.future.cancelled() for job in queue):
                kept = [job for job in queue if not job.future.cancelled()]
                queue.clear()
                queue.extend(kept)

    def _start_failed(self, error: str) -> None:
        # Try again after a pause that grows with each failure in a row; after a few, fail
        # what is queued rather than let it wait for a worker that will never come.
        self._start_failures += 1
        self._retry_start_at = time.monotonic() + min(2.0, 0.1 * 2 ** self._start_failures)
        if self._start_failures >= _MAX_START_FAILURES:
            self._fail_queued(RuntimeError(f"aiocompile could not start worker processes: {error}"))

    def _the_launcher(self) -> Launcher:
        """The launcher, made on first use (it may start a fork server)."""
        if self._launcher is None:
            self._launcher = make_launcher(self._start_method, self._preload, self.worker_nice, self.worker_idle)
            if self._interrupted:
                self._launcher.interrupt()
        return self._launcher

    def interrupt_start(self) -> None:
        """From the closing thread, when nothing queued is to run: a start of workers under
        way gives up at once, and none begins (``Launcher.interrupt``)."""
        self._interrupted = True
        launcher = self._launcher
        if launcher is not None:
            launcher.interrupt()

    def _prepare_launcher(self) -> None:
        try:
            self._the_launcher().prepare()
        except (LauncherError, OSError) as exc:
            # Not fatal here: the first launch tries again and reports (none after a close).
            if not self._interrupted:
                logger.warning("aiocompile could not prepare its workers: %s", exc)

    def _launch_worker(self) -> bool:
        try:
            launcher = self._the_launcher()
            proc = launcher.launch()
            for problem in getattr(launcher, "problems", ()):
                if problem not in self._reported_problems:
                    self._reported_problems.add(problem)
                    logger.warning("aiocompile workers start without a preload: %s", problem)
        except (LauncherError, OSError) as exc:
            self._start_failed(str(exc))
            return False
        self.roster.workers.append(Worker(proc))
        self.roster.counters.workers_started += 1
        return True

    # -- reading a worker ---------------------------------------------------------------------

    def _on_readable(self, worker: Worker) -> None:
        roster = self.roster
        death = None
        with roster.lock:
            # An event loop reads this worker's answer; or one has just read it, and the
            # readiness seen was its answer's, so there is nothing to read now.
            if worker.reader is not None or worker.streaming or not readable_now(worker.proc.conn):
                return
            if worker.idle:
                # An idle worker's socket is readable at its end only; taken out of reach
                # of submitters here, under the same lock as the look.
                death = worker.ended()
        if death is not None:
            self._on_death(worker, death)
            return
        try:
            data = worker.proc.conn.recv_bytes()
        except (EOFError, OSError):
            self._on_death(worker)
            return
        message = read_answer(data)
        if isinstance(message, Ready):
            if self.worker_nice or self.worker_idle:
                procs.lower_priority(worker.proc.pid, self.worker_nice, self.worker_idle)
            with roster.lock:
                worker.ready()
            self._start_failures = 0
            self._retry_start_at = None
            emit_event(roster.on_event, "worker_started", worker.proc.pid)
        elif roster.answered(worker, message, in_loop=False):
            self._retire_marked()

    # -- deaths and stops ---------------------------------------------------------------------

    def _retire(self, worker: Worker, why: Retire) -> None:
        """Stop a worker on purpose (idle, too big). It holds no job and nothing worth
        saving, so it is simply killed, and reaped here."""
        assert self._launcher is not None
        with self.roster.lock:
            worker.ended()
            self.roster.workers.remove(worker)
            worker.drop_peek()
        worker.proc.conn.close()
        self._launcher.kill(worker.proc)
        exitcode = self._launcher.wait_exit(worker.proc, _REAP_TIMEOUT)
        worker.proc.close()
        emit_event(self.roster.on_event, "worker_exited", worker.proc.pid, status=why.value, exitcode=exitcode)

    def _on_death(self, worker: Worker, death: Death | None = None) -> None:
        """``worker`` has died (its socket ended), in whatever state: see ``handle``."""
        assert self._launcher is not None
        roster = self.roster
        if death is None:
            with roster.lock:
                # From here no submitter can take it; one that took it just before has left
                # its job in ``worker.job``, and that job is dealt with below.
                death = worker.ended()
        with roster.lock:
            roster.workers.remove(worker)
            worker.drop_peek()
        exitcode = self._launcher.wait_exit(worker.proc, _REAP_TIMEOUT)
        # Judge the fork server now: the replacement below would start a new one.
        machinery_failed = not self._launcher.healthy(worker.proc)
        worker.proc.exitcode = exitcode
        tail = worker.proc.output_tail()
        worker.proc.close()
        pid = worker.proc.pid
        on_event = roster.on_event
        if death.state is State.STARTING:
            emit_event(on_event, "worker_exited", pid, status="start_failed", exitcode=exitcode)
            self._start_failed(f"a worker exited with {signal_name(exitcode)} while starting:\n{tail}")
            return
        # A death on purpose (killed for a job that answered meanwhile, or as the pool
        # stops) is no crash; a worker that died by itself, idle or not, is one.
        deliberate = death.state is State.KILLING or self._stopping
        job = death.job
        if job is None:
            emit_event(on_event, "worker_exited", pid,
                       status="shutdown" if self._stopping else "killed" if deliberate else "crashed",
                       exitcode=exitcode)
        else:
            worker_status, job_status = death_statuses(death.stop, machinery_failed)
            emit_event(on_event, "job_ended", pid, job, status=job_status, exitcode=exitcode)
            emit_event(on_event, "worker_exited", pid, status=worker_status, exitcode=exitcode)
        if not self._stopping:
            # Whatever the cause, the pool goes back to the size it had.
            self._launch_worker()
        if job is not None:
            if job.after_death(death.stop, exitcode, tail, machinery_failed, roster.counters):
                self._requeue(job)
        elif not deliberate:
            roster.counters.worker_crashes += 1

    def _requeue(self, job: Job) -> None:
        # First in line again. The future is already RUNNING; it stays so while the job
        # waits for a retry.
        job.worker_pid = None
        self.roster.pending.appendleft(job)

    def _retire_marked(self) -> None:
        """Replace the workers found too big after their job."""
        roster = self.roster
        for worker in [w for w in roster.workers if w.state is State.RETIRING and w.retire_reason]:
            roster.counters.recycled += 1
            self._retire(worker, worker.retire_reason or Retire.RECYCLED)
            if not self._stopping:
                self._launch_worker()

    def _check_deadlines(self) -> None:
        roster = self.roster
        now = time.monotonic()
        # Not while jobs wait: a worker that has just started is idle until the next
        # dispatch, and may have taken longer than idle_timeout to start; stopping it
        # then starts another for the same job, and so on for ever.
        if self.idle_timeout is not None and not self._stopping and not roster.pending:
            with roster.lock:
                expired = [w for w in roster.workers if w.idle and now - w.last_used >= self.idle_timeout]
                for worker in expired:
                    worker.retire(Retire.IDLE)
            for worker in expired:
                roster.counters.idle_stopped += 1
                self._retire(worker, Retire.IDLE)
        for worker in roster.workers:
            if worker.deadline is not None and worker.deadline <= now:
                worker.deadline = None
                if worker.job is not None:
                    self._kill_on(worker, worker.job, Stop.TIMEOUT)
        if self._shutdown_deadline is not None and self._shutdown_deadline <= now:
            self._shutdown_deadline = None
            self._fail_queued(SchedulerClosed("the scheduler was closed before the job started"))
            for worker in roster.workers:
                if worker.job is not None:
                    self._kill_on(worker, worker.job, Stop.CLOSED)

    def _kill_on(self, worker: Worker, job: Job, stop: Stop) -> None:
        """Kill ``worker`` for ``job``, if it still holds that job (see ``Worker.kill``)."""
        with self.roster.lock:
            send = worker.kill(job, stop)
        if send:
            assert self._launcher is not None
            self._launcher.kill(worker.proc)

    def _kill_job(self, job: Job, stop: Stop) -> None:
        if job.future.done():
            return
        roster = self.roster
        for worker in roster.workers:
            if worker.job is job:
                self._kill_on(worker, job, stop)
                return
        # Waiting for a retry: it is in the queue with a RUNNING future.
        for queue in (roster.pending, roster.warm_pending):
            if job in queue:
                queue.remove(job)
                job.fail(job.stopped_error(stop))

    def _fail_queued(self, exc: BaseException) -> None:
        for queue in (self.roster.pending, self.roster.warm_pending):
            while queue:
                queue.popleft().fail(exc)

    def _fail_everything(self, exc: BaseException) -> None:
        roster = self.roster
        self._fail_queued(exc)
        for worker in roster.workers:
            if worker.job is not None:
                worker.job.fail(exc)
        with roster.lock:
            roster.closed = True
            commands = list(roster.commands)
            roster.commands.clear()
        for command in commands:
            if isinstance(command, Submit):
                command.job.fail(exc)

    # -- shutdown ---------------------------------------------------------------------------

    def _begin_shutdown(self, cancel_futures: bool, grace: float | None) -> None:
        self._stopping = True
        if cancel_futures:
            self._fail_queued(SchedulerClosed("the scheduler was closed before the job started"))
        if grace is not None:
            self._shutdown_deadline = time.monotonic() + grace
            self._check_deadlines()

    def _finished_stopping(self) -> bool:
        # Queued jobs (kept when not cancelled) still run before the pool stops; a worker
        # being killed whose job has answered holds nothing to wait for.
        if self.roster.pending or self.roster.warm_pending:
            return False
        return not any(w.job is not None for w in self.roster.workers)

    def _teardown(self) -> None:
        roster = self.roster
        self._fail_everything(SchedulerClosed("the worker pool is shut down"))
        # Idle workers exit when their socket closes; the launcher kills any left.
        for worker in roster.workers:
            with roster.lock:
                worker.drop_peek()
            worker.proc.close()
        if self._launcher is not None:
            for worker in roster.workers:
                self._launcher.kill(worker.proc)
            for worker in roster.workers:
                exitcode = self._launcher.wait_exit(worker.proc, _REAP_TIMEOUT)
                emit_event(roster.on_event, "worker_exited", worker.proc.pid, status="shutdown", exitcode=exitcode)
            self._launcher.close()
        roster.workers = []
        self._close_fds()


def _any(worker: Worker) -> bool:
    return True


def _unwarmed(worker: Worker) -> bool:
    return not worker.warmed
