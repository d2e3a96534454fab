"""What the C++ and CUDA backends share on the parent's side: arguments checked at the
boundary (in the caller's thread: types and values only, microseconds), then the compiler
found and asked what it is, the flags' files read, the headers scanned and the key made in
the key thread, in one trip there per request (or per ``compile_many`` batch).

A source whose includes the scan cannot follow (``#include HEADER_MACRO``) needs the
compiler's own answer (``-MM``) before it has a key. That pass runs the compiler over the
caller's source, which may take as long as the source likes (an include of a FIFO never
ends), so it does not run in the key thread, which every request of the process shares:
it runs in a worker, as a compile does, under the request's timeout (``JobTimeout``),
killed with its worker when the caller is cancelled, and dying with the parent as every
compiler does. The key thread meanwhile keys other requests, and other workers compile.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import anyio

from aiocompile.backends import BackendContext, Request
from aiocompile.backends._native import _run
from aiocompile.backends._native._headers import HeaderIndex, Scan, SearchPath
from aiocompile.errors import JobTimeout

__all__ = ["NativeBackend", "Plan", "key_of"]


def key_of(payload: Mapping[str, Any]) -> str:
    """A key from plain values: SHA-256 of their canonical JSON."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def record_details(answer: dict[str, Any]) -> dict[str, Any]:
    """What a compiler run's answer adds to its timing record: the compiler's stage times
    (nvcc's ``--time`` phases; one ``compile`` stage for g++), and no compiler cache."""
    stages: Sequence[tuple[str, float]] = answer.get("stages", ())
    return {"stages": tuple((str(s), float(t)) for s, t in stages), "compiler_cache_hit": None}


@dataclass(frozen=True)
class Plan:
    """A request made but for the headers, which ``finish`` takes: everything a backend
    knows from its arguments, its compiler and the flags' files."""

    name: str
    search: SearchPath
    dependency_pass: _run.DependencyPass
    """How to ask the compiler for the headers, where the scan cannot name them all."""
    finish: Callable[[Scan], Request]


@dataclass(frozen=True)
class _Waiting:
    """A plan whose scan met an include it could not follow: the dependency pass is next."""

    plan: Plan
    scan: Scan


class NativeBackend:
    """A backend whose compiles run a compiler program. Subclasses say which arguments
    they take (``fields``), check them (``check``, in the caller's thread) and plan the
    request (``plan``, in the key thread: it runs the compiler's ``--version`` and reads
    files)."""

    kind = ""
    needs: tuple[str, ...] = ("source",)
    fields: frozenset[str] = frozenset()
    check: Callable[..., Any]
    """The arguments (keywords), checked: ``TypeError``/``ValueError`` for bad ones."""
    plan: Callable[[Any], Plan]
    """``check``'s answer -> the request's plan."""

    def __init__(self) -> None:
        self.headers = HeaderIndex()

    def label(self, spec: Mapping[str, Any]) -> str:
        return str(spec.get("name") or self.kind)

    def sweep(self) -> None:
        """Remove the scratch directories of workers that are gone (a compile or a
        dependency pass killed for its timeout cannot remove its own): for a scheduler
        whose workers have all exited."""
        _run.sweep()

    def _first(self, checked: Any) -> Request | _Waiting:
        """In the key thread: the request, or what its dependency pass needs."""
        plan = self.plan(checked)
        scan = self.headers.scan(plan.dependency_pass.source, plan.search)
        return plan.finish(scan) if scan.complete else _Waiting(plan, scan)

    async def _then(self, ctx: BackendContext, first: Request | _Waiting, timeout: float | None) -> Request:
        """The request, once the compiler has named the headers where it had to."""
        if not isinstance(first, _Waiting):
            return first
        plan = first.plan
        try:
            named = await ctx.run_in_worker(_run.dependencies, plan.dependency_pass, timeout=timeout,
                                            name=f"{plan.name} (dependency pass)")
        except JobTimeout as exc:
            raise JobTimeout(
                f"the compiler's dependency pass (-MM, which names the headers of an #include computed by a macro, "
                f"for the key) did not finish within {exc.timeout:g} s; its worker was killed",
                timeout=exc.timeout, kernel_name=plan.name, output=exc.output) from None
        # None: the source does not preprocess, and its compile will say why.
        request: Request = await ctx.to_thread(
            lambda: plan.finish(self.headers.scan(plan.dependency_pass.source, plan.search, extra=named or ())))
        return request

    async def prepare(self, ctx: BackendContext, *, timeout: float | None = None, **arguments: Any) -> Request:
        """Check the arguments (``TypeError``/``ValueError`` at once), then key and build
        the request in the key thread (``CompilerNotFound`` there, before any worker),
        after the compiler's dependency pass in a worker where the key needs it (bounded
        by ``timeout``, killed if the await is cancelled)."""
        checked = self.check(**arguments)
        first: Request | _Waiting = await ctx.to_thread(lambda: self._first(checked))
        return await self._then(ctx, first, timeout)

    async def prepare_specs(self, ctx: BackendContext, specs: list[dict[str, Any]],
                            timeouts: Sequence[float | None] | None = None) -> list[Request | Exception]:
        """``prepare`` for each spec of a ``compile_many`` batch, in one trip to the key
        thread (and the dependency passes that some need side by side, each under its
        spec's timeout); a spec that fails gets its exception in its place."""
        checked: list[Any] = []
        for spec in specs:
            try:
                unknown = sorted(set(spec) - self.fields)
                if unknown:
                    raise TypeError(f"a {self.kind!r} spec takes {', '.join(sorted(self.fields))}; "
                                    f"not {', '.join(map(repr, unknown))}")
                checked.append(self.check(**spec))
            except Exception as exc:
                checked.append(exc)

        def first_all() -> list[Request | _Waiting | Exception]:
            out: list[Request | _Waiting | Exception] = []
            for item in checked:
                if isinstance(item, Exception):
                    out.append(item)
                    continue
                try:
                    out.append(self._first(item))
                except Exception as exc:
                    out.append(exc)
                time.sleep(0)  # the interpreter lock released: a waiting event loop may take it now
            return out

        firsts: list[Request | _Waiting | Exception] = await ctx.to_thread(first_all)
        prepared: list[Request | Exception] = [item if not isinstance(item, _Waiting) else TypeError("not prepared")
                                               for item in firsts]

        async def then(index: int, waiting: _Waiting) -> None:
            try:
                prepared[index] = await self._then(ctx, waiting, timeouts[index] if timeouts else None)
            except Exception as exc:
                prepared[index] = exc

        async with anyio.create_task_group() as group:
            for index, item in enumerate(firsts):
                if isinstance(item, _Waiting):
                    group.start_soon(then, index, item)
        return prepared
