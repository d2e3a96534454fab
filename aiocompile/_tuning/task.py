"""What a benchmark process is asked to time: plain data, sent over its pipe.

The messages (pickled tuples over a ``multiprocessing.connection.Connection``)::

    parent -> process   ("init", sys_path, timer, device)      first, once
    process -> parent   ("ready", pid, device_name, startup)  or  ("start_failed", reason)
                          startup: where the start went (wall-clock times, seconds)
    parent -> process   ("inputs", session, Inputs)            a tuning's tensors
    process -> parent   ("inputs_ok", session)  or  ("inputs_failed", session, reason)
    parent -> process   ("bench", task_id, session, BenchTask or CallTask)
    process -> parent   ("result", task_id, status, timings, reason[, phases])
                          phases (when a BenchTask is "ok"): seconds spent loading and timing it
                          status: "ok" (timings: Triton's (median, p20, p80) in ms),
                          "error" (the configuration failed, the process goes on),
                          "fault" (the device is no longer usable: the process exits
                          after this answer), "need_inputs" (the session's tensors were
                          dropped: send them again)
    parent -> process   ("drop", session)                      the tuning is over
    parent -> process   ("stop",)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiocompile._tuning.inputs import ArgRef


@dataclass(frozen=True)
class Hooks:
    """What runs around each timed launch, as the autotuner has it."""

    reset_to_zero: tuple[str, ...] = ()
    restore_value: tuple[str, ...] = ()
    pre_hook: bytes | None = None
    """A pickled user pre-hook (which then replaces the resetting and restoring)."""
    post_hook: bytes | None = None
    timing: tuple[Any, ...] = ("default",)
    """How to time: ``("default",)`` (the driver's benchmarker, as the autotuner uses it),
    ``("do_bench", warmup, rep)``, ``("cudagraph", rep)`` or ``("custom", pickled)``."""


@dataclass(frozen=True)
class BenchTask:
    """One configuration to time."""

    name: str
    """The kernel's."""
    label: str
    """The configuration, as a person reads it."""
    config: dict[str, Any]
    """Its keywords and options (``Config.all_kwargs()``)."""
    kernel: bytes
    """Its compiled binary: ``TritonKernel.to_bytes()``."""
    grid: tuple[int, int, int]
    args: tuple[ArgRef, ...]
    """The launch's arguments, every parameter in order."""
    hook_args: tuple[tuple[str, ArgRef], ...]
    """What the hooks are given, by name."""
    hooks: Hooks
    config_pre_hook: bytes | None = None
    screen: tuple[float, float] | None = None
    """A short timing, ``(warm-up ms, repetition ms)`` for ``triton.testing.do_bench``,
    that only ranks configurations (see ``_rounds``); None: timed as the autotuner times."""


@dataclass(frozen=True)
class CallTask:
    """A timing the process does not make with its timer: ``function`` (``module:name``,
    imported there) is called with ``payload`` and returns its timings in milliseconds.
    Inductor's benchmark requests come this way: each times itself. The payload stays
    bytes until the call, so that a request that cannot be rebuilt there fails as its own
    error, not as the process's."""

    name: str
    label: str
    function: str
    payload: bytes
