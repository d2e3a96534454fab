"""The scheduler's configuration: one immutable object, built from arguments.

Environment variables are read here and nowhere else (``SchedulerConfig.from_env``), and
only for the default scheduler; a ``Scheduler(...)`` made by hand takes its arguments.

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

_MAX_DEFAULT_WORKERS = 16
TRITON_PRELOAD = "aiocompile.backends._triton_worker:prepare_process"


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
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise ValueError(f"workers must be a positive integer, got {self.workers!r}")
        if self.timeout is not None and not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {self.timeout!r}")
        if not isinstance(self.max_crashes, int) or self.max_crashes < 1:
            raise ValueError(f"max_crashes must be at least 1, got {self.max_crashes!r}")
        if self.start_method not in (None, "forkserver", "spawn", "fork"):
            raise ValueError(f"start_method must be 'forkserver', 'spawn', 'fork' or None, got {self.start_method!r}")
        if self.cache_entries < 0:
            raise ValueError(f"cache_entries must be >= 0, got {self.cache_entries!r}")
        if self.close_grace < 0:
            raise ValueError(f"close_grace must be >= 0, got {self.close_grace!r}")
        if self.cancel_running not in ("keep", "kill"):
            raise ValueError(f"cancel_running must be 'keep' or 'kill', got {self.cancel_running!r}")
        if self.max_worker_rss is not None and self.max_worker_rss <= 0:
            raise ValueError(f"max_worker_rss must be a positive number of bytes, got {self.max_worker_rss!r}")
        if self.idle_timeout is not None and self.idle_timeout <= 0:
            raise ValueError(f"idle_timeout must be a positive number of seconds, got {self.idle_timeout!r}")
        if self.cache_bytes is not None and self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {self.cache_bytes!r}")
        if self.error_ttl < 0:
            raise ValueError(f"error_ttl must be >= 0, got {self.error_ttl!r}")
        if not isinstance(self.worker_nice, int) or not 0 <= self.worker_nice <= 19:
            raise ValueError(f"worker_nice must be an integer from 0 to 19, got {self.worker_nice!r}")
        if not isinstance(self.metrics, bool):
            raise ValueError(f"metrics must be True or False, got {self.metrics!r}")
        if self.cache_dir_bytes is not None and self.cache_dir_bytes <= 0:
            raise ValueError(f"cache_dir_bytes must be positive, got {self.cache_dir_bytes!r}")
        if self.cache_key is not None and (not isinstance(self.cache_key, (bytes, str)) or not self.cache_key):
            # The value itself stays out of the message: it is a secret.
            raise ValueError(f"cache_key must be non-empty bytes or str, got a {type(self.cache_key).__name__}")

    def with_changes(self, **changes: Any) -> SchedulerConfig:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> SchedulerConfig:
        """The configuration the environment asks for (see the module docstring)."""
        changes: dict[str, Any] = {}

        def number(name: str, kind: type) -> Any:
            text = environ.get(name, "").strip()
            if not text:
                return None
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{name}={text!r} is not a valid {kind.__name__}") from None

        changes["workers"] = number("AIOCOMPILE_WORKERS", int)
        changes["timeout"] = number("AIOCOMPILE_TIMEOUT", float)
        changes["max_crashes"] = number("AIOCOMPILE_MAX_CRASHES", int)
        changes["start_method"] = environ.get("AIOCOMPILE_START_METHOD", "").strip() or None
        changes["cancel_running"] = environ.get("AIOCOMPILE_CANCEL_RUNNING", "").strip() or None
        changes["max_worker_rss"] = number("AIOCOMPILE_MAX_WORKER_RSS", int)
        changes["idle_timeout"] = number("AIOCOMPILE_IDLE_TIMEOUT", float)
        changes["cache_dir"] = environ.get("AIOCOMPILE_CACHE_DIR", "").strip() or None
        changes["cache_dir_bytes"] = number("AIOCOMPILE_CACHE_DIR_BYTES", int)
        # Stripped like every other value: a secret read from a file often ends in a newline.
        changes["cache_key"] = environ.get("AIOCOMPILE_CACHE_KEY", "").strip() or None
        changes["event_log"] = environ.get("AIOCOMPILE_EVENT_LOG", "").strip() or None
        changes["cost_history"] = environ.get("AIOCOMPILE_COST_HISTORY", "").strip() or None
        changes["worker_nice"] = number("AIOCOMPILE_WORKER_NICE", int)
        metrics = environ.get("AIOCOMPILE_METRICS", "").strip().lower()
        if metrics:
            if metrics not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(f"AIOCOMPILE_METRICS={metrics!r} is not 0 or 1")
            changes["metrics"] = metrics in ("1", "true", "yes", "on")
        return cls().with_changes(**changes)
