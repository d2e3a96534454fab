"""The half of a ``WorkerPool`` that runs in its supervisor thread.

One supervisor thread owns all the worker processes. It waits on every worker socket the
others do not read, the launcher's control socket and a wake-up pipe at once
(``multiprocessing.connection.wait``), so a death is noticed the moment the socket closes,
not by polling; and it drives each worker through its life (``_workers``): it starts
workers, hands them queued jobs, reads their answers (or hands a large one to an answers
thread), enforces deadlines, and deals with each death and stop. Other threads talk to it
only through the pool's commands and the wake-up pipe (``WorkerPool``, in ``_pool``).

A few steps are shared with the threads that submit and read (taking an idle worker,
sending a job, settling an answer); every change of a worker's state happens under the
pool's lock.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import struct
import threading
import time
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Callable

from aiocompile._base.threads import Lane
from aiocompile._pool import answers
from aiocompile._pool.child import JOB_HEADER, parse_message
from aiocompile._pool.handle import UNDELIVERED, State, Worker
from aiocompile._pool.job import Job, PoolCounters, death_statuses, emit_event, signal_name
from aiocompile._pool.launch import Launcher, LauncherError, make_launcher
from aiocompile._pool.loop_reads import AUDIT_PERIOD, LoopReads, readable_now
from aiocompile.errors import SchedulerClosed
from aiocompile.records import WorkerEvent

logger = logging.getLogger("aiocompile")

# How long a worker that closed its socket may take to be reaped before we stop waiting.
_REAP_TIMEOUT = 5.0
# Consecutive worker start failures after which queued jobs fail instead of waiting for a
# worker that will never come.
_MAX_START_FAILURES = 3
# Large answers are read in these threads, not the supervisor's: reading one takes as long
# as the worker takes to write it, and the supervisor must meanwhile watch the others.
_ANSWERS = Lane("aiocompile-answers", 2)


_FRAME = struct.Struct("!i")
_LONG_FRAME = struct.Struct("!Q")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _lower_priority(pid: int, nice: int) -> None:
    """Make a worker ``nice`` steps nicer than this process.

    Compiles use every core they get; the event loop of the process that asked for them
    must still wake up on time. Done while the worker is single-threaded (it has just said
    it is ready, and compilers start their threads in the first compile), so its later
    threads inherit it. A worker that cannot be reniced runs as it is.
    """
    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, pid, min(19, mine + nice))
    except (OSError, AttributeError):
        pass




class Supervisor:
    """What the supervisor thread does; the base of ``WorkerPool``, which sets up the
    state declared here."""

    max_workers: int
    max_worker_rss: int | None
    idle_timeout: float | None
    worker_nice: int
    start_method: str | None
    counters: PoolCounters
    on_event: Callable[[WorkerEvent], None] | None
    job_events_wanted: Callable[[], bool]
    _preload: tuple[str, ...]
    _lock: threading.Lock
    _commands: collections.deque[tuple[str, Any]]
    _wake_r: int
    _wake_w: int
    _woken: bool
    _cancelled: int
    _closed: bool
    _loop_reads: LoopReads
    # Owned by the supervisor thread:
    _launcher: Launcher | None
    _workers: list[Worker]
    _pending: collections.deque[Job]
    _warm_pending: collections.deque[Job]
    _start_failures: int
    _retry_start_at: float | None
    _reported_problems: set[str]
    _shutdown_deadline: float | None
    _stopping: bool

    def _wake(self) -> None:
        # One write until the supervisor has drained it: the write is a system call, which
        # lets the interpreter lock go, and taking it back from a busy supervisor can take
        # an event loop's thread a whole switch interval (5 ms) per submission in a burst.
        if self._woken:
            return
        self._woken = True
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a full pipe already means "wake up"


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
        while True:
            self._run_commands()
            if self._stopping and self._finished_stopping():
                return
            self._retire_marked()
            self._dispatch()
            waitables: list[Any] = [self._wake_r]
            with self._lock:
                # Not the sockets that others read (an event loop, a streaming thread):
                # those are looked at here only by the audit below. Under the lock, so that
                # a loop taking a worker knows whether the supervisor watches its socket.
                for w in self._workers:
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
                    worker = next((w for w in self._workers if w.proc.conn is obj), None)
                    if worker is not None:
                        self._on_readable(worker)
            self._check_deadlines()
            self._loop_reads.audit(self._workers)

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
        while True:
            with self._lock:
                if not self._commands:
                    return
                kind, value = self._commands.popleft()
                if kind == "submit":
                    # Queued under the lock: a submitter that finds neither a command nor a
                    # queued job may send its own job at once, and must not overtake this.
                    (self._warm_pending if value.warm_only else self._pending).append(value)
            if kind == "submit":
                depth = len(self._pending)
                if depth > self.counters.queue_depth_max:
                    self.counters.queue_depth_max = depth
            elif kind == "kill":
                job, reason = value
                self._kill_job(job, reason)
            elif kind == "prepare":
                self._prepare_launcher()
            elif kind == "shutdown":
                cancel_futures, grace = value
                self._begin_shutdown(cancel_futures, grace)

    def _next_timeout(self) -> float | None:
        deadlines = [w.deadline for w in self._workers if w.deadline is not None]
        if any(w.reader is not None for w in self._workers):
            deadlines.append(time.monotonic() + AUDIT_PERIOD)
        if self.idle_timeout is not None:
            deadlines.extend(w.last_used + self.idle_timeout for w in self._workers if w.idle)
        if self._shutdown_deadline is not None:
            deadlines.append(self._shutdown_deadline)
        if self._retry_start_at is not None and (self._pending or self._warm_pending):
            deadlines.append(self._retry_start_at)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    # -- starting work ----------------------------------------------------------------------

    def _dispatch(self) -> None:
        self._drop_cancelled()
        # Warm-up jobs go only to workers that have not been warmed, one each; once every
        # slot holds a warmed worker, the ones left have nothing to do.
        while self._warm_pending:
            job = self._warm_pending[0]
            worker = self._claim(lambda w: not w.warmed, job)
            if worker is None:
                if len(self._workers) >= self.max_workers and all(w.warmed for w in self._workers):
                    self._warm_pending.popleft().succeed(None)
                    continue
                break
            self._warm_pending.popleft()
            self._start_job(worker, job)
        while self._pending:
            job = self._pending[0]
            worker = self._claim(lambda w: True, job)
            if worker is None:
                break
            self._pending.popleft()
            self._start_job(worker, job)
        wanted = len(self._pending) + len(self._warm_pending)
        starting = sum(1 for w in self._workers if w.state is State.STARTING)
        if self._retry_start_at is not None and time.monotonic() < self._retry_start_at:
            return
        while wanted > starting and len(self._workers) < self.max_workers:
            if not self._launch_worker():
                break
            starting += 1

    def _drop_cancelled(self) -> None:
        # Only after a cancellation: looking at every queued future on every turn of the
        # supervisor's loop held the interpreter lock for most of a burst of thousands of
        # jobs (each look takes the future's lock), and an event loop waited for it.
        if not self._cancelled:
            return
        self._cancelled = 0
        for queue in (self._pending, self._warm_pending):
            if any(job.future.cancelled() for job in queue):
                kept = [job for job in queue if not job.future.cancelled()]
                queue.clear()
                queue.extend(kept)

    # Idle workers may be taken by the supervisor or, for a new job, by the thread that
    # submits it; so every transition of a worker's state happens under the pool's lock.

    def _claim(self, eligible: Callable[[Worker], bool], job: Job) -> Worker | None:
        with self._lock:
            return self._claim_locked(eligible, job)

    def _claim_locked(self, eligible: Callable[[Worker], bool], job: Job) -> Worker | None:
        # Most recently used first: its caches (Triton's in-process ones, the page cache)
        # are the warmest, and the others can then be left idle long enough to be stopped.
        best = None
        for worker in self._workers:
            if worker.idle and eligible(worker) and (best is None or worker.last_used > best.last_used):
                best = worker
        if best is not None:
            best.claim(job)
        return best

    def _start_failed(self, error: str) -> None:
        # Try again after a pause that grows with each failure in a row; after a few, fail
        # what is queued rather than let it wait for a worker that will never come.
        self._start_failures += 1
        self._retry_start_at = time.monotonic() + min(2.0, 0.1 * 2 ** self._start_failures)
        if self._start_failures >= _MAX_START_FAILURES:
            self._fail_queued(RuntimeError(f"aiocompile could not start worker processes: {error}"))

    def _prepare_launcher(self) -> None:
        try:
            if self._launcher is None:
                self._launcher = make_launcher(self.start_method, self._preload)
            self._launcher.prepare()
        except (LauncherError, OSError) as exc:
            # Not fatal here: the first launch tries again and reports.
            logger.warning("aiocompile could not prepare its workers: %s", exc)

    def _launch_worker(self) -> bool:
        try:
            if self._launcher is None:
                self._launcher = make_launcher(self.start_method, self._preload)
            proc = self._launcher.launch()
            for problem in getattr(self._launcher, "problems", ()):
                if problem not in self._reported_problems:
                    self._reported_problems.add(problem)
                    logger.warning("aiocompile workers start without a preload: %s", problem)
        except (LauncherError, OSError) as exc:
            self._start_failed(str(exc))
            return False
        self._workers.append(Worker(proc))
        self.counters.workers_started += 1
        return True

    def _start_job(self, worker: Worker, job: Job) -> bool:
        """Send ``job`` to ``worker``, which was claimed for it. False if the job was
        cancelled meanwhile (the worker is idle again)."""
        # A retried job's future is RUNNING already; a queued one may have been cancelled,
        # or (sent from a submitting thread as the pool shuts down) failed meanwhile.
        try:
            startable = job.future.set_running_or_notify_cancel()
        except RuntimeError:  # RUNNING: a retry; or FINISHED: it has its outcome already
            startable = job.future.running()
        if not startable:
            with self._lock:
                worker.release()
            return False
        now = time.monotonic()
        if job.started_at is None:
            job.started_at = now
        job.attempt_started_at = now
        job.attempts += 1
        job.worker_pid = worker.proc.pid
        worker.deadline = None if job.timeout is None else now + job.timeout
        env = None if job.env is worker.sent_env else job.env
        path = None if job.sys_path is worker.sent_path else job.sys_path
        worker.sent_env, worker.sent_path = job.env, job.sys_path
        extra = b"" if env is None and path is None else pickle.dumps((env, path), protocol=pickle.HIGHEST_PROTOCOL)
        # Framed as multiprocessing.connection frames it, and sent in one write.
        size = JOB_HEADER.size + len(extra) + len(job.payload)
        frame = _FRAME.pack(size) if size < 0x7FFFFFFF else _FRAME.pack(-1) + _LONG_FRAME.pack(size)
        message = b"".join((frame, JOB_HEADER.pack(job.id, len(extra)), extra, job.payload))
        try:
            _write_all(worker.proc.jobs_w, message)
        except OSError:
            # The worker died before it could take the job: the job never ran, so this
            # is no crash of its. Its socket's end is seen by the wait loop.
            with self._lock:
                worker.kill(job, UNDELIVERED)
        if self.on_event is not None and self.job_events_wanted():
            emit_event(self.on_event, "job_started", worker.proc.pid, job)
        return True

    # -- answers ------------------------------------------------------------------------------

    def _on_readable(self, worker: Worker) -> None:
        ended = None
        with self._lock:
            # An event loop reads this worker's answer; or one has just read it, and the
            # readiness seen was its answer's, so there is nothing to read now.
            if worker.reader is not None or worker.streaming or not readable_now(worker.proc.conn):
                return
            if worker.idle:
                # An idle worker's socket is readable at its end only; taken out of reach
                # of submitters here, under the same lock as the look.
                ended = worker.ended()
        if ended is not None:
            self._on_death(worker, ended)
            return
        try:
            data = worker.proc.conn.recv_bytes()
        except (EOFError, OSError):
            self._on_death(worker)
            return
        message = parse_message(data)
        if message[0] == "ready":
            if self.worker_nice:
                _lower_priority(worker.proc.pid, self.worker_nice)
            with self._lock:
                worker.ready()
            self._start_failures = 0
            self._retry_start_at = None
            emit_event(self.on_event, "worker_started", worker.proc.pid)
        elif message[0] == "done":
            self._on_done(worker, message)

    def _on_done(self, worker: Worker, message: tuple[Any, ...]) -> None:
        """The supervisor has read a ``done`` message."""
        self._answered(worker, message, in_loop=False)

    def _answered(self, worker: Worker, message: tuple[Any, ...], *, in_loop: bool) -> None:
        """A whole ``done`` message from ``worker``, read by the supervisor or an event
        loop: stream what follows it, or settle its job now."""
        if message[7]:
            self._stream(worker, message)
            return
        job = worker.job
        recycle = self._job_done(worker, message[6])
        self._settle(worker, job, message, message[3])
        if in_loop:
            if recycle or self._pending or self._warm_pending:
                self._wake()  # replacing it, and dispatching, are the supervisor's
        elif recycle:
            self._retire_marked()

    def _stream(self, worker: Worker, message: tuple[Any, ...]) -> None:
        """The answer follows ``message``: read it in an answers thread (see ``_answers``).
        The job has answered in time; the rest is reading."""
        with self._lock:
            worker.reader = None
            worker.streaming = True
            worker.deadline = None
            fd = os.dup(worker.proc.conn.fileno())
        # Not watched by the supervisor meanwhile: it read the message itself (and leaves
        # the socket out of its next wait), or an event loop did (it was not watching).
        _ANSWERS.submit(lambda: self._read_stream(worker, message, fd))

    def _read_stream(self, worker: Worker, message: tuple[Any, ...], fd: int) -> None:
        job = worker.job
        output = worker.proc.output_tail() if message[5] and job is not None else ""
        try:
            payload = answers.Payload(fd)
            try:
                result = None if job is None else answers.outcome(job, message[2], payload, output)
                payload.drain()
            finally:
                payload.close()
        except answers.Broken:
            # The worker died, or was killed, while answering: its end is the supervisor's
            # to see (a crash of its job, or the kill's).
            with self._lock:
                worker.streaming = False
            self._wake()
            return
        self._job_done(worker, message[6])
        self._settle(worker, job, message, None, result)
        # The supervisor left this socket out of its wait: let it watch it again (and
        # replace the worker if it has grown too big, or give it a queued job).
        self._wake()

    def _job_done(self, worker: Worker, rss: int) -> bool:
        """A worker has answered its job (in whichever thread read the answer): it is idle
        again, before the answer goes out, so that the caller's next job may take it at
        once; or, grown past ``max_worker_rss`` (compilers leak), marked for the
        supervisor to replace (``_retire_marked``); or, being killed, it stays so. Returns
        whether it was marked."""
        recycle = self.max_worker_rss is not None and rss > self.max_worker_rss
        with self._lock:
            worker.answered(outgrown=recycle)
            worker.jobs_run += 1
            worker.rss = rss
            worker.last_used = time.monotonic()
            return worker.state is State.RETIRING

    def _settle(self, worker: Worker, job: Job | None, message: tuple[Any, ...], data: Any,
                result: tuple[bool, Any] | None = None) -> None:
        """The job's outcome from its ``done`` message, in the thread that read it: from
        ``data`` (the answer), or the ``result`` already made of it. Never raises."""
        _, job_id, ok, _, run_time, output_size, rss, _ = message
        if job is None or job.id != job_id:  # pragma: no cover - protocol invariant
            return
        if job.warm_only:
            worker.warmed = True
        job.finished_at = worker.last_used
        job.run_time = run_time
        job.output_size = output_size
        job.worker_rss = rss
        if not ok and output_size:
            job.last_output = worker.proc.output_tail()
        if result is None:
            result = answers.outcome(job, ok, data, job.last_output if not ok else "")
        succeeded, value = result
        if succeeded:
            job.succeed(value)
        else:
            job.fail(value)
        # After the answer: the caller need not wait for the report.
        if self.on_event is not None and self.job_events_wanted():
            emit_event(self.on_event, "job_ended", worker.proc.pid, job, status="ok" if ok else "error")

    # -- deaths and stops ---------------------------------------------------------------------

    def _retire(self, worker: Worker, why: str) -> None:
        """Stop a worker on purpose (idle, too big). It holds no job and nothing worth
        saving, so it is simply killed, and reaped here."""
        assert self._launcher is not None
        with self._lock:
            worker.ended()
            self._workers.remove(worker)
            worker.drop_peek()
        worker.proc.conn.close()
        self._launcher.kill(worker.proc)
        exitcode = self._launcher.wait_exit(worker.proc, _REAP_TIMEOUT)
        worker.proc.close()
        emit_event(self.on_event, "worker_exited", worker.proc.pid, status=why, exitcode=exitcode)

    def _on_death(self, worker: Worker, ended: tuple[State, Job | None, str | None] | None = None) -> None:
        """``worker`` has died (its socket ended), in whatever state: see ``_workers``."""
        assert self._launcher is not None
        if ended is None:
            with self._lock:
                # From here no submitter can take it; one that took it just before has left
                # its job in ``worker.job``, and that job is dealt with below.
                ended = worker.ended()
        state, job, reason = ended
        with self._lock:
            self._workers.remove(worker)
            worker.drop_peek()
        exitcode = self._launcher.wait_exit(worker.proc, _REAP_TIMEOUT)
        # Judge the fork server now: the replacement below would start a new one.
        machinery_failed = not self._launcher.healthy(worker.proc)
        worker.proc.exitcode = exitcode
        tail = worker.proc.output_tail()
        worker.proc.close()
        pid = worker.proc.pid
        if state is State.STARTING:
            emit_event(self.on_event, "worker_exited", pid, status="start_failed", exitcode=exitcode)
            self._start_failed(f"a worker exited with {signal_name(exitcode)} while starting:\n{tail}")
            return
        # A death on purpose (killed for a job that answered meanwhile, or as the pool
        # stops) is no crash; a worker that died by itself, idle or not, is one.
        deliberate = state is State.KILLING or self._stopping
        if job is None:
            emit_event(self.on_event, "worker_exited", pid,
                       status="shutdown" if self._stopping else "killed" if deliberate else "crashed",
                       exitcode=exitcode)
        else:
            worker_status, job_status = death_statuses(reason, machinery_failed)
            emit_event(self.on_event, "job_ended", pid, job, status=job_status, exitcode=exitcode)
            emit_event(self.on_event, "worker_exited", pid, status=worker_status, exitcode=exitcode)
        if not self._stopping:
            # Whatever the cause, the pool goes back to the size it had.
            self._launch_worker()
        if job is not None:
            if job.after_death(reason, exitcode, tail, machinery_failed, self.counters):
                self._requeue(job)
        elif not deliberate:
            self.counters.worker_crashes += 1

    def _requeue(self, job: Job) -> None:
        # First in line again. The future is already RUNNING; it stays so while the job
        # waits for a retry.
        job.worker_pid = None
        self._pending.appendleft(job)

    def _retire_marked(self) -> None:
        """Replace the workers found too big after their job."""
        for worker in [w for w in self._workers if w.state is State.RETIRING and w.retire_reason]:
            self.counters.recycled += 1
            self._retire(worker, worker.retire_reason or "recycled")
            if not self._stopping:
                self._launch_worker()

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        # Not while jobs wait: a worker that has just started is idle until the next
        # dispatch, and may have taken longer than idle_timeout to start; stopping it
        # then starts another for the same job, and so on for ever.
        if self.idle_timeout is not None and not self._stopping and not self._pending:
            with self._lock:
                expired = [w for w in self._workers if w.idle and now - w.last_used >= self.idle_timeout]
                for worker in expired:
                    worker.retire("idle")
            for worker in expired:
                self.counters.idle_stopped += 1
                self._retire(worker, "idle")
        for worker in self._workers:
            if worker.deadline is not None and worker.deadline <= now:
                worker.deadline = None
                if worker.job is not None:
                    self._kill_on(worker, worker.job, "timeout")
        if self._shutdown_deadline is not None and self._shutdown_deadline <= now:
            self._shutdown_deadline = None
            self._fail_queued(SchedulerClosed("the scheduler was closed before the job started"))
            for worker in self._workers:
                if worker.job is not None:
                    self._kill_on(worker, worker.job, "the scheduler was closed while the job ran")

    def _kill_on(self, worker: Worker, job: Job, reason: str) -> None:
        """Kill ``worker`` for ``job``, if it still holds that job (see ``Worker.kill``)."""
        with self._lock:
            send = worker.kill(job, reason)
        if send:
            assert self._launcher is not None
            self._launcher.kill(worker.proc)

    def _kill_job(self, job: Job, reason: str) -> None:
        if job.future.done():
            return
        for worker in self._workers:
            if worker.job is job:
                self._kill_on(worker, job, reason)
                return
        # Waiting for a retry: it is in the queue with a RUNNING future.
        for queue in (self._pending, self._warm_pending):
            if job in queue:
                queue.remove(job)
                job.fail(job.stopped_error(reason))

    def _fail_queued(self, exc: BaseException) -> None:
        for queue in (self._pending, self._warm_pending):
            while queue:
                queue.popleft().fail(exc)

    def _fail_everything(self, exc: BaseException) -> None:
        self._fail_queued(exc)
        for worker in self._workers:
            if worker.job is not None:
                worker.job.fail(exc)
        with self._lock:
            self._closed = True
            commands = list(self._commands)
            self._commands.clear()
        for kind, value in commands:
            if kind == "submit":
                value.fail(exc)

    # -- shutdown (supervisor side) -------------------------------------------------------------

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
        if self._pending or self._warm_pending:
            return False
        return not any(w.job is not None for w in self._workers)

    def _teardown(self) -> None:
        closing = SchedulerClosed("the worker pool is shut down")
        self._fail_everything(closing)
        # Idle workers exit when their socket closes; the launcher kills any left.
        for worker in self._workers:
            with self._lock:
                worker.drop_peek()
            worker.proc.close()
        if self._launcher is not None:
            for worker in self._workers:
                self._launcher.kill(worker.proc)
            for worker in self._workers:
                exitcode = self._launcher.wait_exit(worker.proc, _REAP_TIMEOUT)
                emit_event(self.on_event, "worker_exited", worker.proc.pid, status="shutdown", exitcode=exitcode)
            self._launcher.close()
        self._workers = []
        self._close_fds()
