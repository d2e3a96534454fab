"""Waiting for many compiles at once (``Scheduler.wait``): coroutines, tasks, futures, and
PyTorch Inductor's compile futures, awaited concurrently."""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any, Callable

import anyio

from aiocompile._base import bridge
from aiocompile._observe.progress import Progress


async def wait_many(awaitables: Any, make_bar: Callable[[int], Progress], return_exceptions: bool) -> Any:
    """``Scheduler.wait``'s work (see its docstring); ``make_bar(total)`` makes its
    progress bar."""
    if isinstance(awaitables, MutableMapping):
        scope: MutableMapping[Any, Any] | None = awaitables
        items = [(name, value) for name, value in list(awaitables.items()) if _is_waitable(value)]
    elif isinstance(awaitables, Iterable) and not isinstance(awaitables, (str, bytes)):
        scope = None
        items = list(enumerate(awaitables))
        for index, value in items:
            if not _is_waitable(value):
                raise TypeError(f"item #{index} is not awaitable: {value!r}")
    else:
        raise TypeError(f"wait() takes an iterable of awaitables or a mapping, got {type(awaitables).__name__}")
    # One await per distinct object: a coroutine cannot be awaited twice.
    distinct: dict[int, Any] = {}
    for _, value in items:
        distinct.setdefault(id(value), value)
    outcome: dict[int, Any] = {}
    first_error: list[BaseException] = []
    bar = make_bar(len(distinct))

    async def one(ident: int, value: Any, scope_: anyio.CancelScope) -> None:
        try:
            if isinstance(value, cf.Future):
                result = await bridge.wait(value)
            elif _is_inductor_future(value):
                result = await _await_inductor_future(value)
            else:
                result = await value
        except Exception as exc:
            bar.finished(type(exc).__name__, ok=False)
            outcome[ident] = exc
            if not return_exceptions and not first_error:
                first_error.append(exc)
                scope_.cancel()
            return
        bar.finished(str(getattr(result, "name", "") or ""), ok=True)
        outcome[ident] = result

    try:
        async with anyio.create_task_group() as group:
            for ident, value in distinct.items():
                group.start_soon(one, ident, value, group.cancel_scope)
    finally:
        bar.close()
        for value in distinct.values():
            if inspect.iscoroutine(value) and id(value) not in outcome:
                value.close()  # never started: no "was never awaited" warning
    if first_error:
        raise first_error[0]
    if scope is not None:
        for name, value in items:
            scope[name] = outcome[id(value)]
        return scope
    return [outcome[id(value)] for _, value in items]



def _is_inductor_future(value: Any) -> bool:
    """An Inductor compile future (``LambdaFuture`` and kin, with a blocking
    ``result()``), recognised without importing torch."""
    codecache = sys.modules.get("torch._inductor.codecache")
    base = getattr(codecache, "CodeCacheFuture", None)
    return isinstance(base, type) and isinstance(value, base)


async def _await_inductor_future(value: Any) -> Any:
    # Wait for the compile itself without holding a thread, where the future shows it (an
    # Inductor LambdaFuture carries the worker's concurrent future); then take the result,
    # which may load the kernel, in a thread. Its error, if any, comes from result(), in
    # Inductor's words.
    inner = getattr(value, "future", None)
    if isinstance(inner, cf.Future):
        try:
            await bridge.wait(inner)
        except Exception:
            pass
    return await anyio.to_thread.run_sync(value.result)


def _is_waitable(value: Any) -> bool:
    return isinstance(value, cf.Future) or inspect.isawaitable(value) or _is_inductor_future(value)


