"""``autotune()``: every configuration compiled in the pool, timed in benchmark processes,
the decision kept and Triton primed with it.

One call goes through these steps:

1. **Check** at once, in the caller: the kernel is an autotuned Triton kernel, the grid is
   one, and the device exists (``RuntimeError`` before anything compiles where there is no
   GPU to time on).
2. **Plan** in a thread (``plan``): Triton's own key, pruning and specialisations.
3. **Decide**, once per decision key however many callers ask at once: a decision in
   memory, or in ``cache_dir``, or a tuning. A tuning runs in a thread of its own, so that
   it is tied to no caller's event loop and a cancelled caller leaves it running for the
   others: every configuration is compiled through the scheduler (single flight, caches,
   records, crash and timeout handling, as for any compile) and timed in a benchmark
   process (``benchpool``), briefly as soon as it has compiled and then, if it is near
   the fastest, as the autotuner times it (``rounds``). A configuration that
   failed anywhere counts as infinitely slow, with its reason; the fastest wins, as
   Triton's ``min`` over its timings picks it; if none is left, ``AutotuneError`` lists
   each configuration and why.
4. **Prime**, for each caller: the chosen configuration's binary (from the compile cache)
   goes into the JIT's cache for the caller's specialisation and device, loaded, and the
   autotuner's cache holds the choice under the launch's key. The ordinary launch then
   neither compiles nor benchmarks.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiocompile._base import bridge, checks, threads
from aiocompile._tuning import plan as _plan
from aiocompile._tuning import priming
from aiocompile._tuning.benchpool import BenchPool, Session, Timed
from aiocompile._tuning.decisions import SUBDIRECTORY, Decision, Decisions
from aiocompile._tuning.inputs import Inputs
from aiocompile._tuning.rounds import Rounds, screen_for
from aiocompile._tuning.task import BenchTask
from aiocompile._tuning.timing import GpuTiming, Timing
from aiocompile.errors import AutotuneError, CompileError, SchedulerClosed
from aiocompile.records import BenchmarkOutcome, BenchmarkRecord

if TYPE_CHECKING:
    from aiocompile._base.config import SchedulerConfig
    from aiocompile._observe.progress import Progress
    from aiocompile.backends import Request
    from aiocompile.backends.triton import TritonBackend
    from aiocompile.backends.triton._kernel import TritonKernel

_log = logging.getLogger("aiocompile")
_REASON_CHARS = 400


@dataclass(frozen=True)
class ConfigTiming:
    """One configuration's time, as the decision saw it."""

    label: str
    time_ms: float | None
    """The median, in milliseconds; None when it failed (Triton's ``inf``)."""
    reason: str | None
    """Why it failed; or, with a ``time_ms`` (its short timing), why it was left out of
    the full timings (see ``SchedulerConfig.tuning_screen``)."""


@dataclass(frozen=True)
class AutotuneResult:
    """What ``autotune()`` chose, and how.

    ``config`` is the ``triton.Config`` chosen (one of the autotuner's own), ``kernel`` its
    compiled ``TritonKernel``, ``key`` the autotuner's key for the launch (None for an
    autotuner with one configuration), ``timings`` what each configuration measured, and
    ``source`` where the decision came from: ``"tuned"`` (benchmarked now), ``"joined"``
    (another caller's tuning, under way when this one asked), ``"memory"`` or ``"disk"``
    (a decision kept earlier), ``"single"`` (one configuration left: nothing to time).
    """

    config: Any
    kernel: TritonKernel
    key: tuple[Any, ...] | None
    source: str
    timings: tuple[ConfigTiming, ...]
    device: int
    device_name: str
    decision_key: str | None

    @property
    def label(self) -> str:
        return _plan.describe(self.config)


class TuningPort(Protocol):
    """What a tuner asks of the scheduler it tunes for (the scheduler's engine)."""

    config: SchedulerConfig
    triton: TritonBackend
    """The Triton backend, whose keys a tuning's compiles need."""

    @property
    def closed(self) -> bool: ...

    def check_open(self) -> None:
        """``SchedulerClosed`` if the scheduler may not take work."""

    def execute_sync(self, request: Request, timeout: float | None) -> cf.Future[Any]:
        """A compile from a tuning thread: the scheduler's request path, answered through
        a ``concurrent.futures.Future``."""
        ...

    async def compile_triton(self, kernel: Any, *, signature: Mapping[str, Any],
                             constexprs: Mapping[str, Any] | None = None, target: Any = None,
                             timeout: float | None = None, attrs: Mapping[str, Any] | None = None,
                             **options: Any) -> TritonKernel: ...

    def progress(self, total: int, enabled: bool, description: str = "compiling") -> Progress: ...

    def count_tuning(self, what: str, count: int = 1) -> None: ...

    def record_benchmark(self, record: BenchmarkRecord) -> None: ...


class Tuner:
    """The ``autotune()`` machinery of one scheduler: its benchmark processes (started on
    first use), its decisions, and the tunings under way."""

    def __init__(self, port: TuningPort, timing: Timing | None = None) -> None:
        self._port = port
        self.timing = timing or GpuTiming()
        self._lock = threading.Lock()
        self._pool: BenchPool | None = None
        self._inflight: dict[str, cf.Future[tuple[Decision, str]]] = {}
        self._names: dict[int, str] = {}
        self.starting: cf.Future[None] | None = None
        """The start of the benchmark processes asked for with the scheduler, if any."""
        self.last_profile: dict[str, Any] = {}
        """Wall-clock times of the latest ``autotune()``'s steps, and each configuration's
        (compiled, sent, timed; seconds loading and timing it), for profiles."""
        self._executor = cf.ThreadPoolExecutor(32, thread_name_prefix="aiocompile-tuning")
        config = port.config
        disk = None
        if config.cache_dir is not None:
            from aiocompile._cache.disk import DiskCache

            disk = DiskCache(os.path.join(config.cache_dir, SUBDIRECTORY), None, config.cache_key,
                             config.cache_dir_entry_bytes)
        self.decisions = Decisions(disk)
        self._closed = False

    # -- devices -------------------------------------------------------------------------

    def devices(self, count: int | None = None) -> list[int]:
        """The devices benchmark processes may use, of ``count`` visible (blocking: may
        ask torch)."""
        count = self.timing.count() if count is None else count
        wanted = self._port.config.tuning_devices
        if wanted is None:
            return list(range(count))
        missing = [d for d in wanted if d >= count]
        if missing:
            raise RuntimeError(f"tuning_devices names device(s) {missing} but {count} are visible here")
        return list(wanted)

    def device_name(self, device: int) -> str:
        name = self._names.get(device)
        if name is None:
            name = self._names[device] = self.timing.device_name(device)
        return name

    def _resolve(self, device: int | None, current: int) -> tuple[int, frozenset[int], str]:
        """The device to tune for, the devices that may time it, and its model (blocking).
        ``RuntimeError`` where there is no such device to time on."""
        count = self.timing.count()
        if count == 0:
            raise RuntimeError("autotune() times each configuration on a GPU, and this machine shows none "
                               "(torch.cuda.device_count() == 0); compile ahead without tuning with warmup() or "
                               "compile_triton()")
        target = current if device is None else device
        if target >= count:
            raise RuntimeError(f"autotune(device={target}): there is no such GPU here ({count} visible)")
        allowed = self.devices()
        name = self.device_name(target)
        if device is not None:
            if device not in allowed:
                raise RuntimeError(f"autotune(device={device}): the device is not among tuning_devices {allowed}")
            return target, frozenset({device}), name
        same = frozenset(d for d in allowed if self.device_name(d) == name)
        if not same:
            raise RuntimeError(f"autotune(): no device among tuning_devices {allowed} is a {name} like device {target}")
        return target, same, name

    def pool(self, devices: list[int] | None = None) -> BenchPool:
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            if self._pool is None:
                self._pool = BenchPool(self.timing, self.devices() if devices is None else devices,
                                       timeout=self._port.config.benchmark_timeout, on_process=self._on_process)
            return self._pool

    def _on_process(self, what: str, device: int, pid: int, detail: str | None) -> None:
        if what == "started":
            _log.debug("benchmark process %d started on device %d (%s)", pid, device, detail)
        else:
            _log.warning("benchmark process %d on device %d was lost (%s); the next configuration gets a new one",
                         pid, device, detail)

    def counters(self) -> dict[str, int]:
        pool = self._pool
        return {"benchmark_processes_started": pool.started if pool else 0,
                "benchmark_processes_lost": pool.lost if pool else 0}

    def start_soon(self) -> None:
        """Start every benchmark process in the background (``benchmark_at_start``), and
        pay this process's first costs of a tuning; if that fails, it is logged, and the
        first tuning tries again."""

        def start() -> None:
            try:
                # Counted without torch: the program may be importing it right now.
                devices = self.devices(self.timing.count_early())
                if devices:
                    self.pool(devices).start(frozenset(devices))
                    threading.Thread(target=self._first_costs, name="aiocompile-tuning-start", daemon=True).start()
            except SchedulerClosed:
                pass
            except Exception:
                _log.warning("the benchmark processes could not be started with the scheduler", exc_info=True)

        self.starting = threads.LOADS.submit(start)

    def _first_costs(self, within: float = 300.0) -> None:
        """This process's own first costs of a tuning, paid beside the benchmark
        processes' start: hashing Triton (for the compiles' keys) and Triton's GPU driver
        (which specialising the first configuration needs), each otherwise paid by the
        first request. Each waits until the program has imported what it needs
        (Triton; then torch): importing a package from two threads at once can fail
        with a partially initialised module, so this thread never starts an import the
        program may be making."""
        try:
            if not priming.imported("triton", within):
                return
            started = time.monotonic()
            self._port.triton.warm_triton_key()
            if self.timing.loads_in_parent and priming.imported("torch", within - (time.monotonic() - started)):
                priming.prime_parent_loading()
        except Exception:  # paid by the first tuning instead
            _log.debug("the first costs of a tuning were not paid ahead", exc_info=True)

    async def warm(self) -> None:
        """Start every benchmark process now, without waiting for them."""
        devices = await threads.LOADS.run(self.devices)
        if devices:
            pool = await threads.LOADS.run(self.pool)
            pool.start(frozenset(devices))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool = self._pool
        if pool is not None:
            pool.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- autotune() ----------------------------------------------------------------------

    async def autotune(self, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, grid: Any,
                       device: int | None, timeout: float | None, progress: bool) -> AutotuneResult:
        port = self._port
        checks.CALL_TIMEOUT.check("timeout", timeout)
        checks.DEVICE.check("device", device)
        if grid is None or not (callable(grid) or isinstance(grid, (tuple, list, int))):
            raise TypeError(f"autotune() needs the launch's grid: a tuple of ints or a callable, got {grid!r}")
        port.check_open()
        if "triton" not in sys.modules:  # then it cannot be a Triton kernel
            raise TypeError(f"autotune() takes a kernel decorated with @triton.autotune, got {type(kernel).__name__}; "
                            "for a plain @triton.jit function use warmup()")
        _plan.chain_of(kernel)  # not an autotuned kernel: TypeError, before anything else
        current = self.timing.current_device()  # the caller's, read in the caller's thread
        profile: dict[str, Any] = {"called_at": time.time()}
        # The first compile's key needs Triton hashed (once per process, and the costliest
        # step of a first key): hashed now, beside the plan, rather than after it.
        threads.KEYS.submit(port.triton.warm_triton_key)
        target, devices, device_name = await threads.LOADS.run(lambda: self._resolve_and_start(device, current))
        profile["resolved_at"] = time.time()
        plan = await threads.LOADS.run(lambda: _plan.prepare(kernel, args, kwargs, grid, target))
        profile["planned_at"] = time.time()
        port.check_open()
        if not plan.tunes:
            await threads.LOADS.run(plan.expand)
            result = await self._prime(plan, plan.configs[0], None, "single", device_name, timeout)
            port.count_tuning("answered")
            return result
        decision_key = plan.decision_key(device_name)
        try:
            found, source = self.decisions.remembered(decision_key), "memory"
            if found is None:
                found, source = await threads.LOADS.run(lambda: self._load_or_start(decision_key, devices)), "disk"
            # The first configuration specialised (and the others checked) here: what the
            # launch would raise is raised before anything compiles. The others are
            # specialised by the tuning, each compiling as soon as it is.
            await threads.LOADS.run(lambda: _check_and_expand_first(plan))
            profile["expanded_at"] = time.time()
            if found is not None and plan.config_for(found.config) is None:  # pragma: no cover - keyed by them
                self.decisions.forget(decision_key)
                found = None
            if found is None:
                found, source = await self._decide(plan, decision_key, devices, device_name, timeout, progress,
                                                   profile)
            profile["decided_at"] = time.time()
            decision = found
            chosen_plan = plan.config_for(decision.config)
            if chosen_plan is None:  # pragma: no cover - the key covers the configurations
                raise AutotuneError(f"the decision for {plan.name} names a configuration it does not have",
                                    kernel_name=plan.name)
            result = await self._prime(plan, chosen_plan, decision, source, device_name, timeout)
            profile["primed_at"] = time.time()
            profile["source"] = source
            self.last_profile = profile
        except BaseException:
            port.count_tuning("failures")
            raise
        port.count_tuning("answered")
        if source in ("memory", "disk"):
            port.count_tuning("hits")
        return result

    def _resolve_and_start(self, device: int | None, current: int) -> tuple[int, frozenset[int], str]:
        """``_resolve``; and where no decision kept on disk may spare the tuning (no
        ``cache_dir``), the benchmark processes start now, before the plan, so that their
        start (seconds: torch, Triton, the device's context) overlaps as much as it can."""
        target, devices, name = self._resolve(device, current)
        if self.decisions.disk is None:
            self.pool().start(devices)
        return target, devices, name

    def _load_or_start(self, key: str, devices: frozenset[int]) -> Decision | None:
        """The decision kept on disk; or, there being none, a tuning to come: its
        benchmark processes start now, while the configurations are specialised (which
        may build Triton's driver here) and compiled."""
        found = self.decisions.load(key)
        if found is None:
            self.pool().start(devices)
        return found

    async def _decide(self, plan: _plan.TuningPlan, key: str, devices: frozenset[int], device_name: str,
                      timeout: float | None, progress: bool, profile: dict[str, Any]) -> tuple[Decision, str]:
        found = self.decisions.remembered(key)
        if found is not None:
            return found, "memory"
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            future = self._inflight.get(key)
            joined = future is not None
            if future is None:
                future = self._inflight[key] = self._executor.submit(
                    self._tune_or_load, plan, key, devices, device_name, timeout, progress, profile)
                future.add_done_callback(bridge.Once(self._forget, key))
        try:
            decision, source = await bridge.wait(future)
        except cf.CancelledError:  # withdrawn before it began: the scheduler closed
            raise SchedulerClosed("the scheduler was closed before this tuning began") from None
        return decision, ("joined" if joined else source)

    def _forget(self, key: str, future: cf.Future[Any]) -> None:
        with self._lock:
            if self._inflight.get(key) is future:
                del self._inflight[key]

    # -- in a tuning thread ----------------------------------------------------------------

    def _tune_or_load(self, plan: _plan.TuningPlan, key: str, devices: frozenset[int], device_name: str,
                      timeout: float | None, progress: bool, profile: dict[str, Any]) -> tuple[Decision, str]:
        found = self.decisions.remembered(key)  # a tuning that ended just before this one began
        if found is not None:
            return found, "memory"
        return self._tune(plan, key, devices, device_name, timeout, progress, profile), "tuned"

    def _tune(self, plan: _plan.TuningPlan, key: str, devices: frozenset[int], device_name: str,
              timeout: float | None, progress: bool, profile: dict[str, Any]) -> Decision:
        port = self._port
        started = time.perf_counter()
        profile["tune_at"] = time.time()
        pool = self.pool()
        pool.start(devices)  # the processes start while the configurations compile
        loading: cf.Future[None] | None = None
        if self.timing.loads_in_parent:
            # This process loads the chosen binary at the end: its own one-time set-up of
            # loading (Triton's driver) is paid now, beside the compiles, not then.
            loading = threads.LOADS.submit(priming.prime_parent_loading)
        rows: dict[int, dict[str, Any]] = {index: {"label": _plan.describe(config)}
                                           for index, config in enumerate(plan.pruned)}
        profile["configs"] = [rows[index] for index in range(len(plan.pruned))]
        bar = port.progress(2 * len(plan.pruned), progress, description=f"tuning {plan.name}")
        compiles: dict[cf.Future[Any], _plan.ConfigPlan] = {}
        failed: dict[int, tuple[BenchmarkOutcome, str]] = {}
        reading: cf.Future[Inputs] | None = None
        tensors = 0
        # Each configuration compiles as soon as it is specialised, the first at once.
        for planned in plan.expanding():
            request = port.triton.prepare_now({"kernel": plan.chain.jit, **_request_item(planned.spec.request())},
                                                 None)
            compiles[port.execute_sync(request, timeout)] = planned
            rows[planned.index]["compile_submitted_at"] = time.time()
            if reading is None:
                # The launch's tensors are known once one configuration is specialised
                # (they are the launch's arguments): read beside the others.
                tensors = len(plan.collector)
                reading = threads.LOADS.submit(plan.read_inputs)
        outcomes: dict[int, Timed] = {}
        session: Session | None = None
        keys: dict[int, str | None] = {}
        rounds: Rounds | None = None
        try:
            # The tensors, read while the configurations compile, go to the processes
            # ahead of the first configuration.
            inputs = plan.read_inputs() if reading is None else reading.result()
            if len(plan.collector) != tensors:  # pragma: no cover - a configuration's own tensor: read them all again
                inputs = plan.read_inputs()
            session = Session(inputs)
            profile["inputs_read_at"] = time.time()
            profile["inputs_sent"] = session.sent
            pool.offer(session, devices)
            screen = screen_for(plan.hooks.timing, port.config.tuning_screen, len(plan.configs))
            live = session

            def submit(index: int, compiled: Any, settings: tuple[float, float] | None) -> cf.Future[Timed]:
                rows[index]["short_submitted_at" if settings else "submitted_at"] = time.time()
                return pool.submit(live, _bench_task(plan, plan.configs[index], compiled, settings), devices)

            def seen(index: int, outcome: Timed, round_: str, last: bool) -> None:
                prefix = "short_" if round_ == "short" else ""
                rows[index].update({f"{prefix}bench_started_at": outcome.started_at,
                                    f"{prefix}bench_finished_at": outcome.finished_at,
                                    f"{prefix}time_ms": outcome.timings[0] if outcome.timings else None},
                                   **{f"{prefix}{name}": value for name, value in (outcome.phases or {}).items()})
                if last:
                    bar.finished(plan.configs[index].label, ok=outcome.ok)
                self._record(plan, plan.configs[index], outcome, keys.get(index), round_)

            rounds = Rounds((planned.index for planned in plan.configs), submit, screen)
            profile["screen"] = None if screen is None else [screen.warmup_ms, screen.rep_ms, screen.margin]
            pending = set(compiles)
            while pending:
                done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for future in done:
                    planned = compiles[future]
                    rows[planned.index]["compiled_at"] = time.time()
                    exc = future.exception()
                    if exc is not None:
                        failed[planned.index] = (BenchmarkOutcome.COMPILE_ERROR, _reason(exc))
                        bar.finished(f"{planned.label}: did not compile", ok=False)
                        bar.finished(planned.label, ok=False)
                        rounds.compiled(planned.index, None)
                        continue
                    bar.finished(planned.label, ok=True)
                    keys[planned.index] = future.result().key
                    if loading is not None:
                        # The kernel's launcher (which Triton up to 3.6 builds with the C
                        # compiler, the same for every configuration) built here and kept in
                        # Triton's cache while a benchmark process may still be starting:
                        # its first configuration then finds it there.
                        threads.LOADS.submit(functools.partial(priming.build_launcher, loading, future.result()))
                        loading = None
                    rounds.compiled(planned.index, future.result())
            outcomes = rounds.outcomes(seen)
        finally:
            bar.close()
            if session is not None:
                pool.drop(session)
            if rounds is not None:
                rounds.cancel()
        for index, (status, reason) in failed.items():
            self._record_failure(plan, plan.configs[index], status, reason)
        left_out = {} if rounds is None else rounds.left_out
        return self._choose(plan, key, device_name, outcomes, failed, left_out, time.perf_counter() - started)

    def _choose(self, plan: _plan.TuningPlan, key: str, device_name: str, outcomes: dict[int, Timed],
                failed: dict[int, tuple[BenchmarkOutcome, str]], left_out: dict[int, str], seconds: float) -> Decision:
        import triton

        inf = float("inf")
        timings: dict[int, list[float]] = {}
        rows: list[tuple[str, float | None, str | None]] = []
        for planned in plan.configs:
            outcome = outcomes.get(planned.index)
            if outcome is not None and outcome.ok and outcome.timings is not None:
                # Left out after the short round: its short timing is shown, and it is
                # not among those the fastest is picked from.
                why = left_out.get(planned.index)
                timings[planned.index] = list(outcome.timings) if why is None else [inf, inf, inf]
                rows.append((planned.label, outcome.timings[0], why))
            else:
                timings[planned.index] = [inf, inf, inf]
                reason = failed.get(planned.index, (None, None))[1] or (outcome.reason if outcome else None)
                rows.append((planned.label, None, reason or "not timed"))
        closed = any(o is not None and o.status is BenchmarkOutcome.CLOSED for o in outcomes.values())
        if self._port.closed or closed or any(reason.startswith("SchedulerClosed") for _, reason in failed.values()):
            # Timings cut short say nothing about the configurations left: no decision.
            raise SchedulerClosed("the scheduler was closed while it tuned")
        if all(t[0] == inf for t in timings.values()):
            failures = tuple((label, str(reason)) for label, _, reason in rows)
            listing = "\n".join(f"  [{label}] {_summary(reason)}" for label, reason in failures)
            raise AutotuneError(f"no configuration of {plan.name} could be used ({len(failures)} tried):\n{listing}",
                                kernel_name=plan.name, failures=failures)
        # Triton's own choice: min() over the timings in the autotuner's order, lists
        # compared as lists (the median first), the first of equals winning.
        best = min(plan.configs, key=lambda planned: timings[planned.index])
        decision = Decision(key=key, kernel=plan.name, tuning_key=repr(plan.key), device_name=device_name,
                            triton_version=triton.__version__, config=_plan.config_id(best.config), label=best.label,
                            timings=tuple(rows), tuned_at=time.time())
        if left_out:
            self._port.count_tuning("left_out", len(left_out))
        if any(o is not None and o.status is BenchmarkOutcome.START_FAILED for o in outcomes.values()):
            # Chosen among the configurations some benchmark process could time: good for
            # this call, not to be kept (the next call tunes again).
            _log.warning("tuning %s: some configurations could not be timed (no benchmark process started); the "
                         "choice among the others is not kept", plan.name)
            self.decisions.forget(key)
        else:
            self.decisions.keep(decision)
        self._port.count_tuning("tuned")
        _log.info("tuned %s for %s in %.2f s: [%s] at %.4f ms (%d configurations, %d failed)", plan.name,
                  device_name, seconds, best.label, timings[best.index][0], len(rows),
                  sum(1 for _, ms, _ in rows if ms is None))
        return decision

    def _record(self, plan: _plan.TuningPlan, planned: _plan.ConfigPlan, outcome: Timed, key: str | None,
                round_: str) -> None:
        timings = outcome.timings or (None, None, None)
        record = BenchmarkRecord(
            name=plan.name, config=planned.label, outcome=outcome.status, time_ms=timings[0],
            p20_ms=timings[1] if len(timings) > 1 else None, p80_ms=timings[2] if len(timings) > 2 else None,
            reason=outcome.reason, device=outcome.device, device_name=outcome.device_name, attempt=outcome.attempt,
            pid=outcome.pid, started_at=outcome.started_at, finished_at=outcome.finished_at, key=key, round=round_)
        self._emit(record)

    def _record_failure(self, plan: _plan.TuningPlan, planned: _plan.ConfigPlan, status: BenchmarkOutcome,
                        reason: str) -> None:
        now = time.time()
        self._emit(BenchmarkRecord(name=plan.name, config=planned.label, outcome=status,
                                   time_ms=None, p20_ms=None, p80_ms=None, reason=reason, device=None,
                                   device_name=None, attempt=0, pid=None, started_at=now, finished_at=now))

    def _emit(self, record: BenchmarkRecord) -> None:
        self._port.record_benchmark(record)

    # -- priming ----------------------------------------------------------------------------

    async def _prime(self, plan: _plan.TuningPlan, chosen: _plan.ConfigPlan, decision: Decision | None, source: str,
                     device_name: str, timeout: float | None) -> AutotuneResult:
        port = self._port
        kernel: TritonKernel = await port.compile_triton(plan.chain.jit, timeout=timeout, **chosen.spec.request())
        load = self.timing.loads_in_parent
        await threads.LOADS.run(lambda: priming.warmup_prime(plan, chosen, kernel, decision, load))
        timings = () if decision is None else tuple(ConfigTiming(*row) for row in decision.timings)
        return AutotuneResult(chosen.config, kernel, plan.key, source, timings, plan.device, device_name,
                              None if decision is None else decision.key)


def _check_and_expand_first(plan: _plan.TuningPlan) -> None:
    plan.check()
    next(plan.expanding(), None)


def _request_item(request: dict[str, Any]) -> dict[str, Any]:
    """``_warmup.Plan.request()`` as ``TritonBackend.prepare_now`` takes an item."""
    request = dict(request)
    return {"signature": request.pop("signature"), "constexprs": request.pop("constexprs"),
            "attrs": request.pop("attrs"), "target": request.pop("target"), "options": request}


def _bench_task(plan: _plan.TuningPlan, planned: _plan.ConfigPlan, compiled: Any,
                screen: tuple[float, float] | None) -> BenchTask:
    # Only the binary travels: loading needs nothing else.
    binary_only = compiled.binary_only()
    import pickle

    config = planned.config
    return BenchTask(name=plan.name, label=planned.label, config=dict(config.all_kwargs()),
                     kernel=binary_only.to_bytes(), grid=planned.grid, args=planned.args,
                     hook_args=planned.hook_args, hooks=plan.hooks,
                     config_pre_hook=None if config.pre_hook is None else pickle.dumps(config.pre_hook), screen=screen)


def _summary(reason: str) -> str:
    """A reason on one line. Triton's compile errors start with where (``at 2:41:``) and
    the source, and end with what; other reasons say what first."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    if not lines:
        return "?"
    first = lines[0]
    if len(lines) > 1 and first.split(":", 1)[-1].strip().startswith("at "):
        causes = [line for line in lines if not line.startswith("caused by")]
        first = f"{first.split(':', 1)[0]}: {causes[-1]}"
    return first[:_REASON_CHARS]


def _reason(exc: BaseException) -> str:
    if isinstance(exc, CompileError):
        text = exc.message.strip()
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"{type(exc).__name__}: {exc}"
