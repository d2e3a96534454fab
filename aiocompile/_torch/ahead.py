"""Work the serving process's first load will need, done while the worker compiles.

Loading a compiled version of the Python form here needs things a process makes once and
keeps: the modules that load its artifact and Triton's backend hash (:mod:`.graph`,
seconds of CPU, most of it holding the interpreter lock), and for a model on the CPU
Inductor's vector-ISA check (seconds of a C++ compiler's). Made by the load itself, they
would add to the time until compiled and hold the lock in pieces long enough to be seen in
the eager calls' latency. A package needs nothing made ahead: :mod:`.aoti` loads it with
torch's C++ loader alone.

Each is an :class:`Ahead`: :meth:`~Ahead.start` runs it once per process in a thread of its
own, from the moment a model is wrapped (``compile_in_background``; again, a no-op, at
each compile's submission); :meth:`~Ahead.wait` is called by the load, which then finds
it made. :func:`start` and :func:`wait` do so for a form.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiocompile._base import aside, collector, threads

_logger = logging.getLogger("aiocompile")


class Ahead:
    """One piece of work, made at most once per process in a thread of its own."""

    def __init__(self, name: str, work: Callable[[], Any]) -> None:
        self.name = name
        self._work = work
        self._lock = threading.Lock()
        self._finished: cf.Future[None] = cf.Future()
        self._thread: int | None = None
        self._waited_for = False
        self.started = False
        self.seconds: float | None = None
        """How long it took, once it has run without raising."""

    def start(self) -> None:
        """Begin the work in a thread of its own, unless it has begun already."""
        with self._lock:
            if self.started:
                return
            self.started = True
        threads.start(self._run, f"aiocompile-{self.name}", daemon=True)

    def _run(self) -> None:
        began = time.perf_counter()
        with self._lock:
            # Until a load (or warm()) asks for it, nobody waits for it: it stands aside for
            # the serving process's calls more than aiocompile's other threads do.
            self._thread = threading.get_ident()
            if not self._waited_for:
                aside.patient()
        try:
            with collector.imports_settled(), threads.imports_yielding():
                self._work()
            self.seconds = time.perf_counter() - began
            _logger.debug("%s, made for loads here, took %.2f s", self.name, self.seconds)
        except Exception as exc:  # noqa: BLE001 - whoever needs it next meets the failure and reports it
            _logger.debug("%s, made for loads here, failed: %s: %s", self.name, type(exc).__name__, exc)
        finally:
            aside.hurried(threading.get_ident())
            self._finished.set_result(None)

    def finished(self) -> cf.Future[None] | None:
        """A future done when the work has ended (whether or not it raised); None when it
        has not begun. Asked by whoever is about to wait for it: from then on the work
        stands aside for the serving process's calls no more than the rest."""
        with self._lock:
            self._waited_for = True
            if self._thread is not None:
                aside.hurried(self._thread)
            return self._finished if self.started else None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for work that has begun (at most ``timeout`` seconds); True when there is
        none or it has ended. A load that runs while it does would repeat it."""
        finished = self.finished()
        if finished is None:
            return True
        try:
            finished.result(timeout)
        except cf.TimeoutError:
            return False
        return True


_FOR_CPU = threading.Event()
"""Set once a model on the CPU is to be loaded in the Python form: the load's imports then
make Inductor's vector-ISA check too."""


_REST_AFTER: list[cf.Future[Any]] = []
"""Futures (the workers' warm-ups of a scheduler being made) the first of which to end lets
a CPU model's load imports go on past what the ISA check needs (:func:`start`)."""

REST_WAIT = 120.0
"""Seconds those imports wait for them at most."""


def _prepare_graph_load() -> None:
    from aiocompile._torch import graph, isa  # imported here: the constructor imports this module

    if _FOR_CPU.is_set():
        graph.prepare(lambda: isa.Check(nice=isa.BUILD_NICE, idle=_builds_idle()), _await_rest)
    else:
        graph.prepare()


def _await_rest() -> bool:
    """Wait for the first warm-up to end; False when every one ended without a worker
    (cancelled: the scheduler closed before its workers started; or failed): no compile
    will come from it, and the rest of the imports, made while the program may be ending,
    are left to a load that needs them."""
    futures = list(_REST_AFTER)
    if not futures:
        return True
    cf.wait(futures, timeout=REST_WAIT, return_when=cf.FIRST_COMPLETED)
    return not all(future.done() and (future.cancelled() or future.exception() is not None) for future in futures)


def _builds_idle() -> bool:
    """Whether the ISA check's builds run under ``SCHED_IDLE``: as the workers of a
    scheduler made for a model on the CPU do (``choices.worker_idle``)."""
    from aiocompile._base.config import SchedulerConfig
    from aiocompile._torch import choices

    return choices.worker_idle("cpu", SchedulerConfig.from_env().worker_idle)


GRAPH_LOAD = Ahead("graph-load", _prepare_graph_load)
"""The modules a Python-form load imports, Triton's backend hash, and for a model on the
CPU Inductor's vector-ISA check (:func:`.graph.prepare`)."""


def start(form: str, device: str | None = None, rest_after: Sequence[cf.Future[Any]] = ()) -> None:
    """Begin what loading ``form`` here, for a model on ``device``, needs (``"python"``;
    a package needs nothing).

    ``rest_after``: for a model on the CPU, futures the first of which to end lets the
    imports go on once the ISA check's builds have begun (a scheduler's warm-ups: its fork
    server, which the first compile waits for, imports torch and Inductor meanwhile, and
    the rest of these imports, which only the load needs, would take CPU time from it)."""
    if form == "python":
        if device == "cpu":
            _REST_AFTER.extend(rest_after)
            _FOR_CPU.set()
        GRAPH_LOAD.start()


def finished(form: str) -> cf.Future[None] | None:
    """A future done when what loading ``form`` needs has been made; None when nothing
    has begun (or ``form`` needs nothing)."""
    return GRAPH_LOAD.finished() if form == "python" else None


def wait(form: str, timeout: float | None = None) -> bool:
    """Wait for what loading ``form`` needs, if begun (at most ``timeout`` seconds); True
    when there is nothing to wait for or it has ended."""
    return GRAPH_LOAD.wait(timeout) if form == "python" else True
