"""Standing aside: while a call is being served in the serving process (an eager model
call, :func:`serve_begin` .. :func:`serve_end`), aiocompile's own threads there that run
Python for seconds (the modules a load imports, the load, the packing: those inside
``threads.handing_over``, which :func:`attach` them) wait without the interpreter lock at
each of their Python calls.

A torch operator lets the lock go while it runs and takes it back after; with one of our
threads running Python meanwhile, each take waited up to a switch interval, dozens of
times a call. Standing aside leaves the lock free for the whole call, bounded:
``STAND_ASIDE_MAX`` a run of calls (a call may wait for something such a thread holds, a
module's import lock), and ``STAND_ASIDE_SHARE`` of every ``STAND_ASIDE_WINDOW`` (calls
served back to back would otherwise leave it no time at all).

A call on a GPU returns once its kernels are queued, and its caller waits for them next
(``.item()``, ``.cpu()``, a synchronisation), letting the lock go; were the call's end the
end of standing aside, that wait would take the lock back from a thread that had gone on
meanwhile. So such a call's end may be put off until its kernels are done
(:func:`serve_end`'s ``until``), by a thread of its own that waits without the lock.

How a thread learns of its Python calls: a trace function of its own (``sys.settrace``),
except on Python 3.12, where a trace function makes every line of the traced thread cost
more: importing a module of a few thousand lines (``html.entities``) took 150 to 250 ms,
holding the lock, against 6 ms untraced. There the threads attached share one callback on
``sys.monitoring``'s function starts, for a tool id of their own, registered while any
thread is attached; it costs every other thread's Python calls about 60 ns meanwhile.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["AFTER_DONE", "PATIENT_SHARE", "STAND_ASIDE_MAX", "STAND_ASIDE_SHARE", "STAND_ASIDE_WINDOW", "attach",
           "attached", "before_holding", "busy", "detach", "hurried", "patient", "serve_begin", "serve_end",
           "serving"]


class _Serving:
    """The calls being served right now, in any thread (``serve_begin``), and how long the
    attached threads have stood aside for the present run of them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.run = 0  # counts each time calls goes up from 0
        self.aside_in = -1
        self.aside = 0.0
        # Standing aside in the present window (``STAND_ASIDE_WINDOW``): since when, how long.
        self.window = 0.0
        self.window_aside = 0.0
        # The threads whose work nobody waits for yet (``patient``).
        self.patient: set[int] = set()
        # Set while no call is being served: a thread standing aside waits on it, without
        # the interpreter lock and without waking until the run of calls ends.
        self.idle = threading.Event()
        self.idle.set()
        # How many threads are attached (``attach``): none, and nothing stands aside.
        self.attached = 0


_SERVING = _Serving()

STAND_ASIDE_MAX = 0.02
"""How long, at most, the attached threads stand aside for one run of served calls: a
call that waits for something such a thread holds (a module's import lock) then goes on
after this long, rather than never."""

STAND_ASIDE_WINDOW = 0.1
STAND_ASIDE_SHARE = 0.5
"""And at most this share of each ``STAND_ASIDE_WINDOW`` seconds: calls served one after
another, each a run of its own, would otherwise leave such a thread one Python call
between two of them (a server busy with eager calls would never load its compiled
version)."""

PATIENT_SHARE = 0.9
"""The share of each window a thread whose work nobody waits for yet (:func:`patient`: the
modules a load will need, imported while the worker compiles) stands aside: calls served
half the time or more then leave it the time between them, rather than running beside them
once the usual share has run out (on a GPU host, eager calls of 4.3 ms every 9.3 ms took
up to 19 ms with those imports beside them). Back to ``STAND_ASIDE_SHARE`` once something
waits for it (:func:`hurried`)."""


def serve_begin() -> None:
    """A call is being served in this thread (an eager model call): until
    :func:`serve_end`, the attached threads stand aside at their next Python call."""
    with _SERVING.lock:
        if _SERVING.calls == 0:
            _SERVING.run += 1
            _SERVING.idle.clear()
        _SERVING.calls += 1


def serve_end(until: Any = None) -> None:
    """The call served in this thread (:func:`serve_begin`) has returned.

    ``until``: what it left running, for its caller to wait for next, such as a CUDA event
    recorded after its kernels: an object whose ``synchronize()`` waits for it without the
    interpreter lock. The call is then over for the attached threads only once that is
    done, and ``AFTER_DONE`` after, in a thread of aiocompile's (``aiocompile-served``);
    the caller goes on at once."""
    if until is not None and _PENDING.put(until):
        return
    _end()


def _end(calls: int = 1) -> None:
    with _SERVING.lock:
        _SERVING.calls -= calls
        if _SERVING.calls == 0:
            _SERVING.idle.set()


def serving() -> int:
    """How many calls are being served now (their ends put off included)."""
    return _SERVING.calls


def busy() -> bool:
    """Whether any thread stands aside for the calls served now (:func:`attach`): what is
    worth a caller's extra work to stand them aside longer (``serve_end``'s ``until``)."""
    return _SERVING.attached > 0


AFTER_DONE = 0.0005
"""Seconds a call's end is put off past what it left running (``serve_end``'s ``until``):
the caller's own wait for it, woken at the same moment, takes the interpreter lock first."""


class _Pending:
    """The calls whose end waits for what they left running, in order, and the daemon
    thread that ends each once that is done (started with the first)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.queue: list[Any] = []
        self.thread: threading.Thread | None = None

    def put(self, until: Any) -> bool:
        """Queue ``until``; False where no thread could be started (the caller ends the
        call itself)."""
        with self.lock:
            if self.thread is None:
                thread = threading.Thread(target=self._run, name="aiocompile-served", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # the interpreter is shutting down
                    return False
                self.thread = thread
            self.queue.append(until)
            self.ready.notify()
        return True

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.queue:
                    self.ready.wait()
                # All that is queued, in one turn: calls made faster than a turn takes
                # neither pile up nor each wait AFTER_DONE.
                waits, self.queue = self.queue, []
            for until in waits:
                try:
                    until.synchronize()
                except Exception:  # noqa: BLE001 - the caller's own wait meets it; the call ends all the same
                    pass
            time.sleep(AFTER_DONE)
            _end(len(waits))


_PENDING = _Pending()


def patient() -> None:
    """This thread's work is not waited for yet: it stands aside for up to
    ``PATIENT_SHARE`` of each window, until :func:`hurried`."""
    with _SERVING.lock:
        _SERVING.patient.add(threading.get_ident())


def hurried(ident: int) -> None:
    """Something waits for the work of the thread ``ident``: it stands aside for the usual
    share again (and this is forgotten when the thread is gone)."""
    with _SERVING.lock:
        _SERVING.patient.discard(ident)


def _stand_aside() -> None:
    """While calls are being served, wait without the interpreter lock, within the bounds."""
    clock = time.perf_counter
    began = clock()
    if began - _SERVING.window > STAND_ASIDE_WINDOW:
        _SERVING.window, _SERVING.window_aside = began, 0.0
    share = PATIENT_SHARE if threading.get_ident() in _SERVING.patient else STAND_ASIDE_SHARE
    allowed = share * STAND_ASIDE_WINDOW - _SERVING.window_aside
    run = _SERVING.run
    if _SERVING.aside_in != run:
        _SERVING.aside_in, _SERVING.aside = run, 0.0
    allowed = min(allowed, STAND_ASIDE_MAX - _SERVING.aside)
    # Woken when the run ends, not looking every so often: each look would take the
    # interpreter lock from the call being served (after a switch interval), two thread
    # switches a look, which on a GPU host doubled the eager p99 while a load imported.
    while _SERVING.calls and _SERVING.run == run:
        left = allowed - (clock() - began)
        if left <= 0:
            break
        _SERVING.idle.wait(left)
    waited = clock() - began
    _SERVING.aside += waited
    _SERVING.window_aside += waited


def _on_call(frame: Any, event: str, arg: Any, _serving: _Serving = _SERVING) -> None:
    """The trace function of an attached thread (it traces nothing: None for each call).
    What it reads is bound here: as the interpreter exits, a daemon thread still attached
    runs on while the module's names are cleared."""
    if _serving.calls:
        _stand_aside()
    return None


class _Monitoring:
    """Python 3.12's way: the attached threads, and the ``sys.monitoring`` tool whose
    function-start callback stands them aside, registered while any is attached."""

    TOOL_IDS = (4, 3)  # the ids sys.monitoring leaves free of named uses

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.threads: dict[int, int] = {}  # thread ident -> how many attachments
        self.tool: int | None = None

    def attach(self) -> bool:
        monitoring = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
        ident = threading.get_ident()
        with self.lock:
            if self.tool is None:
                for tool in self.TOOL_IDS:
                    if monitoring.get_tool(tool) is None:
                        monitoring.use_tool_id(tool, "aiocompile")
                        monitoring.register_callback(tool, monitoring.events.PY_START, self.on_start)
                        monitoring.set_events(tool, monitoring.events.PY_START)
                        self.tool = tool
                        break
                else:
                    return False  # every free id taken by someone else: no standing aside
            self.threads[ident] = self.threads.get(ident, 0) + 1
        return True

    def detach(self) -> None:
        monitoring = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
        ident = threading.get_ident()
        with self.lock:
            left = self.threads.pop(ident) - 1
            if left:
                self.threads[ident] = left
            if not self.threads and self.tool is not None:
                monitoring.set_events(self.tool, 0)
                monitoring.register_callback(self.tool, monitoring.events.PY_START, None)
                monitoring.free_tool_id(self.tool)
                self.tool = None

    def on_start(self, code: Any, offset: int, _serving: _Serving = _SERVING,
                 _ident: Callable[[], int] = threading.get_ident) -> None:
        # Never sys.monitoring.DISABLE: that would turn the event off for every thread.
        # What it reads is bound here: the callback stays registered while a thread is
        # attached, and as the interpreter exits (a daemon thread still attached) it runs
        # while the module's names are cleared ("'NoneType' object has no attribute
        # 'calls'", printed at exit for each Python call made then).
        if _serving.calls and _ident() in self.threads:
            _stand_aside()


_MONITORING = _Monitoring() if sys.version_info[:2] == (3, 12) else None


def before_holding() -> None:
    """This thread is about to make a C call that holds the interpreter lock for
    milliseconds (unmarshalling a module's bytecode) right after one that let it go (the
    file's read): an attached thread stands aside first while a call is being served.
    Otherwise it would find out only at its next Python call, after the C call, and a call
    begun during the read would wait for all of it."""
    if not _SERVING.calls:
        return
    if attached():
        _stand_aside()


def attached() -> bool:
    """Whether this thread stands aside while a call is being served (:func:`attach`)."""
    if _MONITORING is not None:
        return threading.get_ident() in _MONITORING.threads
    return sys.gettrace() is _on_call


def attach() -> bool:
    """This thread stands aside while a call is being served, until :func:`detach` (given
    what this returned); False where it cannot (another trace function of this thread's,
    such as a debugger's or coverage's, or no free monitoring tool id)."""
    if _MONITORING is not None:
        if not _MONITORING.attach():
            return False
    elif sys.gettrace() is not None:
        return False
    else:
        sys.settrace(_on_call)
    with _SERVING.lock:
        _SERVING.attached += 1
    return True


def detach(attached: bool) -> None:
    if not attached:
        return
    if _MONITORING is not None:
        _MONITORING.detach()
    elif sys.gettrace() is _on_call:
        sys.settrace(None)
    with _SERVING.lock:
        _SERVING.attached -= 1
