"""The scheduler's configuration: one immutable object, built from arguments.

Environment variables are read here and nowhere else (``SchedulerConfig.from_env``), and
only for the default scheduler; a ``Scheduler(...)`` made by hand takes its arguments.
Every field is checked when a configuration is made, by the rule ``SETTINGS`` gives it
(see ``aiocompile._checks``): a duration is a finite number of seconds, at most
``MAX_SECONDS`` (about 11.6 days), and ``None`` stands for "no limit" where there may be
none.

=========================  ============================================================
AIOCOMPILE_WORKERS         worker processes (default: the CPUs this process may use, at
                           most 16)
AIOCOMPILE_TIMEOUT         default per-job timeout in seconds (default: none)
AIOCOMPILE_MAX_CRASHES     crashes after which a job fails (default: 2)
AIOCOMPILE_START_METHOD    forkserver, spawn or fork (default: forkserver on Linux)
AIOCOMPILE_CANCEL_RUNNING  keep or kill: what cancelling the last waiter of a running
                           job does (default: keep)
AIOCOMPILE_MAX_WORKER_RSS  bytes of resident memory after which a worker is replaced
                           (default: no limit)
AIOCOMPILE_IDLE_TIMEOUT    seconds after which an idle worker is stopped (default: never)
AIOCOMPILE_CACHE_DIR       directory of the disk cache shared by processes (default: none)
AIOCOMPILE_CACHE_DIR_BYTES bound of that directory in bytes (default: 4 GiB)
AIOCOMPILE_CACHE_KEY       secret that signs the directory's entries: only entries
                           signed with it are loaded (default: none: entries unsigned,
                           the directory used only if no other user can write it)
AIOCOMPILE_EVENT_LOG       JSON-lines file every record and worker event is appended to
                           (default: none)
AIOCOMPILE_COST_HISTORY    JSON file of compile times, for starting a batch's longest
                           compiles first (default: costs.json in the cache directory if
                           there is one, else kept in memory only)
AIOCOMPILE_METRICS         0 keeps only the counters: no records, summaries or events
                           (default: 1)
AIOCOMPILE_WORKER_NICE     how much nicer than this process workers run (default: 10)
=========================  ============================================================
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from aiocompile import _checks

_MAX_DEFAULT_WORKERS = 16
TRITON_PRELOAD = "aiocompile.backends.triton._worker:prepare_process"


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, count)


def default_workers() -> int:
    return min(available_cpus(), _MAX_DEFAULT_WORKERS)


@dataclass(frozen=True)
class SchedulerConfig:
    """How a :class:`~aiocompile.Scheduler` behaves. Frozen: make a new one to change it."""

    workers: int = field(default_factory=default_workers)
    """Worker processes at most; started on demand, or all at once by ``warm()``."""
    timeout: float | None = None
    """Default per-job timeout in seconds, counted from when a worker starts the job."""
    max_crashes: int = 2
    """A job that kills this many workers fails with ``WorkerCrashedError``."""
    start_method: str | None = None
    """'forkserver', 'spawn' or 'fork'; None picks forkserver where it works."""
    preload: tuple[str, ...] = (TRITON_PRELOAD,)
    """Modules (``module`` or ``module:function``) the fork server loads before forking."""
    cache_entries: int = 4096
    """Compiled results kept in memory, least recently used dropped first."""
    cache_bytes: int | None = 512 * 1024 * 1024
    """Bytes of compiled results kept in memory (None: no bound but ``cache_entries``)."""
    error_ttl: float = 2.0
    """Seconds a compile error is remembered, so that the same bad request fails at once
    without a worker (0: never remembered). Crashes and timeouts are never remembered."""
    cache_dir: str | None = None
    """A directory where compiled results are kept across processes and restarts."""
    cache_dir_bytes: int | None = 4 * 1024 * 1024 * 1024
    """Bound of ``cache_dir``; least recently used files go first."""
    cache_key: bytes | str | None = field(default=None, repr=False)
    """A secret (bytes, or text taken as UTF-8) that signs every entry written to
    ``cache_dir`` (HMAC-SHA256); with it, an entry not signed with it is never loaded, and
    a directory owned by another user may be read for its signed entries. Never shown in
    ``repr``. None: entries are unsigned, and only a directory that no other user can
    write is used."""
    close_grace: float = 5.0
    """Seconds running jobs get to finish in ``aclose()`` before their workers are killed."""
    cancel_running: str = "keep"
    """When the last caller waiting on a running job is cancelled: "keep" lets the job
    finish and keeps its result for the next caller; "kill" kills its worker."""
    max_worker_rss: int | None = None
    """A worker whose resident memory exceeds this many bytes after a job is replaced."""
    idle_timeout: float | None = None
    """Workers idle this many seconds are stopped; new ones start on demand."""
    worker_nice: int = 10
    """How many steps nicer (lower CPU priority) than this process workers run, so that
    compiles on every core leave this process's event loop on time. 0 keeps them equal."""
    metrics: bool = True
    """Keep a timing record per request, duration summaries and worker events, and report
    them (logging, ``event_log``, listeners). False keeps only the counters."""
    event_log: str | None = None
    """A JSON-lines file every record and worker event is appended to."""
    cost_history: str | None = None
    """A JSON file of how long each kernel took to compile, read by later processes so that
    ``compile_many`` starts the longest compiles first. None: ``costs.json`` in
    ``cache_dir`` if there is one and it is trusted (written only if it is writable), else
    the history lasts as long as the scheduler."""

    def __post_init__(self) -> None:
        for name, rule in SETTINGS.items():
            value = getattr(self, name)
            checked = rule.check(name, value)
            if checked is not value:
                # One form for the code behind: a path as str, preload entries as a tuple.
                object.__setattr__(self, name, checked)

    def with_changes(self, **changes: Any) -> SchedulerConfig:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> SchedulerConfig:
        """The configuration the environment asks for (see the module docstring). Raises
        ``ValueError``, naming the variable, for a value it cannot use."""
        changes: dict[str, Any] = {}
        for variable, name in ENVIRONMENT:
            text = environ.get(variable, "").strip()
            if text:
                changes[name] = SETTINGS[name].parse(variable, text)
        return cls(**changes)


def named_in_env(environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The settings the environment chooses (their variables set and not blank), for a
    caller whose own defaults differ from ``SchedulerConfig``'s where the environment is
    silent."""
    return frozenset(name for variable, name in ENVIRONMENT if environ.get(variable, "").strip())


SETTINGS: dict[str, _checks.Rule] = {
    "workers": _checks.WORKERS,
    "timeout": _checks.JOB_TIMEOUT,
    "max_crashes": _checks.CRASHES,
    "start_method": _checks.START_METHOD,
    "preload": _checks.PRELOAD,
    "cache_entries": _checks.Number(integer=True, at_least=0),
    "cache_bytes": _checks.Number(integer=True, at_least=0, unit="bytes", none="no bound but cache_entries"),
    "error_ttl": _checks.Number(at_least=0, at_most=_checks.MAX_SECONDS, unit="seconds"),
    "cache_dir": _checks.FilePath(none="no disk cache"),
    "cache_dir_bytes": _checks.Number(integer=True, above=0, unit="bytes", none="no bound"),
    "cache_key": _checks.Secret(none="no signing"),
    "close_grace": _checks.Number(at_least=0, at_most=_checks.MAX_SECONDS, unit="seconds"),
    "cancel_running": _checks.Choice(("keep", "kill")),
    "max_worker_rss": _checks.RSS,
    "idle_timeout": _checks.IDLE_TIMEOUT,
    "worker_nice": _checks.NICE,
    "metrics": _checks.Flag(),
    "event_log": _checks.FilePath(none="no event log"),
    "cost_history": _checks.FilePath(none="costs.json in cache_dir, or memory only"),
}
"""The rule each ``SchedulerConfig`` field is checked by (see ``aiocompile._checks``)."""

ENVIRONMENT = (
    ("AIOCOMPILE_WORKERS", "workers"),
    ("AIOCOMPILE_TIMEOUT", "timeout"),
    ("AIOCOMPILE_MAX_CRASHES", "max_crashes"),
    ("AIOCOMPILE_START_METHOD", "start_method"),
    ("AIOCOMPILE_CANCEL_RUNNING", "cancel_running"),
    ("AIOCOMPILE_MAX_WORKER_RSS", "max_worker_rss"),
    ("AIOCOMPILE_IDLE_TIMEOUT", "idle_timeout"),
    ("AIOCOMPILE_CACHE_DIR", "cache_dir"),
    ("AIOCOMPILE_CACHE_DIR_BYTES", "cache_dir_bytes"),
    ("AIOCOMPILE_CACHE_KEY", "cache_key"),  # stripped: a secret read from a file often ends in a newline
    ("AIOCOMPILE_EVENT_LOG", "event_log"),
    ("AIOCOMPILE_COST_HISTORY", "cost_history"),
    ("AIOCOMPILE_METRICS", "metrics"),
    ("AIOCOMPILE_WORKER_NICE", "worker_nice"),
)
"""Each environment variable ``from_env`` reads, and the field it sets."""
