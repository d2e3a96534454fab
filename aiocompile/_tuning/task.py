"""What a benchmark process is asked to time, and every message between it and the parent:
plain data, each message one small frozen dataclass pickled over a
``multiprocessing.connection.Connection``::

    parent -> process   Init(sys_path, timer, device)            first, once
    process -> parent   Ready(pid, device_name, startup)  or  StartFailed(reason)
                          startup: where the start went (wall-clock times, seconds)
    parent -> process   LoadInputs(session, inputs)              a tuning's tensors
    process -> parent   InputsLoaded(session)  or  InputsFailed(session, reason)
    parent -> process   Bench(task_id, session, BenchTask or CallTask)
    process -> parent   Result(task_id, status, timings, reason, phases)
                          status (``Status``): OK (timings: Triton's (median, p20, p80) in
                          ms; phases, for a BenchTask: seconds spent loading and timing it),
                          ERROR (the configuration failed, the process goes on), FAULT
                          (the device is no longer usable: the process exits after this
                          answer), NEED_INPUTS (the session's tensors were dropped: send
                          them again)
    parent -> process   Drop(session)                            the tuning is over
    parent -> process   Stop()

``ToProcess`` and ``FromProcess`` name the two directions. The process imports this module
to unpickle them, so it imports nothing heavier than ``inputs``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from aiocompile._tuning.inputs import ArgRef, Inputs, SharedInputs


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
    that only ranks configurations (see ``rounds``); None: timed as the autotuner times."""


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


# -- parent -> process ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Init:
    """The first message, once: where to import from, the timer to make (``module:name``)
    and the device to open."""

    sys_path: tuple[str, ...]
    timer: str
    device: int


@dataclass(frozen=True)
class LoadInputs:
    """A tuning's tensors, to be built on the device and kept for its configurations."""

    session: int
    inputs: Inputs | SharedInputs


@dataclass(frozen=True)
class Bench:
    """Time one configuration on ``session``'s tensors."""

    task_id: int
    session: int
    task: BenchTask | CallTask


@dataclass(frozen=True)
class Drop:
    """The tuning is over: its tensors may go."""

    session: int


@dataclass(frozen=True)
class Stop:
    """Exit now."""


# -- process -> parent ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The process has opened its device and takes work."""

    pid: int
    device_name: str
    startup: dict[str, Any] = field(default_factory=dict)
    """Where the start went: wall-clock times (``began_at``, ``opening_at``, ``ready_at``)
    and the timer's own steps, for profiles."""


@dataclass(frozen=True)
class StartFailed:
    """The timer could not be made or could not open the device; the process exits."""

    reason: str


@dataclass(frozen=True)
class InputsLoaded:
    session: int


@dataclass(frozen=True)
class InputsFailed:
    """The tensors could not be built there (the process goes on, unless its device is
    no longer usable)."""

    session: int
    reason: str


class Status(enum.Enum):
    """How a configuration went, as the process answers it."""

    OK = "ok"
    ERROR = "error"
    FAULT = "fault"
    NEED_INPUTS = "need_inputs"
    """Not an outcome: the session's tensors are no longer there, the parent sends them
    again and the configuration after them."""


@dataclass(frozen=True)
class Result:
    """The answer to one ``Bench``."""

    task_id: int
    status: Status
    timings: tuple[float, ...] | None = None
    """In milliseconds, when OK."""
    reason: str | None = None
    """Why not, when ERROR or FAULT."""
    phases: dict[str, float] | None = None
    """Where the process's time went (``seconds`` in all, the timer's ``load_s``,
    ``bench_s``), when OK."""


ToProcess = Init | LoadInputs | Bench | Drop | Stop
FromProcess = Ready | StartFailed | InputsLoaded | InputsFailed | Result
