"""Where the time of a max-autotune compile goes: a timeline for ``bench_maxautotune.py``
(with ``BENCH_MAXAUTOTUNE_TRACE=1``), in the measured process.

It records, relative to the start of the clock: when Inductor submitted each matmul's
choices and how long it then waited for them (its "precompiling"), whether stock Inductor
compiled them in its compile pool or in threads of this process, every Triton compile in
this process (its stages, cache hits), and with aiocompile every job of the pool (queued,
started, finished, its run time and Triton's stage times), when each worker started and
finished its warm-up, and what ``InductorArtifact.ready`` cost here. ``summary()`` is a
handful of lines; ``data`` holds everything.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from typing import Any


class Trace:
    def __init__(self, started: float) -> None:
        self.started = started
        self.data: dict[str, list[Any]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def at(self) -> float:
        return round(time.time() - self.started, 3)

    def add(self, kind: str, *values: Any) -> None:
        with self._lock:
            self.data[kind].append(values)

    # -- hooks -------------------------------------------------------------------------

    def hook_inductor(self) -> None:
        """Inductor's side, stock or not: precompile submissions and waits, choices
        precompiled in threads here, the answers of ``use_process_pool``, Triton compiles
        in this process."""
        from torch._inductor import async_compile, select_algorithm

        make = select_algorithm.AlgorithmSelectorCache.make_precompile_fn
        trace = self

        def make_precompile_fn(selector: Any, choices: Any, name: str, *args: Any, **kwargs: Any) -> Any:
            begun = trace.at()
            fn = make(selector, choices, name, *args, **kwargs)
            trace.add("submitted", name, len(choices), begun, trace.at())

            def wait(*a: Any, **k: Any) -> Any:
                begun = trace.at()
                try:
                    return fn(*a, **k)
                finally:
                    trace.add("waited", name, begun, trace.at())

            wait.precompile_key = getattr(fn, "precompile_key", None)  # type: ignore[attr-defined]
            return wait

        setattr(select_algorithm.AlgorithmSelectorCache, "make_precompile_fn", make_precompile_fn)  # noqa: B010
        caller = select_algorithm.TritonTemplateCaller
        precompile = caller.precompile

        def choice_precompile(choice: Any) -> Any:
            begun = trace.at()
            try:
                return precompile(choice)
            finally:
                trace.add("thread_precompile", begun, trace.at(), threading.current_thread().name)

        setattr(caller, "precompile", choice_precompile)  # noqa: B010
        use_pool = async_compile.AsyncCompile.__dict__["use_process_pool"]

        def use_process_pool(cls: Any) -> bool:
            answer = bool(use_pool.__get__(None, cls)())
            trace.add("use_process_pool", trace.at(), answer)
            return answer

        setattr(async_compile.AsyncCompile, "use_process_pool", classmethod(use_process_pool))  # noqa: B010
        try:
            from triton import knobs
        except ImportError:
            return
        previous = knobs.compilation.listener

        def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
            stages = {} if cache_hit else {"make_ir": times.ir_initialization / 1e6,
                                           **{str(n): d / 1e6 for n, d in times.lowering_stages}}
            trace.add("parent_triton", trace.at(), bool(cache_hit), stages, threading.current_thread().name)
            if previous is not None:
                previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

        knobs.compilation.listener = listener

    def hook_aiocompile(self, sched: Any) -> None:
        """aiocompile's side: every job and worker event, and the parent's ``ready()``."""
        from aiocompile.backends.inductor import _backend
        from aiocompile.records import JobRecord, WorkerEvent

        def on_event(event: Any) -> None:
            if isinstance(event, JobRecord):
                self.add("job", event.name, round(event.queued_at - self.started, 3),
                         None if event.started_at is None else round(event.started_at - self.started, 3),
                         round(event.finished_at - self.started, 3), event.run_time, dict(event.stages),
                         event.worker_pid, event.compiler_cache_hit, event.outcome, event.load_time)
            elif isinstance(event, WorkerEvent):
                self.add("worker", event.event, round(event.time - self.started, 3), event.pid, event.status,
                         event.warm_up,
                         None if event.started_at is None else round(event.started_at - self.started, 3))

        sched.subscribe(on_event)
        ready = _backend.InductorArtifact.ready
        trace = self

        def traced_ready(artifact: Any, compile_info: Any = None) -> Any:
            was = artifact.is_ready
            begun = trace.at()
            try:
                return ready(artifact, compile_info)
            finally:
                trace.add("ready", begun, trace.at(), was, threading.current_thread().name)

        setattr(_backend.InductorArtifact, "ready", traced_ready)  # noqa: B010

    # -- the summary -------------------------------------------------------------------

    def summary(self) -> list[str]:
        d = self.data
        lines = []
        for name, count, begun, ended in d["submitted"]:
            lines.append(f"{name}: {count} choices submitted at {begun}-{ended} s")
        for name, begun, ended in d["waited"]:
            lines.append(f"{name}: waited for its choices {begun}-{ended} s ({ended - begun:.2f} s)")
        answers = d["use_process_pool"]
        if answers:
            first = next((t for t, a in answers if a), None)
            lines.append(f"use_process_pool: {collections.Counter(a for _, a in answers)}, first true at {first}")
        threaded = d["thread_precompile"]
        if threaded:
            lines.append(f"choices precompiled in threads here: {len(threaded)}, {min(t[0] for t in threaded)}-"
                         f"{max(t[1] for t in threaded)} s, longest {max(t[1] - t[0] for t in threaded):.2f} s")
        compiles = d["parent_triton"]
        if compiles:
            built = [c for c in compiles if not c[1]]
            lines.append(f"Triton compiles here: {len(compiles)} ({len(built)} built, {len(compiles) - len(built)} "
                         f"cache hits); stages summed over the built: {_stage_sums(c[2] for c in built)}")
            if built:
                lines.append(f"  built ones, per compile: {_per_compile(c[2] for c in built)}")
        jobs = [j for j in d["job"] if j[2] is not None]
        if jobs:
            run = [j[4] for j in jobs if j[4]]
            lines.append(f"pool jobs: {len(jobs)}, queued {min(j[1] for j in jobs)}-{max(j[1] for j in jobs)} s, "
                         f"started {min(j[2] for j in jobs)}-{max(j[2] for j in jobs)} s, finished "
                         f"{min(j[3] for j in jobs)}-{max(j[3] for j in jobs)} s; run time median "
                         f"{statistics.median(run):.2f} s, max {max(run):.2f} s, sum {sum(run):.1f} s; longest wait "
                         f"for a worker {max(j[2] - j[1] for j in jobs):.2f} s")
            lines.append(f"  Triton stages summed over the jobs: {_stage_sums(j[5] for j in jobs)}")
            lines.append(f"  per job: {_per_compile(j[5] for j in jobs)}")
            first = sorted(jobs, key=lambda j: j[1])[:3]
            lines.append("  first jobs: " + "; ".join(f"{j[0][:28]} q {j[1]} s {j[2]} f {j[3]} run {j[4]:.2f}"
                                                      for j in first))
        workers = d["worker"]
        started = sorted(w[1] for w in workers if w[0] == "worker_started")
        if started:
            lines.append(f"workers started: {len(started)}, {started[0]}-{started[-1]} s")
        warmups = [w for w in workers if w[0] == "job_ended" and w[4]]
        if warmups:
            lines.append(f"warm-ups: {len(warmups)}, {min(w[5] for w in warmups if w[5] is not None)}-"
                         f"{max(w[1] for w in warmups)} s, longest "
                         f"{max(w[1] - w[5] for w in warmups if w[5] is not None):.2f} s")
        readies = d["ready"]
        if readies:
            cost = [r[1] - r[0] for r in readies if not r[2]]
            lines.append(f"ready() here: {len(readies)} calls, {len(cost)} first ones summing {sum(cost):.2f} s")
        return lines


def _stage_sums(stage_dicts: Any) -> str:
    totals: dict[str, float] = collections.defaultdict(float)
    for stages in stage_dicts:
        for name, seconds in stages.items():
            totals[name] += seconds
    return ", ".join(f"{name} {seconds:.1f}" for name, seconds in totals.items())


def _per_compile(stage_dicts: Any) -> str:
    totals = [sum(stages.values()) for stages in stage_dicts if stages]
    if not totals:
        return "-"
    return f"median {statistics.median(totals):.2f} s, max {max(totals):.2f} s over {len(totals)}"
