"""Where records and worker events go: stdlib logging, a JSON-lines file, callbacks.

Every :class:`~aiocompile.JobRecord` (one per request) and every
:class:`~aiocompile.WorkerEvent` (from the pool's supervisor thread, or the submitting
thread for a job sent at once to an idle worker) goes through one
:class:`EventHub` per scheduler, which hands it to

- the ``aiocompile`` logger: one record per event, its fields in ``extra`` (the kernel's
  name as ``kernel``, since ``name`` belongs to logging). Compiles log at INFO, failures
  at WARNING, cache hits and worker comings and goings at DEBUG; nothing is formatted
  unless a handler wants the level;
- a JSON-lines file (``event_log=``), one object per line with an ``"event"`` field,
  written by a thread of its own so that neither an event loop nor the supervisor ever
  waits on the disk;
- callbacks (``on_event=``, ``Scheduler.subscribe()``), called in the thread where the
  event happened: the event loop's for records, the supervisor's for worker events. They
  must be quick; an exception from one is logged once and otherwise ignored.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Union

from aiocompile.records import FAILURES, BenchmarkRecord, JobRecord, WorkerEvent

logger = logging.getLogger("aiocompile")

# How long the event file's writer lets events gather before it writes them.
_BATCH_SECONDS = 0.05

Event = Union[JobRecord, WorkerEvent, BenchmarkRecord]
Listener = Callable[[Event], None]

_RECORD_LEVELS = {"compiled": logging.INFO, "closed": logging.INFO, "cancelled": logging.INFO}
_RECORD_LEVELS.update(dict.fromkeys(FAILURES[:-1], logging.WARNING))  # error, crashed, timeout


def event_dict(event: Event) -> dict[str, Any]:
    """The event as one JSON-ready dict, ``"event"`` first."""
    return {"event": event.event, **event.to_dict()}


def _record_level(record: JobRecord) -> int:
    return _RECORD_LEVELS.get(record.outcome, logging.DEBUG)


def _record_message(record: JobRecord) -> str:
    target = f" for {record.target}" if record.target else ""
    if record.outcome == "compiled":
        stages = ""
        if record.stages:
            stages = " [" + ", ".join(f"{stage} {seconds * 1000:.0f}ms" for stage, seconds in record.stages) + "]"
        return (f"compiled {record.name}{target} in {record.run_time or 0.0:.3f} s "
                f"(queued {record.queue_wait or 0.0:.3f} s, worker {record.worker_pid}){stages}")
    if record.error:
        return f"{record.outcome}: {record.name}{target}: {record.error}"
    return f"{record.outcome}: {record.name}{target} in {record.total_time * 1000:.2f} ms"


def _worker_level(event: WorkerEvent) -> int:
    if event.event == "worker_exited" and event.status in ("crashed", "start_failed"):
        return logging.WARNING
    return logging.DEBUG


def _worker_message(event: WorkerEvent) -> str:
    if event.event == "worker_started":
        return f"worker {event.pid} started"
    if event.event == "worker_exited":
        code = "" if event.exitcode is None else f", exit status {event.exitcode}"
        return f"worker {event.pid} exited ({event.status}{code})"
    if event.event == "job_started":
        return f"attempt {event.attempt} at {event.name} started in worker {event.pid}"
    return f"attempt {event.attempt} at {event.name} in worker {event.pid} ended: {event.status}"


_BENCHMARK_LEVELS = {"ok": logging.DEBUG, "compile_error": logging.INFO, "error": logging.INFO,
                     "closed": logging.INFO}


def _benchmark_message(record: BenchmarkRecord) -> str:
    where = f" on device {record.device}" if record.device is not None else ""
    if record.outcome == "ok":
        return f"benchmarked {record.name} [{record.config}]{where}: {record.time_ms:.4f} ms"
    return f"benchmark of {record.name} [{record.config}]{where}: {record.outcome}: {record.reason}"


def log_event(event: Event) -> None:
    if isinstance(event, BenchmarkRecord):
        level = _BENCHMARK_LEVELS.get(event.outcome, logging.WARNING)
        if not logger.isEnabledFor(level):
            return
        message = _benchmark_message(event)
    elif isinstance(event, JobRecord):
        level = _record_level(event)
        if not logger.isEnabledFor(level):
            return
        message = _record_message(event)
    else:
        level = _worker_level(event)
        if not logger.isEnabledFor(level):
            return
        message = _worker_message(event)
    extra = event_dict(event)
    extra["kernel"] = extra.pop("name")
    logger.log(level, message, extra=extra)


class JsonLinesSink:
    """Appends each event as one JSON line to a file, from a writer thread of its own.

    Lines are written in batches, what has queued up in 50 ms, with one ``write()`` each
    on a file opened for appending, so several processes can share one file without
    tearing lines. ``flush()`` waits until what is queued is written; ``close()`` writes
    it and closes the file, and at interpreter exit an open sink does the same.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._queue: queue.SimpleQueue[dict[str, Any] | threading.Event | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_loop, name="aiocompile-event-log", daemon=True)
        self._closed = False
        self._hurry = threading.Event()
        self.write_errors = 0
        self._thread.start()
        _open_sinks.add(self)

    def __call__(self, event: Event) -> None:
        self.put(event_dict(event))

    def put(self, item: dict[str, Any]) -> None:
        """Queue one line's object (JSON-ready, ``"event"`` first)."""
        if not self._closed:
            self._queue.put(item)

    def _write_loop(self) -> None:
        # Items: an event's dict; a threading.Event that flush() waits on, set once what
        # was queued before it is written; None, to stop.
        while True:
            batch: list[dict[str, Any]] = []
            markers: list[threading.Event] = []
            stop = False
            item = self._queue.get()
            # Let events gather for a moment: one wake-up and one write per batch rather
            # than per event keeps this thread off the GIL while jobs are dispatched.
            # flush() and close() cut the wait short.
            self._hurry.wait(_BATCH_SECONDS)
            self._hurry.clear()
            while True:
                if item is None:
                    stop = True
                elif isinstance(item, threading.Event):
                    markers.append(item)
                else:
                    batch.append(item)
                if stop:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._write(batch)
            for marker in markers:
                marker.set()
            if stop:
                self._file.close()
                return

    def _write(self, batch: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(item, default=repr) + "\n" for item in batch)
        try:
            self._file.write(text)
            self._file.flush()
        except OSError as exc:
            self.write_errors += 1
            if self.write_errors == 1:
                logger.warning("aiocompile could not write its event log %s: %s", self.path, exc)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every event queued so far is in the file; False if that took longer
        than ``timeout`` seconds."""
        if self._closed:
            return True
        marker = threading.Event()
        self._queue.put(marker)
        self._hurry.set()
        return marker.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._hurry.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        _open_sinks.discard(self)


_open_sinks: weakref.WeakSet[JsonLinesSink] = weakref.WeakSet()


@atexit.register
def _close_open_sinks() -> None:
    for sink in list(_open_sinks):
        sink.close(timeout=2.0)


class EventHub:
    """Hands each event to the logger, the event file and the listeners, in that order.

    Listeners are kept in a tuple replaced on change, so that emitting (from any thread)
    takes no lock.
    """

    def __init__(self, *, event_log: str | os.PathLike[str] | None = None,
                 on_event: Listener | None = None) -> None:
        self.sink = None if event_log is None else JsonLinesSink(event_log)
        self._lock = threading.Lock()
        self._listeners: tuple[Listener, ...] = ()
        self._failed: set[int] = set()
        if self.sink is not None:
            self._listeners += (self.sink,)
        if on_event is not None:
            self._listeners += (on_event,)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Add a listener; returns a function that removes it."""
        if not callable(listener):
            raise TypeError(f"a listener must be callable, got {listener!r}")
        with self._lock:
            self._listeners += (listener,)

        def unsubscribe() -> None:
            with self._lock:
                listeners = list(self._listeners)
                if listener in listeners:
                    listeners.remove(listener)
                    self._listeners = tuple(listeners)

        return unsubscribe

    def job_events_wanted(self) -> bool:
        """Whether a job_started/job_ended event would reach anyone now: a listener, the
        event file, or a logger handling DEBUG."""
        return bool(self._listeners) or logger.isEnabledFor(logging.DEBUG)

    def warn(self, message: str) -> None:
        """A warning about the scheduler's own set-up (a cache directory built by another
        Triton): logged at WARNING, and written to the event file as a ``"warning"`` line
        that ``aiocompile report`` shows. Listeners hear of records and events only."""
        logger.warning(message)
        if self.sink is not None:
            self.sink.put({"event": "warning", "time": time.time(), "message": message})

    def emit(self, event: Event) -> None:
        log_event(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                if id(listener) not in self._failed:
                    self._failed.add(id(listener))
                    logger.exception("an aiocompile event listener raised (reported once per listener)")

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
