"""The one ``install()`` there can be: which scheduler Inductor's compiles go to, and what
was patched to send them there. Patching a library is process-wide by nature, so this is
the one piece of process-wide state of the torch integration (``STATE``)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from aiocompile._base.bytecode import PackageImports
    from aiocompile._core.scheduler import Scheduler
    from aiocompile._torch.autotune import Patch


@dataclass(eq=False)
class Installation:
    """One ``install()``: where compiles go and what was patched."""

    scheduler: Scheduler
    owned: bool
    """The scheduler was made by ``install()``, and ``uninstall()`` closes it."""
    remake: Callable[[], Scheduler]
    """Makes a scheduler like the one ``install()`` made, for a forked child."""
    timeout: float | None
    warm: bool
    target: type
    originals: dict[str, tuple[bool, Any]] = field(default_factory=dict)
    """Attribute name -> (whether it was the class's own, the raw value there)."""
    warmed: bool = False
    warming: list[cf.Future[Any]] = field(default_factory=list)
    """The workers' warm-ups the first ``warm_pool()`` started (see ``workers_ready``)."""
    pid: int = field(default_factory=os.getpid)
    graph_hook: Any = None
    """What ``graph_repro.patch`` replaced (Inductor's debug wrapper), for uninstall()."""
    tuning: Patch | None = None
    """What ``autotune.patch`` replaced (Inductor's tuning pool), for uninstall()."""
    imports: PackageImports | None = None
    """The finder through which Inductor's modules imported here read aiocompile's bytecode."""

    def current_scheduler(self) -> Scheduler:
        """The scheduler; in a forked child, a scheduler ``install()`` made is made anew
        there (the parent's pool is the parent's), one you gave raises ``SchedulerClosed``
        when used, as it does anywhere."""
        if self.owned and self.pid != os.getpid():
            with STATE.lock:
                if self.pid != os.getpid():
                    self.scheduler = self.remake()
                    self.pid = os.getpid()
                    self.warmed = False
        return self.scheduler

    def workers_ready(self) -> bool:
        """Whether a worker has finished its warm-up, or none was started here (workers
        readied before, or started by the first compile). Until then Inductor is told its
        pool is not ready, and does what it does then: template choices precompiled in
        its threads, rather than waiting in the queue for the first worker."""
        warming = self.warming
        return not warming or any(done.done() and done.exception() is None for done in warming)

    def original(self, name: str) -> Any:
        own, raw = self.originals[name]
        if own:
            return raw.__get__(None, self.target)
        return getattr(super(self.target, self.target), name)


class _State:
    """The installation, if any, and the lock that guards installing and uninstalling."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: Installation | None = None


STATE = _State()
