"""What the C++ and CUDA backends share on the parent's side: arguments checked at the
boundary (in the caller's thread: types and values only, microseconds), then the compiler
found and asked what it is, the headers scanned and the key made in the key thread, in
one trip there per request (or per ``compile_many`` batch)."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from aiocompile.backends import BackendContext, Request
from aiocompile.backends._native._headers import HeaderIndex, Scan, SearchPath, compiler_dependencies

__all__ = ["NativeBackend", "key_of", "keyed_headers"]


def key_of(payload: Mapping[str, Any]) -> str:
    """A key from plain values: SHA-256 of their canonical JSON."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def record_details(answer: dict[str, Any]) -> dict[str, Any]:
    """What a compiler run's answer adds to its timing record: the compiler's stage times
    (nvcc's ``--time`` phases; one ``compile`` stage for g++), and no compiler cache."""
    stages: Sequence[tuple[str, float]] = answer.get("stages", ())
    return {"stages": tuple((str(s), float(t)) for s, t in stages), "compiler_cache_hit": None}


def keyed_headers(index: HeaderIndex, compiler_argv: Sequence[str], source: str, suffix: str) -> Scan:
    """The headers a source's key covers: a scan of its include lines; where the scan
    meets an include it cannot follow, also those the compiler's ``-MM`` names."""
    search = SearchPath.from_argv(compiler_argv[1:])
    scan = index.scan(source, search)
    if scan.complete:
        return scan
    named = compiler_dependencies(compiler_argv, source, suffix)
    if named is None:
        return scan
    return index.scan(source, search, extra=named)


class NativeBackend:
    """A backend whose compiles run a compiler program. Subclasses say which arguments
    they take (``fields``), check them (``check``, in the caller's thread) and build the
    request (``build``, in the key thread: it runs programs and reads files)."""

    kind = ""
    needs: tuple[str, ...] = ("source",)
    fields: frozenset[str] = frozenset()
    check: Callable[..., Any]
    """The arguments (keywords), checked: ``TypeError``/``ValueError`` for bad ones."""
    build: Callable[[Any], Request]
    """``check``'s answer -> the request, with its key."""

    def __init__(self) -> None:
        self.headers = HeaderIndex()

    def label(self, spec: Mapping[str, Any]) -> str:
        return str(spec.get("name") or self.kind)

    async def prepare(self, ctx: BackendContext, **arguments: Any) -> Request:
        """Check the arguments (``TypeError``/``ValueError`` at once), then key and build
        the request in the key thread (``CompilerNotFound`` there, before any worker)."""
        checked = self.check(**arguments)
        request: Request = await ctx.to_thread(lambda: self.build(checked))
        return request

    async def prepare_specs(self, ctx: BackendContext, specs: list[dict[str, Any]]) -> list[Request | Exception]:
        """``prepare`` for each spec of a ``compile_many`` batch, in one trip to the key
        thread; a spec that fails gets its exception in its place."""
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

        def build_all() -> list[Request | Exception]:
            out: list[Request | Exception] = []
            for item in checked:
                if isinstance(item, Exception):
                    out.append(item)
                    continue
                try:
                    out.append(self.build(item))
                except Exception as exc:
                    out.append(exc)
                time.sleep(0)  # the interpreter lock released: a waiting event loop may take it now
            return out

        prepared: list[Request | Exception] = await ctx.to_thread(build_all)
        return prepared
