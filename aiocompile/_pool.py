"""WorkerPool: a ``concurrent.futures.Executor`` that supervises one job per worker process.

Each worker holds at most one job, sent over its own socket, so the parent always knows
which job a worker holds. That is what makes the rest exact:

- a worker that dies (segfault, OOM kill, ``os._exit``) takes exactly one job with it; that
  job is retried on another worker, and fails with ``WorkerCrashedError`` once it has killed
  ``max_crashes`` workers. Jobs in other workers never notice.
- a job past its timeout is stopped by killing its worker only (``CompileTimeout``).
- a queued job can be cancelled; a running one can be killed without touching the others.

A worker's life is the state machine in ``_workers``; this module drives it. One
supervisor thread owns all the processes. It waits on every worker socket, the launcher's
control socket and a wake-up pipe at once (``multiprocessing.connection.wait``), so a death
is noticed the moment the socket closes, not by polling. Other threads talk to it only
through ``_commands`` and the wake-up pipe. Answers are read by the supervisor, by the
event loop that awaits them (``_loop_reads``), or, when large, by a thread that streams
them (``_answers``).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import itertools
import logging
import os
import pickle
import threading
import time
import weakref
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Callable

from aiocompile import _answers, _checks
from aiocompile._errors import CompileTimeout, SchedulerClosed, WorkerCrashedError
from aiocompile._jobs import Job, PoolCounters, death_statuses, emit_event, signal_name
from aiocompile._launch import Launcher, LauncherError, make_launcher
from aiocompile._loop_reads import AUDIT_PERIOD, LoopReads, readable_now, running_loop
from aiocompile._metrics import WorkerEvent
from aiocompile._threads import Lane
from aiocompile._workers import UNDELIVERED, State, Worker

logger = logging.getLogger("aiocompile")

# How long a worker that closed its socket may take to be reaped before we stop waiting.
_REAP_TIMEOUT = 5.0
# Consecutive worker start failures after which queued jobs fail instead of waiting for a
# worker that will never come.
_MAX_START_FAILURES = 3
# Large answers are read in these threads, not the supervisor's: reading one takes as long
# as the worker takes to write it, and the supervisor must meanwhile watch the others.
_ANSWERS = Lane("aiocompile-answers", 2)


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


def check_timeout(timeout: Any) -> None:
    """A job's timeout must be None or a positive, finite number of seconds (see
    ``_checks.JOB_TIMEOUT``). Checked in the submitting thread: found later, in the
    supervisor, a bad value would stop it and fail every other job too."""
    _checks.JOB_TIMEOUT.check("timeout", timeout)


class WorkerPool(cf.Executor):
    """A supervised pool of worker processes, one job per worker at a time.

    ``submit()`` follows the ``Executor`` contract; ``submit_job()`` also takes a timeout,
    a crash budget and a name for error messages, and returns the :class:`Job` with its
    timings. ``on_event``, if set, is called with a :class:`~aiocompile.WorkerEvent` for
    each worker start and exit and each attempt at a job, in the supervisor thread (or,
    for a job sent at once to an idle worker, in the submitting thread); it must be quick.
    """

    def __init__(
        self,
        max_workers: int,
        *,
        start_method: str | None = None,
        preload: tuple[str, ...] = (),
        max_crashes: int = 2,
        max_worker_rss: int | None = None,
        idle_timeout: float | None = None,
        worker_nice: int = 0,
    ) -> None:
        # Checked here, in the caller: the supervisor thread trusts them.
        self.max_workers = _checks.WORKERS.check("max_workers", max_workers)
        self.max_crashes = _checks.CRASHES.check("max_crashes", max_crashes)
        self.max_worker_rss = _checks.RSS.check("max_worker_rss", max_worker_rss)
        self.idle_timeout = _checks.IDLE_TIMEOUT.check("idle_timeout", idle_timeout)
        self.worker_nice = _checks.NICE.check("worker_nice", worker_nice)
        self.start_method = _checks.START_METHOD.check("start_method", start_method)
        self._preload = _checks.PRELOAD.check("preload", preload)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._commands: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        self._woken = False  # a wake-up is written and not yet drained
        self._cancelled = 0  # queued jobs cancelled since the supervisor last looked
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._ids = itertools.count(1)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.counters = PoolCounters()
        self.on_event: Callable[[WorkerEvent], None] | None = None
        # Whether anyone takes job_started/job_ended events now: they are two per job, and
        # building them for nobody was a tenth of a trivial job's round trip.
        self.job_events_wanted: Callable[[], bool] = _always
        self._loop_reads = LoopReads(self)
        # Owned by the supervisor thread:
        self._launcher: Launcher | None = None
        self._workers: list[Worker] = []
        self._pending: collections.deque[Job] = collections.deque()
        self._warm_pending: collections.deque[Job] = collections.deque()
        self._start_failures = 0
        self._retry_start_at: float | None = None
        self._reported_problems: set[str] = set()
        self._shutdown_deadline: float | None = None
        self._stopping = False
        _live_pools.add(self)

    # -- submission (any thread) -------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        return self.submit_job(fn, args, kwargs).future

    def submit_job(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        max_crashes: int | None = None,
        name: str | None = None,
        key: str | None = None,
        warm_only: bool = False,
        direct: bool = False,
    ) -> Job:
        """Queue ``fn(*args, **kwargs)``; raises ``TypeError`` at once if it cannot be sent.

        With a worker idle and nothing queued, the job is sent to it from this thread at
        once: the round trip through the supervisor thread (a wake-up, and the GIL passed
        from thread to thread) was a fifth of a trivial job's whole round trip.

        ``direct=True`` says that the caller will await the job in the asyncio event loop
        running in this thread, and that its answer is small: then, when the job goes at
        once to an idle worker, that loop reads the answer itself (see ``_loop_reads``).
        The job's future is then resolved in the loop's thread. Otherwise, and for
        everything but the answer, the supervisor reads and watches the worker."""
        self._check_usable()
        check_timeout(timeout)
        if max_crashes is not None:
            _checks.CRASHES.check("max_crashes", max_crashes)
        job = Job.create(next(self._ids), fn, args, kwargs, timeout=timeout,
                         max_crashes=max_crashes or self.max_crashes, name=name, key=key, warm_only=warm_only)
        loop = running_loop() if direct and not warm_only else None
        worker = None if warm_only else self._claim_for_new(job, loop)
        if worker is None:
            self._command("submit", job)
            return job
        # The supervisor's wait must end at this job's deadline, and must watch the socket
        # exactly when no loop reads it: it stops for a loop that reads now, and starts
        # again for a worker that a loop or an answers thread read for last.
        wake = job.timeout is not None or worker.watched != (worker.reader is None)
        if self._start_job(worker, job) and wake:
            self._wake()
        return job

    def _claim_for_new(self, job: Job, loop: Any = None) -> Worker | None:
        """An idle worker for a new job, taken now, if no job is waiting ahead of it; with
        ``loop``, that loop is to read the answer, if it can."""
        with self._lock:
            if self._closed or self._thread is None or self._commands or self._pending or self._warm_pending:
                return None
            worker = self._claim_locked(lambda w: True, job)
            if worker is not None and loop is not None:
                worker.reader = self._loop_reads.reader_for(worker, loop)
            return worker

    def kill(self, job: Job, reason: str = "cancelled") -> None:
        """Stop a job: cancel it if queued, kill its worker if running."""
        if not self.cancel(job):
            self._command("kill", (job, reason))

    def cancel(self, job: Job) -> bool:
        """Drop a job that has not started; returns False (and does nothing) if it has."""
        if job.future.cancel():
            self._cancelled += 1
            self._wake()
            return True
        return False

    def start(self) -> None:
        """Get the pool ready to start workers (the fork server loads in the background);
        returns at once. Workers themselves still start on demand."""
        self._check_usable()
        self._command("prepare", None)

    def warm(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[Job]:
        """Start every worker and run ``fn(*args)`` once in each worker not yet warmed."""
        return [self.submit_job(fn, args, warm_only=True, name="warm-up") for _ in range(self.max_workers)]

    def _command(self, kind: str, value: Any) -> None:
        with self._lock:
            if self._closed and kind == "submit":
                raise SchedulerClosed("the worker pool is shut down")
            self._commands.append((kind, value))
            if self._thread is None:
                self._thread = threading.Thread(target=self._supervise, name="aiocompile-supervisor", daemon=True)
                self._thread.start()
        self._wake()

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

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise SchedulerClosed("this worker pool belongs to the parent of a forked process; create a new one here")
        if self._closed:
            raise SchedulerClosed("the worker pool is shut down")

    # -- introspection (any thread) -------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def snapshot(self) -> dict[str, int]:
        """Workers by state and queue depth now (a racy read, good for metrics)."""
        workers = list(self._workers)
        return {
            "workers": len(workers),
            "busy_workers": sum(1 for w in workers if w.state in (State.BUSY, State.KILLING)),
            "idle_workers": sum(1 for w in workers if w.state is State.IDLE),
            "queue_depth": len(self._pending),
        }

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in list(self._workers)]

    # -- shutdown ---------------------------------------------------------------------------

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, grace: float | None = None) -> None:
        """Stop accepting work. Queued jobs run unless ``cancel_futures``; running jobs get
        ``grace`` seconds (None: as long as they need) before their workers are killed.
        Every job still unfinished then fails with ``SchedulerClosed``."""
        _checks.POOL_GRACE.check("grace", grace)
        if os.getpid() != self._pid:
            self._forget_after_fork()
            return
        with self._lock:
            first = not self._closed
            self._closed = True
            thread = self._thread
            if first:
                self._commands.append(("shutdown", (cancel_futures, grace)))
        if thread is None:
            self._close_fds()
            return
        self._wake()
        if wait:
            thread.join()

    def _forget_after_fork(self) -> None:
        # In a forked child: the processes belong to the parent. Drop our copies of the
        # descriptors without telling anyone anything.
        self._closed = True
        for worker in self._workers:
            worker.drop_peek()
            if worker.registration is not None:
                worker.registration.close()  # this process's copy; the parent's stays
                worker.registration = None
            worker.proc.close()
        self._workers = []
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

    # -- the supervisor thread ----------------------------------------------------------

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
                    self._finish_noop(self._warm_pending.popleft())
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
            startable = job.future.running() or job.future.set_running_or_notify_cancel()
        except RuntimeError:  # FINISHED: it has its outcome already
            startable = False
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
        message = pickle.dumps(("run", job.id, env, path, job.payload), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            worker.proc.conn.send_bytes(message)
        except OSError:
            # The worker died before it could take the job: the job never ran, so this
            # is no crash of its. The socket's end is seen by the wait loop.
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
        message = pickle.loads(data)
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
            payload = _answers.Payload(fd)
            try:
                result = None if job is None else _answers.outcome(job, message[2], payload, output)
                payload.drain()
            finally:
                payload.close()
        except _answers.Broken:
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
            result = _answers.outcome(job, ok, data, job.last_output if not ok else "")
        succeeded, value = result
        if succeeded:
            self._set_result(job, value)
        else:
            self._set_exception(job, value)
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
            self._job_lost(job, reason, exitcode, tail, machinery_failed)
        elif not deliberate:
            self.counters.worker_crashes += 1

    def _job_lost(self, job: Job, reason: str | None, exitcode: int | None, tail: str,
                  machinery_failed: bool) -> None:
        """What becomes of the job a dead worker held: ``reason`` says why it was killed,
        None if it was not (a crash)."""
        job.last_exitcode = exitcode
        job.last_output = tail
        job.finished_at = time.monotonic()
        if reason == UNDELIVERED:
            job.attempts -= 1
            self._requeue(job)
            return
        if reason == "timeout":
            self.counters.timeouts += 1
            self._set_exception(job, CompileTimeout(
                f"did not finish within {job.timeout:g} s; its worker was killed",
                timeout=job.timeout, kernel_name=job.name, key=job.key, output=tail))
            return
        if reason is not None:
            self.counters.killed += 1
            self._set_exception(job, cf.CancelledError() if reason == "cancelled" else SchedulerClosed(reason))
            return
        self.counters.worker_crashes += 1
        if machinery_failed:
            # The fork server died and took its workers with it: not this job's doing, so
            # it is retried without counting against it.
            self.counters.retries += 1
            self._requeue(job)
            return
        job.crashes += 1
        if job.crashes >= job.max_crashes:
            self._set_exception(job, WorkerCrashedError(
                f"killed its worker {job.crashes} time(s), last with {signal_name(exitcode)}",
                exitcode=exitcode, attempts=job.attempts, kernel_name=job.name, key=job.key, output=tail))
            return
        self.counters.retries += 1
        self._requeue(job)

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
                self._set_exception(job, cf.CancelledError() if reason == "cancelled" else SchedulerClosed(reason))

    def _set_result(self, job: Job, result: Any) -> None:
        if not job.future.done():
            job.future.set_result(result)

    def _set_exception(self, job: Job, exc: BaseException) -> None:
        if job.finished_at is None:
            job.finished_at = time.monotonic()
        if job.future.done():
            return
        if job.future.running() or job.future.set_running_or_notify_cancel():
            job.future.set_exception(exc)

    def _finish_noop(self, job: Job) -> None:
        if job.future.set_running_or_notify_cancel():
            job.finished_at = time.monotonic()
            job.future.set_result(None)

    def _fail_queued(self, exc: BaseException) -> None:
        for queue in (self._pending, self._warm_pending):
            while queue:
                self._set_exception(queue.popleft(), exc)

    def _fail_everything(self, exc: BaseException) -> None:
        self._fail_queued(exc)
        for worker in self._workers:
            if worker.job is not None:
                self._set_exception(worker.job, exc)
        with self._lock:
            self._closed = True
            commands = list(self._commands)
            self._commands.clear()
        for kind, value in commands:
            if kind == "submit":
                self._set_exception(value, exc)

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


def _always() -> bool:
    return True


_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _shutdown_all_at_exit() -> None:
    for pool in list(_live_pools):
        pool.shutdown(wait=True, cancel_futures=True, grace=0)


def _after_fork_in_child() -> None:
    for pool in list(_live_pools):
        pool._forget_after_fork()


atexit.register(_shutdown_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
