"""``mode="max-autotune"`` with aiocompile underneath: Inductor's template choices built in
the pool's workers and timed in aiocompile's benchmark processes.

Inductor times the choices of a template (a matmul's Triton or C++ variants, each a
picklable ``BenchmarkRequest``) in its own tuning pool when ``autotune_in_subproc`` is set:
``autotune_process.get_tuning_process_pool().benchmark(choices)`` returns each choice's
time, ``inf`` for one that failed. While installed, that getter returns a :class:`TuningPool`
of ours, and ``autotune_in_subproc`` is on:

- a GPU choice's request is timed in the scheduler's benchmark processes (one per device,
  the ones ``autotune()`` uses), a CPU choice's in a benchmark process of its own
  (``HostTiming``); each request times itself there (``bmreq.benchmark()``, Inductor's
  own benchmarking), sent as a ``CallTask``;
- a choice that raises, leaves the GPU unusable, kills its process or runs past
  ``benchmark_timeout`` costs only itself: ``inf``, and a ``BenchmarkRecord`` with the
  reason; the process is replaced where it has to be, and the next choice goes on;
- a C++ choice's library is built in the pool's workers before it is timed (and, where
  Inductor precompiles choices in threads, ``CppBenchmarkRequest.precompile`` builds it
  there too), so the benchmark process only loads it. Triton choices are precompiled
  through ``AsyncCompile.triton``, which ``install()`` already sends to the pool.

ATen (extern) choices are timed in this process, as Inductor does in its own subprocess
mode; choices on other devices (XPU...) in Inductor's own tuning pool.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import math
import os
import pickle
import platform
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from aiocompile._tuning.benchpool import BenchPool, Session, Timed
from aiocompile._tuning.inputs import Inputs
from aiocompile._tuning.task import CallTask
from aiocompile._tuning.timing import GpuTiming, Timing
from aiocompile.records import BenchmarkOutcome, BenchmarkRecord

if TYPE_CHECKING:
    from aiocompile._torch.port import TorchPort

_log = logging.getLogger("aiocompile")

# What Inductor hands its own tuning processes with each request (its TuningProcessPool
# does the same): where its generated modules and Triton's binaries are. The compile
# workers' settings (``worker_settings``) go too.
_CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
_MARK = "_aiocompile_tuning_pool"

Builder = Callable[[], Callable[[Any], "cf.Future[Any]"]]
"""Makes the ``submit_fn`` that hands one C++ build to the pool's workers (Inductor's
``CppCodeCache.load_async`` calls it with the build)."""


class HostTiming(Timing):
    """The CPU as the one "device" a benchmark process times on (C++ template choices)."""

    timer = "aiocompile._torch.autotune:HostTimer"

    def count(self) -> int:
        return 1

    def device_name(self, device: int) -> str:
        return platform.processor() or platform.machine() or "cpu"


class HostTimer:
    """The timer of a CPU benchmark process: nothing to open, no tensors of its own; the
    requests it gets time themselves (``CallTask``)."""

    def open(self, device: int) -> str:
        # Inductor's benchmarking now, under the start's time limit rather than the first
        # choice's.
        import torch._inductor.autotune_process  # noqa: F401

        return platform.processor() or platform.machine() or "cpu"

    def load_inputs(self, inputs: Inputs) -> list[Any]:
        return []

    def healthy(self) -> bool:
        return True

    def time(self, task: Any, handle: Any) -> list[float]:
        raise TypeError(f"a CPU benchmark process times Inductor's requests only, not {type(task).__name__}")


def time_request(payload: bytes) -> list[float]:
    """In a benchmark process: rebuild one of Inductor's benchmark requests and let it
    time itself, as Inductor's own tuning process does."""
    from aiocompile.backends.triton._worker import StageTimes

    started = time.perf_counter()
    env, extra_config, data = pickle.loads(payload)
    _as_compile_workers_do(env)
    bmreq = pickle.loads(data)
    _onto_visible_device(bmreq)
    rebuilt = time.perf_counter()
    from torch._inductor import config as inductor_config

    with StageTimes() as stages, inductor_config.patch(extra_config):
        ms = float(bmreq.benchmark())
    done = time.perf_counter()
    # Beside the time: where the call's own time went (for the debug log).
    compiled = sum(seconds for _, seconds in stages.stages)
    hit = -1.0 if stages.cache_hit is None else float(stages.cache_hit)
    return [ms, rebuilt - started, done - rebuilt, compiled, hit]


def _as_compile_workers_do(env: dict[str, str]) -> None:
    """Set up Triton as Inductor's compile workers do (``_worker_compile_triton``): torch's
    own ptxas where torch ships one, the compiling process's environment, its libdevice.
    Triton's cache key holds the ptxas version and the libdevice path, so a process set up
    otherwise finds none of the binaries the workers built and compiles every choice
    again (a second or more each)."""
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:
        pass
    else:
        _set_triton_ptxas_path()
    os.environ.update(env)
    libdevice = env.get("TRITON_LIBDEVICE_PATH")
    if libdevice:
        try:
            from triton import knobs

            knobs.nvidia.libdevice_path = libdevice
        except (ImportError, AttributeError):
            pass


def warm_up(payload: bytes) -> list[float]:
    """In a benchmark process: import what rebuilding a request imports, ahead of the
    first one (seconds of import, while the choices still compile), and set Triton up as
    the compile workers have it before anything asks Triton for its ptxas (whose version
    Triton keeps for the life of the process)."""
    _as_compile_workers_do({})
    import torch._inductor.autotune_process  # noqa: F401
    import torch._inductor.select_algorithm  # noqa: F401

    try:  # Triton's key (hashing its library), which its first compile asks for
        from triton.compiler.compiler import triton_key

        triton_key()
    except Exception:  # noqa: BLE001 - a head start only
        pass
    return [0.0]


def _onto_visible_device(bmreq: Any) -> None:
    """A GPU benchmark process sees its one device as device 0 (``CUDA_VISIBLE_DEVICES``):
    the request's tensors go there, whatever index they had in the compiling process."""
    import torch

    metas = list(getattr(bmreq, "input_tensor_meta", None) or [])
    output = getattr(bmreq, "output_tensor_meta", None)
    if output is not None:
        metas.append(output)
    for meta in metas:
        device = getattr(meta, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda" and device.index not in (None, 0):
            meta.device = torch.device("cuda", 0)


class TuningPool:
    """What Inductor's ``get_tuning_process_pool()`` returns while installed: its
    ``benchmark(choices)`` and ``shutdown()``, on aiocompile's benchmark processes."""

    def __init__(self, port: Callable[[], TorchPort], build: Builder) -> None:
        self._port = port
        self.build = build
        """What hands a native build to the scheduler (``install``'s ``_NativeSubmit``)."""
        self._lock = threading.Lock()
        self._host: BenchPool | None = None
        self._sessions: dict[int, Session] = {}
        self._warmed: set[tuple[int, int]] = set()
        self._closed = False
        self._inductor: Any = None

    # -- Inductor's interface --------------------------------------------------------------

    def benchmark(self, choices: list[Any]) -> dict[Any, float]:
        """Each choice's time in milliseconds, ``inf`` for one that could not be timed
        (with a ``BenchmarkRecord`` saying why). Blocks the calling thread (Inductor's
        compile) until every choice is answered; never raises for a choice."""
        port = self._port()
        timings: dict[Any, float] = {}
        built = _build_libraries(choices, self.build)
        settings = _worker_settings()
        waiting: list[tuple[Any, cf.Future[Timed], BenchPool]] = []
        elsewhere: list[Any] = []
        for choice in choices:
            failure = built.get(id(choice))
            if failure is not None:
                timings[choice] = math.inf
                self._emit_failure(port, choice, "compile_error", failure)
                continue
            if _elsewhere(choice):
                elsewhere.append(choice)
                continue
            try:
                pool, devices = self._pool_for(port, choice.bmreq)
                task = _call_task(choice, settings)
            except Exception as exc:  # noqa: BLE001 - this choice's problem, not the compile's
                timings[choice] = math.inf
                self._emit_failure(port, choice, "error", f"{type(exc).__name__}: {exc}")
                continue
            future = pool.submit(self._session(pool), task, devices)
            waiting.append((choice, future, pool))
        if elsewhere:
            # Devices that are neither the CPU nor a CUDA GPU: Inductor's own tuning pool.
            timings.update(self._inductor_pool().benchmark(elsewhere))
        for choice, future, _pool in waiting:
            outcome = future.result()
            value = outcome.timings[0] if outcome.ok and outcome.timings else math.inf
            timings[choice] = value if not math.isnan(value) else math.inf
            self._emit(port, choice, outcome)
            if outcome.ok and outcome.timings and len(outcome.timings) >= 5:
                _log.debug("max-autotune choice %s: %.4f ms (rebuilt in %.3f s, benchmark() %.3f s, of which Triton "
                           "compiled %.3f s, cache hit %s)", _label(choice), *outcome.timings[:4],
                           {1.0: True, 0.0: False}.get(outcome.timings[4]))
            if not outcome.ok:
                _log.warning("max-autotune choice %s counts as infinitely slow: %s (%s)", _label(choice),
                             outcome.status, (outcome.reason or "").splitlines()[0] if outcome.reason else "")
        return timings

    def shutdown(self) -> None:
        """Inductor's atexit hook: nothing here; the processes go with ``uninstall()``."""

    # -- ours ------------------------------------------------------------------------------

    def warm(self) -> None:
        """Start the benchmark processes the choices will need (Inductor asks for its pool
        before it precompiles), and have them import Inductor meanwhile: the process of
        each GPU the graph being lowered is on; with several GPUs and no graph yet (the
        compile's start), none."""
        try:
            port = self._port()
            if GpuTiming().count() > 0:
                pool = port.tuner().pool()
                graph = _graph_gpus()
                if graph is None and len(pool.devices) > 1:
                    return  # nothing says which GPU the compile is for: none is opened for it
                devices = [d for d in pool.devices if graph is None or d in graph]
            else:
                pool = self._host_pool(port)
                devices = pool.devices
            for device in devices:
                with self._lock:
                    if (id(pool), device) in self._warmed:
                        continue
                    self._warmed.add((id(pool), device))
                task = CallTask("inductor", "warm-up", f"{__name__}:warm_up", b"")
                pool.submit(self._session(pool), task, frozenset({device}))
        except Exception:  # noqa: BLE001 - warming is a head start, never a failure
            _log.debug("could not warm the benchmark processes", exc_info=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            host, self._host = self._host, None
            inductor, self._inductor = self._inductor, None
        if host is not None:
            host.close()
        if inductor is not None:
            inductor.shutdown()

    def _pool_for(self, port: TorchPort, bmreq: Any) -> tuple[BenchPool, frozenset[int]]:
        if bmreq is None:
            raise ValueError("the choice has no benchmark request")
        device = _device_of(bmreq)
        if device is None or device.type == "cpu":
            pool = self._host_pool(port)
            return pool, frozenset(pool.devices)
        pool = port.tuner().pool()
        if not pool.devices:
            raise RuntimeError("no GPU to time this choice on (tuning_devices, or none visible)")
        index = device.index or 0
        return pool, frozenset({index}) if index in pool.devices else frozenset(pool.devices)

    def _inductor_pool(self) -> Any:
        with self._lock:
            if self._inductor is None:
                from torch._inductor import autotune_process

                self._inductor = autotune_process.TuningProcessPool()
            return self._inductor

    def _host_pool(self, port: TorchPort) -> BenchPool:
        with self._lock:
            if self._closed:
                raise RuntimeError("aiocompile.torch was uninstalled")
            if self._host is None:
                self._host = BenchPool(HostTiming(), [0], timeout=port.config.benchmark_timeout)
            return self._host

    def _session(self, pool: BenchPool) -> Session:
        # One empty session per pool: the requests build their own tensors.
        with self._lock:
            session = self._sessions.get(id(pool))
            if session is None:
                session = self._sessions[id(pool)] = Session(Inputs((), ()))
            return session

    def _emit(self, port: TorchPort, choice: Any, outcome: Timed) -> None:
        timings = outcome.timings or (None,)
        port.record_benchmark(BenchmarkRecord(
            name=_name(choice), config=_label(choice), outcome=outcome.status, time_ms=timings[0],
            p20_ms=None, p80_ms=None, reason=outcome.reason, device=outcome.device, device_name=outcome.device_name,
            attempt=outcome.attempt, pid=outcome.pid, started_at=outcome.started_at,
            finished_at=outcome.finished_at))

    def _emit_failure(self, port: TorchPort, choice: Any, status: str, reason: str) -> None:
        now = time.time()
        port.record_benchmark(BenchmarkRecord(
            name=_name(choice), config=_label(choice), outcome=BenchmarkOutcome(status), time_ms=None, p20_ms=None,
            p80_ms=None, reason=reason, device=None, device_name=None, attempt=0, pid=None, started_at=now,
            finished_at=now))


def _name(choice: Any) -> str:
    bmreq = getattr(choice, "bmreq", None)
    return str(getattr(bmreq, "kernel_name", None) or getattr(choice, "name", None) or type(choice).__name__)


def _label(choice: Any) -> str:
    description = getattr(choice, "description", None)
    name = str(getattr(choice, "name", "") or "")
    return f"{name} {description}".strip() if description else name or str(choice)


def _device_of(bmreq: Any) -> Any:
    meta = getattr(bmreq, "output_tensor_meta", None)
    if meta is None:
        metas = getattr(bmreq, "input_tensor_meta", None) or []
        meta = metas[0] if metas else None
    return getattr(meta, "device", None)


def _worker_settings() -> tuple[dict[str, str], dict[str, Any]]:
    """What the compile workers were given with each kernel (the environment Triton's
    cache depends on, Inductor's settings), for the benchmark process to load the same
    binaries."""
    from aiocompile.backends.inductor._backend import worker_settings

    env, _, extra_config = worker_settings()
    for name in _CACHE_VARIABLES:
        if name in os.environ:
            env.setdefault(name, os.environ[name])
    return env, extra_config


def _elsewhere(choice: Any) -> bool:
    device = _device_of(getattr(choice, "bmreq", None))
    return device is not None and device.type not in ("cpu", "cuda")


def _call_task(choice: Any, settings: tuple[dict[str, str], dict[str, Any]]) -> CallTask:
    env, extra_config = settings
    payload = pickle.dumps((env, extra_config, pickle.dumps(choice.bmreq)))
    return CallTask(_name(choice), _label(choice), f"{__name__}:time_request", payload)


def _build_libraries(choices: list[Any], build: Builder) -> dict[int, str]:
    """Build every C++ choice's library in the pool's workers, side by side, where it is
    not built yet; returns why, for each choice whose library did not build."""
    from torch._inductor.autotune_process import CppBenchmarkRequest
    from torch._inductor.codecache import CppCodeCache

    pending: list[tuple[Any, Callable[[], Any]]] = []
    failures: dict[int, str] = {}
    for choice in choices:
        bmreq = getattr(choice, "bmreq", None)
        if not isinstance(bmreq, CppBenchmarkRequest):
            continue
        try:
            pending.append((choice, CppCodeCache.load_async(bmreq.source_code, device_type="cpu", submit_fn=build())))
        except Exception as exc:  # noqa: BLE001 - the choice's failure
            failures[id(choice)] = f"{type(exc).__name__}: {exc}"
    for choice, loaded in pending:
        try:
            loaded()
        except Exception as exc:  # noqa: BLE001 - the choice's failure
            failures[id(choice)] = f"{type(exc).__name__}: {exc}"
    return failures


# -- what install() patches ------------------------------------------------------------------


class Patch:
    """What ``patch`` replaced, for ``unpatch``."""

    def __init__(self, pool: TuningPool) -> None:
        self.pool = pool
        self.getter: Any = None
        self.in_subproc: Any = None
        self.precompile: Any = None


def patch(pool: TuningPool) -> Patch | None:
    """Send Inductor's template benchmarks to ``pool``; None where this torch has no
    tuning pool to stand in for."""
    try:
        from torch._inductor import autotune_process
        from torch._inductor import config as inductor_config
    except ImportError:
        return None
    if not callable(getattr(autotune_process, "get_tuning_process_pool", None)):
        return None
    done = Patch(pool)

    def get_tuning_process_pool() -> TuningPool:
        pool.warm()
        return pool

    setattr(get_tuning_process_pool, _MARK, pool)
    done.getter = autotune_process.get_tuning_process_pool
    setattr(autotune_process, "get_tuning_process_pool", get_tuning_process_pool)  # noqa: B010 - a cached function
    done.in_subproc = inductor_config.autotune_in_subproc
    inductor_config.autotune_in_subproc = True
    cpp_request = getattr(autotune_process, "CppBenchmarkRequest", None)
    if cpp_request is not None and "precompile" in cpp_request.__dict__:
        done.precompile = cpp_request.__dict__["precompile"]
        cpp_request.precompile = _cpp_precompile(done.precompile, pool)
    return done


def unpatch(done: Patch) -> bool:
    """Put back what ``patch`` replaced; False where someone else replaced it meanwhile
    (then left as it is)."""
    from torch._inductor import autotune_process
    from torch._inductor import config as inductor_config

    clean = True
    if getattr(autotune_process.get_tuning_process_pool, _MARK, None) is done.pool:
        autotune_process.get_tuning_process_pool = done.getter
    else:
        clean = False
    if inductor_config.autotune_in_subproc is True:
        inductor_config.autotune_in_subproc = done.in_subproc
    cpp_request = getattr(autotune_process, "CppBenchmarkRequest", None)
    if done.precompile is not None and cpp_request is not None:
        if getattr(cpp_request.__dict__.get("precompile"), _MARK, None) is done.pool:
            cpp_request.precompile = done.precompile
        else:
            clean = False
    done.pool.close()
    return clean


def _cpp_precompile(original: Any, pool: TuningPool) -> Any:
    @functools.wraps(original)
    def precompile(self: Any) -> None:
        # Inductor precompiles choices in threads of this process: the build goes to the
        # pool's workers instead, and the library is loaded here, as Inductor would.
        from torch._inductor.codecache import CppCodeCache

        CppCodeCache.load_async(self.source_code, device_type="cpu", submit_fn=pool.build())()

    setattr(precompile, _MARK, pool)
    return precompile


def _graph_gpus() -> set[int] | None:
    """The CUDA devices of the graph Inductor is lowering now, or None where it is lowering
    none (or says nothing of its devices): a model on ``cuda:1`` needs no process on GPU 0."""
    try:
        from torch._inductor.virtualized import V

        graph = V.graph
        if getattr(graph, "device_type", None) != "cuda":
            return None
        indices = {int(index) for index in getattr(graph, "device_idxs", ()) if index is not None}
    except Exception:  # noqa: BLE001 - a guide for warming only
        return None
    return indices or None
