"""The scheduler's configuration: one immutable object, built from arguments.

Environment variables are read here and nowhere else (``SchedulerConfig.from_env``), and
only for the default scheduler; a ``Scheduler(...)`` made by hand takes its arguments.
Every field is checked when a configuration is made, by the rule ``SETTINGS`` gives it
(see ``aiocompile._base.checks``): a duration is a finite number of seconds, at most
``MAX_SECONDS`` (about 11.6 days), and ``None`` stands for "no limit" where there may be
none.

Each setting, its default and its variable (``AIOCOMPILE_WORKERS``, ``AIOCOMPILE_TIMEOUT``,
...) are listed where the code declares them (``SETTINGS``, the fields below) and in
docs/api.md ("Configuration").
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from aiocompile._base import checks, paths

_MAX_DEFAULT_WORKERS = 16
# The default bound of one entry of a cache directory (``cache_dir_entry_bytes``), also
# for the directories of autotuning decisions.
CACHE_DIR_ENTRY_BYTES = 256 * 1024 * 1024
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


def default_repro_dir() -> str:
    """``aiocompile/repro`` in the user's cache directory (``$XDG_CACHE_HOME``, else
    ``~/.cache``)."""
    return paths.user_cache("repro")


@dataclass(frozen=True)
class SchedulerConfig:
    """How a :class:`~aiocompile.Scheduler` behaves. Frozen: make a new one to change it."""

    workers: int = field(default_factory=default_workers)
    """Worker processes at most; started on demand, or all at once by ``warm()``."""
    timeout: float | None = None
    """Default per-job timeout in seconds, counted from when a worker starts the job."""
    max_crashes: int = 2
    """A job that kills this many workers fails with ``WorkerCrashed``."""
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
    cache_dir_entry_bytes: int = CACHE_DIR_ENTRY_BYTES
    """The largest entry kept in ``cache_dir`` (and no larger than ``cache_dir_bytes``): a
    larger result is not written, and a larger file found there is not read (a miss,
    counted in ``disk_refused``), so that a file planted there costs no memory."""
    cache_key: bytes | str | None = field(default=None, repr=False)
    """A secret (bytes, or text taken as UTF-8) that signs every entry written to
    ``cache_dir`` (HMAC-SHA256); with it, an entry not signed with it is never loaded, and
    a directory owned by another user may be read for its signed entries. Never shown in
    ``repr``. None: entries are unsigned, and only a directory that no other user can
    write is used."""
    cache_url: str | None = field(default=None, repr=False)
    """A shared cache for a fleet, on a Redis server (``redis://host:6379/0``,
    ``rediss://`` for TLS, ``unix:///path``): read after the memory cache and
    ``cache_dir`` miss, before compiling; written after a compile. Entries are sealed
    with ``cache_key`` when it is set (and then only sealed ones are loaded). A server
    that is down or slow costs a short timeout and is then left alone for
    ``cache_url_retry`` seconds; it never fails a compile. Not in ``repr`` (a URL may
    carry a password). Needs the ``redis`` package."""
    cache_url_ttl: float | None = 7 * 24 * 3600.0
    """Seconds a shared entry lives after it was last written or read (None: until the
    server's own memory bound drops it)."""
    cache_url_entry_bytes: int | None = 64 * 1024 * 1024
    """The largest entry written to the shared cache (None: no bound)."""
    cache_url_timeout: float = 0.25
    """Seconds each call to the shared cache may take, connecting included."""
    cache_url_retry: float = 5.0
    """Seconds the shared cache is left alone after several calls in a row failed (then
    one call tries it again)."""
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
    worker_idle: bool = False
    """Run workers (and their fork server, and the compilers they start) under Linux's
    ``SCHED_IDLE`` policy: they get the CPU time the machine's other work leaves, and a
    thread of this process that wakes takes a CPU from them at once. For compiles nobody
    waits on (``compile_in_background``'s for a model on the CPU, whose schedulers turn it
    on); a machine that is always busy leaves them almost nothing. Ignored where the policy
    does not exist."""
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
    repro_dir: str | None = field(default_factory=default_repro_dir)
    """Where a repro bundle (see ``aiocompile._observe.repro``) is written for each failed compile
    of ``torch.compile`` under ``aiocompile.torch.install()`` and of
    ``aiocompile.torch.compile_in_background``: a directory per failure, named by the
    error. None writes none."""
    repro_keep: int = 50
    """Bundles kept in ``repro_dir``; the oldest go first."""
    repro_dir_bytes: int | None = 1024 * 1024 * 1024
    """Bound of ``repro_dir`` in bytes; the oldest bundles go first (the newest is always
    kept). None: no bound but ``repro_keep``."""

    benchmark_timeout: float | None = 60.0
    """Seconds a benchmark process may spend on one configuration (``autotune()``) before
    it is killed and the configuration counts as hung (None: no limit)."""
    tuning_devices: tuple[int, ...] | None = None
    """The devices ``autotune()`` benchmarks on, one process each; None: every visible
    device."""
    tuning_screen: float | None = 1.25
    """How ``autotune()`` spends the GPU's time. Each configuration is first timed
    briefly, as soon as it has compiled (Triton's ``do_bench`` with a fifth of the
    autotuner's warm-up and repetition times); those within this factor of the fastest
    are then timed as the autotuner times them, in its order, and the fastest of those
    wins. The others are left out, with their short timing and why. None: every
    configuration is timed in full, as Triton does (also the case with a ``do_bench``
    of the kernel's own, CUDA graphs, or fewer than four configurations)."""
    benchmark_at_start: bool = False
    """Start the benchmark processes ``autotune()`` times configurations in when the
    scheduler starts (``async with``, or the default scheduler's first use) rather than
    at the first tuning, so that a process's start (torch, Triton, the device's context:
    seconds) overlaps the program's own start-up instead of the first tuning; this
    process's own first costs of a tuning (hashing Triton, Triton's GPU driver) are paid
    then too, in the background. Each one
    holds a CUDA context on its device (a few hundred MiB) whether anything is tuned or
    not, so it is off unless asked for. On a machine without a GPU it starts nothing."""

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


SETTINGS: dict[str, checks.Rule] = {
    "workers": checks.WORKERS,
    "timeout": checks.JOB_TIMEOUT,
    "max_crashes": checks.CRASHES,
    "start_method": checks.START_METHOD,
    "preload": checks.PRELOAD,
    "cache_entries": checks.Number(integer=True, at_least=0),
    "cache_bytes": checks.Number(integer=True, at_least=0, unit="bytes", none="no bound but cache_entries"),
    "error_ttl": checks.Number(at_least=0, at_most=checks.MAX_SECONDS, unit="seconds"),
    "cache_dir": checks.FilePath(none="no disk cache"),
    "cache_dir_bytes": checks.Number(integer=True, above=0, unit="bytes", none="no bound"),
    "cache_dir_entry_bytes": checks.Number(integer=True, above=0, unit="bytes"),
    "cache_key": checks.Secret(none="no signing"),
    "cache_url": checks.Url(("redis", "rediss", "unix"), none="no shared cache"),
    "cache_url_ttl": checks.Number(above=0, at_most=checks.MAX_SECONDS * 100, unit="seconds",
                                    none="no expiry"),
    "cache_url_entry_bytes": checks.Number(integer=True, above=0, unit="bytes", none="no bound"),
    "cache_url_timeout": checks.Number(above=0, at_most=60, unit="seconds"),
    "cache_url_retry": checks.Number(above=0, at_most=checks.MAX_SECONDS, unit="seconds"),
    "close_grace": checks.Number(at_least=0, at_most=checks.MAX_SECONDS, unit="seconds"),
    "cancel_running": checks.Choice(("keep", "kill")),
    "max_worker_rss": checks.RSS,
    "idle_timeout": checks.IDLE_TIMEOUT,
    "worker_nice": checks.NICE,
    "worker_idle": checks.Flag(),
    "metrics": checks.Flag(),
    "event_log": checks.FilePath(none="no event log"),
    "cost_history": checks.FilePath(none="costs.json in cache_dir, or memory only"),
    "benchmark_timeout": checks.BENCHMARK_TIMEOUT,
    "tuning_devices": checks.Devices(none="every visible device"),
    "tuning_screen": checks.SwitchableNumber(at_least=1, at_most=100, none="every configuration timed in full"),
    "benchmark_at_start": checks.Flag(),
    "repro_dir": checks.SwitchablePath(none="no repro bundles"),
    "repro_keep": checks.Number(integer=True, at_least=1),
    "repro_dir_bytes": checks.Number(integer=True, above=0, unit="bytes", none="no bound but repro_keep"),
}
"""The rule each ``SchedulerConfig`` field is checked by (see ``aiocompile._base.checks``)."""

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
    ("AIOCOMPILE_CACHE_DIR_ENTRY_BYTES", "cache_dir_entry_bytes"),
    ("AIOCOMPILE_CACHE_KEY", "cache_key"),  # stripped: a secret read from a file often ends in a newline
    ("AIOCOMPILE_CACHE_URL", "cache_url"),
    ("AIOCOMPILE_CACHE_URL_TTL", "cache_url_ttl"),
    ("AIOCOMPILE_CACHE_URL_ENTRY_BYTES", "cache_url_entry_bytes"),
    ("AIOCOMPILE_CACHE_URL_TIMEOUT", "cache_url_timeout"),
    ("AIOCOMPILE_CACHE_URL_RETRY", "cache_url_retry"),
    ("AIOCOMPILE_EVENT_LOG", "event_log"),
    ("AIOCOMPILE_COST_HISTORY", "cost_history"),
    ("AIOCOMPILE_METRICS", "metrics"),
    ("AIOCOMPILE_WORKER_NICE", "worker_nice"),
    ("AIOCOMPILE_WORKER_IDLE", "worker_idle"),
    ("AIOCOMPILE_BENCHMARK_TIMEOUT", "benchmark_timeout"),
    ("AIOCOMPILE_TUNING_DEVICES", "tuning_devices"),
    ("AIOCOMPILE_TUNING_SCREEN", "tuning_screen"),
    ("AIOCOMPILE_BENCHMARK_AT_START", "benchmark_at_start"),
    ("AIOCOMPILE_REPRO_DIR", "repro_dir"),
    ("AIOCOMPILE_REPRO_KEEP", "repro_keep"),
    ("AIOCOMPILE_REPRO_DIR_BYTES", "repro_dir_bytes"),
)
"""Each environment variable ``from_env`` reads, and the field it sets."""
