"""What the torch integration asks of a scheduler: a few methods of its engine
(``Scheduler.port``), named here so that nothing of the torch integration reaches into a
scheduler's insides."""

from __future__ import annotations

import concurrent.futures as cf
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from aiocompile._base.config import SchedulerConfig
    from aiocompile._tuning.tuner import Tuner
    from aiocompile.backends import Request
    from aiocompile.records import BenchmarkRecord


class TorchPort(Protocol):
    config: SchedulerConfig

    @property
    def closed(self) -> bool: ...

    def execute_sync(self, request: Request, timeout: float | None) -> cf.Future[Any]:
        """A compile for Inductor, which asks from its own threads: the scheduler's request
        path, answered through a ``concurrent.futures.Future``."""
        ...

    def start_pool(self) -> None:
        """Start loading the fork server now, without waiting."""

    def warm_workers(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[cf.Future[Any]]:
        """Start every worker and run ``fn(*args)`` once in each, without waiting."""
        ...

    def tuner(self) -> Tuner:
        """The scheduler's tuner, whose benchmark processes time max-autotune's choices."""
        ...

    def record_benchmark(self, record: BenchmarkRecord) -> None: ...
