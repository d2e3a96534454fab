"""The executor over a Dask cluster, with the semantics of aiocompile's own pool;
``aiocompile.dask`` is its public face, and its docstring says what the scheduler makes of
a cluster. ``executors.adapt`` makes one of a ``distributed.Client`` given as a
scheduler's executor."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import logging
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any, Callable

import distributed

from aiocompile._base import checks
from aiocompile._foreign.executors import WorkerLost
from aiocompile._foreign.remote import is_framed, origin, run_on_dask_worker, unframe_answer
from aiocompile.errors import JobError, SchedulerClosed

__all__ = ["DaskExecutor", "executor"]

_log = logging.getLogger("aiocompile")
# How often the cluster's number of worker threads is asked again, at most.
_CAPACITY_EVERY = 1.0


def executor(
    client: Any,
    *,
    resources: Mapping[str, float] | None = None,
    configure_cluster: bool = True,
) -> DaskExecutor:
    """An executor for ``Scheduler(executor=...)`` that runs jobs on a Dask cluster.

    ``client`` is a ``distributed.Client`` (synchronous: one that runs its own event loop
    thread, as ``Client(address)`` does) or a scheduler's address (``"tcp://host:8786"``),
    for which the executor makes a client of its own and closes it on shutdown.
    ``resources`` are Dask resources every job asks for (to keep compiles on the workers
    meant for them). ``configure_cluster`` lets the executor set the cluster's
    ``allowed_failures`` to 0 (see the module docstring); with False, a cluster whose
    setting is not 0 raises ``ValueError``.

    Raises ``TypeError`` for arguments of the wrong type, ``ValueError`` for an
    asynchronous client or bad values, and Dask's own ``OSError`` for an address where no
    scheduler answers.
    """
    checks.Flag().check("configure_cluster", configure_cluster)
    if resources is not None:
        if not isinstance(resources, Mapping) or not all(isinstance(k, str) for k in resources):
            raise TypeError(f"resources must be a mapping of resource names to amounts, got {resources!r}")
        for name, amount in resources.items():
            checks.Number(above=0).check(f"resources[{name!r}]", amount)
    own = False
    if isinstance(client, str):
        if not client.strip():
            raise ValueError("the Dask scheduler's address must not be empty")
        client = distributed.Client(client, set_as_default=False)
        own = True
    elif not isinstance(client, distributed.Client):
        raise TypeError(f"client must be a distributed.Client or a scheduler address, got {type(client).__name__}")
    elif client.asynchronous:
        raise ValueError("client must be a synchronous distributed.Client (Client(address), not "
                         "asynchronous=True): the executor waits on it from threads of its own")
    try:
        _take_over_retries(client, configure_cluster)
    except BaseException:
        if own:
            client.close()
        raise
    return DaskExecutor(client, own_client=own, resources=resources)


def _take_over_retries(client: Any, configure: bool) -> None:
    # Defined here so that it travels by value (cloudpickle): the scheduler need not have
    # aiocompile installed.
    def allowed_failures(value: int | None = None, dask_scheduler: Any = None) -> int:
        previous = int(dask_scheduler.allowed_failures)
        if value is not None:
            dask_scheduler.allowed_failures = value
        return previous

    if not configure:
        current = client.run_on_scheduler(allowed_failures)
        if current != 0:
            raise ValueError(
                f"the Dask cluster retries a task on {current} more worker(s) after its worker dies "
                "(allowed_failures), which would hide crashes from max_crashes and blame innocent jobs: "
                "start its scheduler with DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES=0, or let the "
                "executor set it (configure_cluster=True)")
        return
    previous = client.run_on_scheduler(allowed_failures, 0)
    if previous != 0:
        _log.info("aiocompile: set the Dask cluster's allowed_failures from %d to 0: a worker's death is "
                  "counted, and its jobs re-run, by aiocompile", previous)


def _kill_worker_process(dask_worker: Any = None) -> tuple[str, int] | None:
    """Run in a worker's nanny: kill its worker process (the nanny then starts another).
    Returns the worker's address and pid, or None if it had none running."""
    pid = getattr(dask_worker, "pid", None)
    address = getattr(dask_worker, "worker_address", None)
    if not pid:
        return None
    os.kill(pid, signal.SIGKILL)
    return str(address), int(pid)


class DaskExecutor(cf.Executor):
    """A ``concurrent.futures.Executor`` over a Dask client, made for the scheduler's
    foreign pool (``aiocompile._foreign.pool``): it runs as many jobs at once as the cluster has
    worker threads (``capacity``), reports a worker's death as the loss of the jobs it held
    (``WorkerLost``), stops a running job by restarting its worker (``kill``), and has its
    workers run ``job_runner``, whose answers travel as bytes. Make one with
    :func:`executor`."""

    def __init__(
        self,
        client: Any,
        *,
        own_client: bool = False,
        resources: Mapping[str, float] | None = None,
    ) -> None:
        self.client = client
        self._own_client = own_client
        self._resources = dict(resources) if resources else None
        self._lock = threading.Lock()
        # Our future -> Dask's, for each job handed to the cluster and not finished.
        self._running: dict[cf.Future[Any], Any] = {}
        self._stopping: set[cf.Future[Any]] = set()
        # Workers being killed here (their addresses), then each worker process killed here
        # (address, pid): a death reported there is ours, not a job's.
        self._killing: set[str] = set()
        self._deliberate: collections.deque[tuple[Any, Any]] = collections.deque(maxlen=256)
        self._warned_no_nanny = False
        # Stopping jobs and asking the cluster's size take round trips: never in a caller's
        # thread (an event loop's, for a cancelled request), always here, one at a time.
        self._control = cf.ThreadPoolExecutor(1, thread_name_prefix="aiocompile-dask")
        self._threads = 1
        self._asked_at = -math.inf
        self._shutdown = False
        self.job_runner: Callable[..., bytes] = functools.partial(run_on_dask_worker, submitter=origin())
        self._ask_capacity()

    def __repr__(self) -> str:
        return f"<DaskExecutor {getattr(self.client, 'scheduler', None)} threads={self._threads}>"

    # -- what the foreign pool asks ---------------------------------------------------------

    def capacity(self) -> int:
        """Worker threads in the cluster, as last asked (at most once a second, in the
        executor's own thread): never blocks."""
        if time.monotonic() - self._asked_at > _CAPACITY_EVERY and not self._shutdown:
            self._asked_at = time.monotonic()
            try:
                self._control.submit(self._ask_capacity)
            except RuntimeError:
                pass
        return self._threads

    def _ask_capacity(self) -> None:
        self._asked_at = time.monotonic()
        try:
            info = self.client.scheduler_info(n_workers=0)
            total = info.get("total_threads")
            if total is None:
                total = sum(self.client.nthreads().values())
            self._threads = max(1, int(total))
        except Exception:  # noqa: BLE001 - the last answer stands; a lost cluster shows in the jobs
            _log.debug("aiocompile: could not ask the Dask cluster's size", exc_info=True)

    def rebuild(self) -> DaskExecutor:
        """The executor to use after a break: this one, while its client is connected."""
        if self._shutdown or self.client.status not in ("running", "connecting", "newly-created"):
            raise SchedulerClosed(f"the Dask client is {self.client.status}: the cluster cannot be reached")
        return self

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
        if self.client.status in ("closing", "closed"):
            raise cf.BrokenExecutor(f"the Dask client is {self.client.status}")
        ours: cf.Future[Any] = cf.Future()
        ours.set_running_or_notify_cancel()  # handed over: it cannot be withdrawn like a queued job
        # retries=0: a job never raises here (its failure is its answer), so a retry by Dask
        # could only re-run a job whose answer failed to come back.
        theirs = self.client.submit(fn, *args, key=f"aiocompile-{uuid.uuid4().hex}", pure=False, retries=0,
                                    resources=self._resources, **kwargs)
        with self._lock:
            self._running[ours] = theirs
        theirs.add_done_callback(functools.partial(self._finished, ours))
        return ours

    def _finished(self, ours: cf.Future[Any], theirs: Any) -> None:
        # In Dask's callback thread. Reading the answer is a round trip to the worker
        # holding it; the task is released once it is read.
        with self._lock:
            self._running.pop(ours, None)
            stopped = ours in self._stopping
            self._stopping.discard(ours)
        try:
            status = theirs.status
            if stopped:
                ours.set_exception(cf.CancelledError())
            elif status == "finished":
                data = theirs.result()
                try:
                    ours.set_result(unframe_answer(data) if is_framed(data) else data)
                except ValueError as exc:
                    ours.set_exception(JobError(f"the job's answer from the Dask cluster is damaged: {exc}"))
            elif status == "error":
                failure = theirs.exception()
                if isinstance(failure, distributed.KilledWorker):
                    ours.set_exception(self._lost(failure))
                else:
                    # Dask's own failure before or after the job ran (a worker that cannot
                    # import aiocompile, say): the job's alone.
                    error = JobError(f"the Dask cluster could not run the job: "
                                         f"{type(failure).__name__}: {failure}")
                    error.__cause__ = failure
                    ours.set_exception(error)
            else:
                # Cancelled by someone else: the client lost its scheduler, or the cluster
                # was restarted. Every job there is lost with it.
                ours.set_exception(cf.BrokenExecutor(f"the Dask cluster dropped the job ({status})"))
        except BaseException as exc:  # noqa: BLE001 - the job must end, whatever went wrong
            if not ours.done():
                ours.set_exception(cf.BrokenExecutor(f"the job's answer could not be read from the Dask cluster: "
                                                     f"{type(exc).__name__}: {exc}"))
        finally:
            try:
                theirs.release()
            except Exception:  # noqa: BLE001 - the client is closing: nothing left to release
                pass

    def _lost(self, exc: Any) -> WorkerLost:
        worker = exc.last_worker
        address, pid = getattr(worker, "address", None), getattr(worker, "pid", None)
        ident = (address, pid)
        with self._lock:
            deliberate = ident in self._deliberate or address in self._killing
        why = "was killed to stop another job" if deliberate else "died"
        return WorkerLost(f"the Dask worker {address} {why} while it held the job", worker=ident,
                          deliberate=deliberate)

    def kill(self, future: cf.Future[Any]) -> None:
        """Stop the job of ``future``: cancel its task and restart the worker running it
        (in the executor's thread; returns at once)."""
        with self._lock:
            theirs = self._running.get(future)
            if theirs is None or future in self._stopping:
                return
            self._stopping.add(future)
        try:
            self._control.submit(self._stop, theirs)
        except RuntimeError:
            pass  # shut down: nothing more can be stopped

    def _stop(self, theirs: Any) -> None:
        try:
            where = [address for address, keys in self.client.processing().items() if theirs.key in keys]
        except Exception:  # noqa: BLE001
            where = []
        try:
            self.client.cancel([theirs], force=True)
        except Exception:  # noqa: BLE001 - a closed client has nothing running either
            _log.debug("aiocompile: cancelling a Dask task failed", exc_info=True)
        if not where:
            return
        with self._lock:
            self._killing.update(where)
        killed: dict[str, Any] = {}
        try:
            # Not Client.restart_workers: it asks the worker to close first, which waits for
            # the very thread that will not end, and the cluster's scheduler may meanwhile
            # tell the closing worker to close its nanny too (no worker comes back). A
            # process killed outright is what the nanny restarts for certain.
            killed = self.client.run(_kill_worker_process, workers=where, nanny=True, on_error="return")
        except Exception:  # noqa: BLE001
            _log.warning("aiocompile: could not stop the Dask worker %s", ", ".join(where), exc_info=True)
        finally:
            with self._lock:
                for answer in killed.values():
                    if isinstance(answer, tuple):
                        self._deliberate.append(answer)
                self._killing.difference_update(where)
        if not any(isinstance(answer, tuple) for answer in killed.values()) and not self._warned_no_nanny:
            self._warned_no_nanny = True
            _log.warning("aiocompile: the Dask worker %s has no nanny and cannot be restarted: a job stopped there "
                         "(past its timeout, or cancelled) runs on and holds it", ", ".join(where))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more jobs. With ``wait``, finish stopping the jobs being stopped, and
        close the client if the executor made it. Jobs still running are the foreign
        pool's to stop (``kill``) or wait for; ``cancel_futures`` has nothing to cancel,
        since jobs wait in the pool, not here."""
        with self._lock:
            self._shutdown = True
        if not wait:
            return
        self._control.shutdown(wait=True)
        if self._own_client:
            self.client.close()
