"""What runs inside a benchmark process: one device, one configuration at a time.

The process is started by the parent (``_benchproc``) with its socket and the read end of
an "alive" pipe; it dies with the parent (``_worker.die_with_parent``). It owns one device
(the parent narrows ``CUDA_VISIBLE_DEVICES`` to it), loads each binary the compile pool
produced, and times it with a *timer*: an object made by the ``module:name`` the parent
names, with

- ``open(device) -> str``: take the device, return its name;
- ``load_inputs(inputs) -> handle``: build a tuning's tensors there;
- ``time(task, handle) -> (median, p20, p80)``: time one configuration, in milliseconds;
- ``healthy() -> bool``: whether the device still works after a configuration failed.

The real timer is ``_gpu_timer.TritonTimer``; tests name a stand-in. A ``CallTask`` is
timed by the function it names instead (it has the device to itself all the same).

A configuration that raises is an error, answered, and the process goes on; one after
which the device no longer works (an illegal address poisons a CUDA context for good) is a
fault: answered, then the process exits, and the parent starts another.
"""

from __future__ import annotations

import collections
import importlib
import os
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from aiocompile._tuning._task import CallTask

# A tuning's tensors are kept for the next few configurations; older ones are dropped
# (the parent sends them again if asked: "need_inputs").
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


def serve(conn: Connection) -> NoReturn:
    message = conn.recv()
    assert message[0] == "init"
    _, sys_path, entry, device = message
    for path in reversed(sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        timer = _import(entry)()
        name = timer.open(device)
    except BaseException as exc:
        conn.send(("start_failed", f"{_reason(exc)}\n{traceback.format_exc()}"))
        os._exit(3)
    conn.send(("ready", os.getpid(), str(name)))
    sessions: collections.OrderedDict[int, Any] = collections.OrderedDict()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        kind = message[0]
        if kind == "stop":
            os._exit(0)
        if kind == "drop":
            sessions.pop(message[1], None)
            continue
        if kind == "inputs":
            _, session, inputs = message
            try:
                sessions[session] = timer.load_inputs(inputs)
            except BaseException as exc:
                conn.send(("inputs_failed", session, _reason(exc)))
                _exit_if_broken(timer, conn)
                continue
            while len(sessions) > _SESSIONS_KEPT:
                sessions.popitem(last=False)
            conn.send(("inputs_ok", session))
            continue
        if kind == "bench":
            _, task_id, session, task = message
            if session not in sessions:
                conn.send(("result", task_id, "need_inputs", None, None))
                continue
            sessions.move_to_end(session)
            try:
                if isinstance(task, CallTask):
                    timings = _import(task.function)(task.payload)
                else:
                    timings = timer.time(task, sessions[session])
            except BaseException as exc:
                reason = _reason(exc)
                if _healthy(timer):
                    conn.send(("result", task_id, "error", None, reason))
                    continue
                conn.send(("result", task_id, "fault", None, reason))
                os._exit(4)
            conn.send(("result", task_id, "ok", [float(t) for t in timings], None))


def _healthy(timer: Any) -> bool:
    try:
        return bool(timer.healthy())
    except BaseException:
        return False


def _exit_if_broken(timer: Any, conn: Connection) -> None:
    if not _healthy(timer):
        conn.close()
        os._exit(4)


def main() -> NoReturn:  # pragma: no cover - runs in a fresh interpreter
    from aiocompile._worker import die_with_parent

    sock_fd, alive_fd = int(sys.argv[1]), int(sys.argv[2])
    die_with_parent(alive_fd)
    serve(Connection(sock_fd))
