"""What the pool over a foreign executor (``_foreign``) knows about executors.

How to make another like a given one (to replace a broken one), a Dask client as the
executor that keeps the scheduler's semantics, how many jobs an executor runs in the order
sent, and how to stop a stdlib process pool's processes, which nothing else can stop.

An executor of a cluster (``aiocompile._foreign.dask``) loses jobs one worker at a time rather than
all at once, and can do what a stdlib pool cannot. It says so with a few optional members,
which ``ForeignPool`` uses where they exist:

- a job's future failing with :class:`WorkerLost`: the worker holding that job died, the
  executor itself is fine. The job is a suspect (it may have been running when its worker
  died, or only waiting there) and is sorted as a break's suspects are: re-run alone, and
  blamed only for deaths it causes alone. A death the executor caused on purpose (to stop
  a job past its timeout) sends the jobs it took back to the queue, blaming nobody;
- ``capacity()``: how many jobs it runs at once. Never more are handed to it; the rest
  wait here, where they can be cancelled and where their order is kept, and each job's
  clock starts as it is handed over;
- ``kill(future)``: stop a running job and free its worker (a job past its timeout, or
  cancelled with ``cancel_running="kill"``, or still running at the end of the grace
  period of ``shutdown()``);
- ``job_runner``: the function its workers run instead of ``run_in_foreign_worker``.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import sys
import time
from concurrent.futures.process import ProcessPoolExecutor
from concurrent.futures.thread import ThreadPoolExecutor
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Callable, Union

ExecutorFactory = Callable[[], cf.Executor]
ExecutorSpec = Union[cf.Executor, ExecutorFactory]

class WorkerLost(Exception):
    """What an executor of a cluster fails one job's future with when the worker holding
    that job died while the executor itself carries on (see this module's docstring).

    ``worker`` names the dead worker process, so that one death is counted once however
    many jobs it took; ``deliberate`` says the executor killed it on purpose."""

    def __init__(self, message: str, worker: Any = None, deliberate: bool = False) -> None:
        super().__init__(message)
        self.worker = worker
        self.deliberate = deliberate

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerLost, (str(self), self.worker, self.deliberate))


def factory_for(executor: cf.Executor) -> ExecutorFactory | None:
    """A factory making more executors like ``executor``, where that can be known."""
    rebuild = getattr(executor, "rebuild", None)
    if callable(rebuild):
        return rebuild
    if isinstance(executor, ProcessPoolExecutor):
        options: dict[str, Any] = {
            "max_workers": getattr(executor, "_max_workers", None),
            "mp_context": getattr(executor, "_mp_context", None),
            "initializer": getattr(executor, "_initializer", None),
            "initargs": getattr(executor, "_initargs", ()),
        }
        if sys.version_info >= (3, 11) and getattr(executor, "_max_tasks_per_child", None):
            options["max_tasks_per_child"] = executor._max_tasks_per_child
        return lambda: ProcessPoolExecutor(**options)
    return None


def workers_in_order(executor: cf.Executor | None) -> int:
    """How many jobs ``executor`` runs at once, taking them in the order sent; 0 where
    either is not known."""
    if isinstance(executor, (ProcessPoolExecutor, ThreadPoolExecutor)):
        return int(getattr(executor, "_max_workers", 0) or 0)
    return 0


def join_processes(processes: list[Any], timeout: float) -> None:
    """Wait for the processes of a stdlib process pool to exit; kill those that take
    longer than ``timeout`` seconds.

    This waits on each process's sentinel, without ``Process.join()``: the pool's own
    management thread may be joining the same processes, and with a forkserver context two
    joins race to read the one exit status the fork server sends.
    """
    sentinels = {}
    for process in processes:
        try:
            sentinels[process.sentinel] = process
        except (AttributeError, ValueError):  # not a multiprocessing.Process, or closed
            continue
    deadline = time.monotonic() + timeout
    while sentinels:
        left = deadline - time.monotonic()
        if left <= 0:
            kill_processes(list(sentinels.values()))
            wait_for_any(list(sentinels), 1.0)
            return
        for sentinel in wait_for_any(list(sentinels), left):
            sentinels.pop(sentinel, None)


def kill_processes(processes: list[Any]) -> None:
    """Kill the worker processes of a stdlib process pool that outlived the grace period
    (nothing else can stop a running job there)."""
    for process in processes:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except (ProcessLookupError, AttributeError, TypeError):
            pass
