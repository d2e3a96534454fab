"""The pool's workers and queues, and what any thread may do with them.

Four kinds of thread touch a pool's workers:

- a **submitting** thread (an event loop's, often) sends a new job straight to an idle
  worker when nothing is queued ahead of it (``claim_for_new``, ``start_job``): the round
  trip through the supervisor thread (a wake-up, the interpreter lock passed from thread to
  thread) was a large part of a trivial job's;
- the **supervisor** thread does everything else: it starts, feeds, watches and replaces
  workers (``supervisor``);
- an **event loop** reads a small answer to a job it sent itself (``loop_reads``);
- an **answers** thread reads a large answer while the supervisor watches the others.

Whichever reads an answer settles its job here (``answered``): the worker is idle again
before the answer goes out, so that the caller's next job may take it at once.

Everything in a ``Roster`` is shared by those threads, guarded by ``lock``: every change of
a worker's state (``handle``), the queues, the commands to the supervisor, ``closed``. The
rest of a worker belongs to the thread that drives or reads it at the time.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from aiocompile._base.threads import Lane
from aiocompile._pool.handle import State, Worker
from aiocompile._pool.job import Job, PoolCounters, Stop, emit_event
from aiocompile._pool.protocol import Broken, Done, Payload, encode_job, outcome
from aiocompile.records import WorkerEvent

# Large answers are read in these threads, not the supervisor's: reading one takes as long
# as the worker takes to write it, and the supervisor must meanwhile watch the others.
_ANSWERS = Lane("aiocompile-answers", 2)


# -- what other threads ask of the supervisor ---------------------------------------------------

@dataclass(frozen=True, slots=True)
class Submit:
    """Queue a job (a new one, or a warm-up: ``job.warm_only``)."""

    job: Job


@dataclass(frozen=True, slots=True)
class KillJob:
    """Stop a job: out of the queue, or its worker killed."""

    job: Job
    stop: Stop


@dataclass(frozen=True, slots=True)
class Prepare:
    """Get the launcher ready (the fork server loading), starting no worker."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    cancel_futures: bool
    grace: float | None


Command = Submit | KillJob | Prepare | Shutdown


def _always() -> bool:
    return True


class Roster:
    """One pool's workers, queues and commands, shared under ``lock``."""

    def __init__(self, *, max_worker_rss: int | None, wake: Callable[[], None]) -> None:
        self.lock = threading.Lock()
        self.max_worker_rss = max_worker_rss
        self.wake = wake
        """Wakes the supervisor thread (writes its wake-up pipe)."""
        self.workers: list[Worker] = []
        """Appended to by the supervisor alone; read and changed under the lock."""
        self.pending: collections.deque[Job] = collections.deque()
        self.warm_pending: collections.deque[Job] = collections.deque()
        self.commands: collections.deque[Command] = collections.deque()
        self.closed = False
        self.supervised = False
        """The supervisor thread has started (before, no job can be sent at once)."""
        self.cancelled = 0
        """Queued jobs cancelled since the supervisor last looked."""
        self.counters = PoolCounters()
        self.on_event: Callable[[WorkerEvent], None] | None = None
        # Whether anyone takes job_started/job_ended events now: they are two per job, and
        # building them for nobody cost a noticeable part of a trivial job's round trip.
        self.job_events_wanted: Callable[[], bool] = _always

    # -- taking an idle worker ------------------------------------------------------------------

    def claim_for_new(self, job: Job, reader: Callable[[Worker], Any] | None = None) -> Worker | None:
        """An idle worker for a new job, taken now, if no job is waiting ahead of it;
        ``reader(worker)``, under the lock, names who reads its answer (an event loop)."""
        with self.lock:
            if self.closed or not self.supervised or self.commands or self.pending or self.warm_pending:
                return None
            worker = self.claim_locked(_any_worker, job)
            if worker is not None and reader is not None:
                worker.reader = reader(worker)
            return worker

    def claim(self, eligible: Callable[[Worker], bool], job: Job) -> Worker | None:
        with self.lock:
            return self.claim_locked(eligible, job)

    def claim_locked(self, eligible: Callable[[Worker], bool], job: Job) -> Worker | None:
        # Most recently used first: its caches (Triton's in-process ones, the page cache)
        # are the warmest, and the others can then be left idle long enough to be stopped.
        best = None
        for worker in self.workers:
            if worker.idle and eligible(worker) and (best is None or worker.last_used > best.last_used):
                best = worker
        if best is not None:
            best.claim(job)
        return best

    # -- sending a job ------------------------------------------------------------------------------

    def start_job(self, worker: Worker, job: Job) -> bool:
        """Send ``job`` to ``worker``, which was claimed for it. False if the job was
        cancelled meanwhile (the worker is idle again)."""
        # A retried job's future is RUNNING already; a queued one may have been cancelled,
        # or (sent from a submitting thread as the pool shuts down) failed meanwhile.
        if not job.mark_running():
            with self.lock:
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
        try:
            _write_all(worker.proc.jobs_w, encode_job(job.id, env, path, job.payload,
                                                      worker.definitions.to_send(job.definition), job.buffers))
        except OSError:
            # The worker died before it could take the job: the job never ran, so this
            # is no crash of its. Its socket's end is seen by the supervisor's wait.
            with self.lock:
                worker.kill(job, Stop.UNDELIVERED)
        if self.on_event is not None and self.job_events_wanted():
            emit_event(self.on_event, "job_started", worker.proc.pid, job)
        return True

    # -- an answer ----------------------------------------------------------------------------------

    def answered(self, worker: Worker, done: Done, *, in_loop: bool) -> bool:
        """A whole answer from ``worker``, read by the supervisor or an event loop: stream
        what follows it, or settle its job now. Returns whether the worker, grown too big,
        is to be replaced (the supervisor's to do; one read elsewhere wakes it)."""
        if done.follows:
            self._stream(worker, done)
            return False
        job = worker.job
        recycle = self._job_done(worker, done.rss)
        self._settle(worker, job, done, done.data)
        if in_loop and (recycle or self.pending or self.warm_pending):
            self.wake()  # replacing it, and dispatching, are the supervisor's
        return recycle

    def _stream(self, worker: Worker, done: Done) -> None:
        """The answer follows ``done``: read it in an answers thread. The job has answered
        in time; the rest is reading."""
        with self.lock:
            worker.reader = None
            worker.streaming = True
            worker.deadline = None
            fd = os.dup(worker.proc.conn.fileno())
        # Not watched by the supervisor meanwhile: it read the header itself (and leaves
        # the socket out of its next wait), or an event loop did (it was not watching).
        _ANSWERS.submit(lambda: self._read_stream(worker, done, fd))

    def _read_stream(self, worker: Worker, done: Done, fd: int) -> None:
        job = worker.job
        output = worker.proc.output_tail() if done.output_size and job is not None else ""
        try:
            payload = Payload(fd)
            try:
                result = None if job is None else outcome(done.ok, payload, output, job.name, job.key)
                payload.drain()
            finally:
                payload.close()
        except Broken:
            # The worker died, or was killed, while answering: its end is the supervisor's
            # to see (a crash of its job, or the kill's).
            with self.lock:
                worker.streaming = False
            self.wake()
            return
        self._job_done(worker, done.rss)
        self._settle(worker, job, done, None, result)
        # The supervisor left this socket out of its wait: let it watch it again (and
        # replace the worker if it has grown too big, or give it a queued job).
        self.wake()

    def _job_done(self, worker: Worker, rss: int) -> bool:
        """A worker has answered its job: it is idle again, before the answer goes out, so
        that the caller's next job may take it at once; or, grown past ``max_worker_rss``,
        marked for the supervisor to replace; or, being killed, it stays so. Returns
        whether it was marked."""
        recycle = self.max_worker_rss is not None and rss > self.max_worker_rss
        with self.lock:
            worker.answered(outgrown=recycle)
            worker.jobs_run += 1
            worker.rss = rss
            worker.last_used = time.monotonic()
            return worker.state is State.RETIRING

    def _settle(self, worker: Worker, job: Job | None, done: Done, data: Any, result: Any = None) -> None:
        """The job's outcome, in the thread that read its answer: from ``data``, or the
        ``result`` already made of it (a streamed answer). Never raises."""
        job_id, ok, _, run_time, output_size, rss, _ = done
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
            result = outcome(ok, data, job.last_output if not ok else "", job.name, job.key)
        succeeded, value = result
        if succeeded:
            job.succeed(value)
        else:
            job.fail(value)
        # After the answer: the caller need not wait for the report.
        if self.on_event is not None and self.job_events_wanted():
            emit_event(self.on_event, "job_ended", worker.proc.pid, job, status="ok" if ok else "error")

    # -- what it holds ------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, int]:
        """Workers by state and queue depth now (a racy read, good for metrics)."""
        workers = list(self.workers)
        return {
            "workers": len(workers),
            "busy_workers": sum(1 for w in workers if w.state in (State.BUSY, State.KILLING)),
            "idle_workers": sum(1 for w in workers if w.state is State.IDLE),
            "queue_depth": len(self.pending),
        }

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in list(self.workers)]


def _any_worker(worker: Worker) -> bool:
    return True


# The most parts one ``writev`` takes (a model of many large weights has more: a message of
# a thousand out-of-band buffers).
_IOV_MAX = 1024


def _write_all(fd: int, parts: list[Any]) -> None:
    """Write ``parts`` whole, in order (one ``write`` for one part, else ``writev``)."""
    if len(parts) == 1:
        view = memoryview(parts[0])
        while view:
            view = view[os.write(fd, view):]
        return
    views = [memoryview(part) for part in parts if part]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]
