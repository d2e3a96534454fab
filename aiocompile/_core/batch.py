"""``compile_many``: a batch of specs of any kind, each keyed by its backend, then admitted
longest first.

A spec names its backend by its ``"kind"`` (``"triton"`` when it names none); ``"timeout"``
and ``"label"`` are the batch's, the rest is the backend's. Every key is made before any
compile is admitted, each kind's specs in one trip to its key thread, so that the compiles
can start longest first: a batch ends when its last compile does, and a long one started
last would run alone at the end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import anyio

from aiocompile._base import checks, threads
from aiocompile._core.costs import longest_first
from aiocompile.backends import Request

if TYPE_CHECKING:
    from aiocompile._core.engine import Engine

__all__ = ["compile_batch"]


async def compile_batch(
    engine: Engine,
    specs: Iterable[Mapping[str, Any]],
    *,
    progress: bool,
    return_exceptions: bool,
) -> list[Any]:
    """``Scheduler.compile_many``: its docstring says what it does."""
    checks.Flag().check("progress", progress)
    checks.Flag().check("return_exceptions", return_exceptions)
    spec_list = [dict(spec) for spec in specs]
    kinds = [checks.SPEC_KIND.check(f"kind of spec #{index}", spec.pop("kind", "triton"))
             for index, spec in enumerate(spec_list)]
    for index, (kind, spec) in enumerate(zip(kinds, spec_list)):
        for needed in engine.backend(kind).needs:
            if needed not in spec:
                raise TypeError(f"spec #{index} has no {needed!r}")
    results: list[Any] = [None] * len(spec_list)
    requests: list[Request | None] = [None] * len(spec_list)
    timeouts: list[float | None] = [spec.pop("timeout", None) for spec in spec_list]
    for index, timeout in enumerate(timeouts):
        checks.CALL_TIMEOUT.check(f"timeout of spec #{index}", timeout)
    labels = [str(spec.pop("label", None) or engine.backend(kind).label(spec))
              for kind, spec in zip(kinds, spec_list)]
    first_error: list[BaseException] = []
    bar = engine.progress(len(spec_list), progress)

    def failed(index: int, exc: Exception, scope: anyio.CancelScope) -> None:
        bar.finished(labels[index], ok=False)
        if return_exceptions:
            results[index] = exc
        elif not first_error:
            first_error.append(exc)
            scope.cancel()

    async def execute(index: int, request: Request, admitted: Any, scope: anyio.CancelScope) -> None:
        try:
            results[index] = await engine.result(request, admitted)
        except Exception as exc:
            failed(index, exc, scope)
            return
        bar.finished(labels[index], ok=True)

    try:
        await threads.LOADS.run(engine.costs.load)
        # First every key (checked arguments, then each backend's key: one trip to the key
        # thread per kind, in order), so that the compiles can start longest first: a batch
        # ends when its last compile does, and a long one started last runs alone at the end.
        unstarted = anyio.CancelScope()  # nothing has started yet for a failure to cancel
        for index, prepared in enumerate(await _prepare(engine, kinds, spec_list, timeouts)):
            if isinstance(prepared, Exception):
                failed(index, prepared, unstarted)
            else:
                requests[index] = prepared
        if not first_error:
            ready = [(index, request) for index, request in enumerate(requests) if request is not None]
            estimates = [engine.costs.estimate(r.key, r.name, r.backend, r.target, r.features) for _, r in ready]
            async with anyio.create_task_group() as group:
                # Admitted here, in this order, and not by the tasks: the pool's queue is
                # first come first served, while the order in which new tasks take their
                # first step is up to the event loop (trio shuffles it on purpose).
                for count, position in enumerate(longest_first(estimates), 1):
                    if count % 8 == 0:
                        # A thousand admissions in one go would hold the loop for tens
                        # of milliseconds; those admitted so far have their tasks.
                        await anyio.lowlevel.checkpoint()
                    index, request = ready[position]
                    try:
                        admitted = engine.admit(request, timeouts[index])
                    except Exception as exc:
                        failed(index, exc, group.cancel_scope)
                        if first_error:
                            break
                        continue
                    group.start_soon(execute, index, request, admitted, group.cancel_scope)
    finally:
        bar.close()
        threads.LOADS.submit(engine.costs.save)
    if first_error:
        raise first_error[0]
    return results


async def _prepare(engine: Engine, kinds: list[str], specs: list[dict[str, Any]],
                   timeouts: list[float | None]) -> list[Request | Exception]:
    """Each spec's request (or its exception), in order: one batch per kind."""
    prepared: list[Request | Exception] = [TypeError("not prepared")] * len(specs)
    for kind in dict.fromkeys(kinds):
        indices = [index for index, k in enumerate(kinds) if k == kind]
        batch = await engine.backend(kind).prepare_specs(engine, [specs[i] for i in indices],
                                                         [timeouts[i] for i in indices])
        for index, request in zip(indices, batch):
            prepared[index] = request
    return prepared
