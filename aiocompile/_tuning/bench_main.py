"""What runs inside a benchmark process: one device, one configuration at a time.

The process is started by the parent (``benchproc``) with its socket and the read end of
an "alive" pipe; it dies with the parent (``_pool.procs.die_with_parent``). It owns one device
(the parent narrows ``CUDA_VISIBLE_DEVICES`` to it), loads each binary the compile pool
produced, and times it with a *timer*: an object made by the ``module:name`` the parent
names, with

- ``open(device) -> str``: take the device, return its name;
- ``load_inputs(inputs) -> handle``: build a tuning's tensors there;
- ``time(task, handle) -> (median, p20, p80)``: time one configuration, in milliseconds;
- ``healthy() -> bool``: whether the device still works after a configuration failed.

The real timer is ``gpu_timer.TritonTimer``; tests name a stand-in. A ``CallTask`` is
timed by the function it names instead (it has the device to itself all the same).

A configuration that raises is an error, answered, and the process goes on; one after
which the device no longer works (an illegal address poisons a CUDA context for good) is a
fault: answered, then the process exits, and the parent starts another.
"""

from __future__ import annotations

import collections
import importlib
import os
import queue
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from aiocompile._tuning.inputs import SharedInputs
from aiocompile._tuning.task import (
    Bench,
    CallTask,
    Drop,
    Init,
    InputsFailed,
    InputsLoaded,
    LoadInputs,
    Ready,
    Result,
    StartFailed,
    Status,
    Stop,
    ToProcess,
)

# A tuning's tensors are kept for the next few configurations; older ones are dropped
# (the parent sends them again if asked: ``Status.NEED_INPUTS``).
_SESSIONS_KEPT = 2


def _import(entry: str) -> Any:
    module, _, name = entry.partition(":")
    value: Any = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    name = type(exc).__name__
    return text if text.startswith(name) else f"{name}: {text}"


def serve(conn: Connection, began: float | None = None) -> NoReturn:
    init = conn.recv()
    assert isinstance(init, Init)
    for path in reversed(init.sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    # Messages are read as they come, by a thread of their own: a tuning's tensors may be
    # sent while this process is still starting (importing torch takes seconds), and are
    # then here, unpickled, when it is ready.
    inbox: queue.Queue[ToProcess | None] = queue.Queue()

    def pump() -> None:
        while True:
            try:
                received = conn.recv()
            except (EOFError, OSError):
                inbox.put(None)
                return
            inbox.put(received)

    threading.Thread(target=pump, name="aiocompile-bench-inbox", daemon=True).start()
    opening = time.time()
    try:
        timer = _import(init.timer)()
        name = timer.open(init.device)
    except BaseException as exc:
        conn.send(StartFailed(f"{_reason(exc)}\n{traceback.format_exc()}"))
        os._exit(3)
    # Where the start went (wall-clock times, and the timer's own steps), for profiles.
    startup = {"began_at": began, "opening_at": opening, "ready_at": time.time(),
               **dict(getattr(timer, "startup", None) or {})}
    conn.send(Ready(os.getpid(), str(name), startup))
    sessions: collections.OrderedDict[int, Any] = collections.OrderedDict()
    while True:
        message = inbox.get()
        if message is None:  # the parent closed its end
            os._exit(0)
        if isinstance(message, Stop):
            os._exit(0)
        if isinstance(message, Drop):
            sessions.pop(message.session, None)
            continue
        if isinstance(message, LoadInputs):
            session = message.session
            try:
                inputs = message.inputs
                if isinstance(inputs, SharedInputs):
                    inputs = inputs.open()
                sessions[session] = timer.load_inputs(inputs)
            except BaseException as exc:
                conn.send(InputsFailed(session, _reason(exc)))
                _exit_if_broken(timer, conn)
                continue
            while len(sessions) > _SESSIONS_KEPT:
                sessions.popitem(last=False)
            conn.send(InputsLoaded(session))
            continue
        if isinstance(message, Bench):
            task_id, session, task = message.task_id, message.session, message.task
            if session not in sessions:
                conn.send(Result(task_id, Status.NEED_INPUTS))
                continue
            sessions.move_to_end(session)
            took = time.perf_counter()
            try:
                if isinstance(task, CallTask):
                    timings = _import(task.function)(task.payload)
                else:
                    timings = timer.time(task, sessions[session])
            except BaseException as exc:
                reason = _reason(exc)
                if _healthy(timer):
                    conn.send(Result(task_id, Status.ERROR, reason=reason))
                    continue
                conn.send(Result(task_id, Status.FAULT, reason=reason))
                os._exit(4)
            phases = {"seconds": time.perf_counter() - took}
            if not isinstance(task, CallTask):  # the timer's phases are those of its own last task
                phases.update(dict(getattr(timer, "last_phases", None) or {}))
            conn.send(Result(task_id, Status.OK, tuple(float(t) for t in timings), None, phases))


def _healthy(timer: Any) -> bool:
    try:
        return bool(timer.healthy())
    except BaseException:
        return False


def _exit_if_broken(timer: Any, conn: Connection) -> None:
    if not _healthy(timer):
        conn.close()
        os._exit(4)


def prepare_process() -> None:
    """Before anything is imported: the imports of a benchmark process (torch, Inductor,
    Triton: seconds of them) read aiocompile's bytecode where the installation has none,
    as the compile workers' do, rather than compiling every module's source again."""
    from aiocompile._base import bytecode

    bytecode.install_for_process()


def main() -> NoReturn:  # pragma: no cover - runs in a fresh interpreter
    prepare_process()
    from aiocompile._pool.procs import die_with_parent

    began = time.time()
    sock_fd, alive_fd = int(sys.argv[1]), int(sys.argv[2])
    die_with_parent(alive_fd)
    serve(Connection(sock_fd), began)
