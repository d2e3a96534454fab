"""Compiler backends: one module per compiler behind one small interface.

A backend turns the user's arguments into a :class:`Request`: the key that identifies the
result, the module-level function a worker runs (and its picklable arguments), and how the
parent turns what the worker returned into the user's result. The scheduler only ever
sees requests, so it never branches on the language; adding a compiler is one new module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple, Protocol


class Request(NamedTuple):
    """One compile (or other job), as the scheduler sees it. Immutable; a typed named tuple
    rather than a frozen dataclass because one is made for every ``run()``, where a frozen
    dataclass's constructor would be a noticeable part of a trivial job's round trip."""

    backend: str
    key: str | None
    name: str
    target: str | None
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    finish: Callable[[Any], Any] | None
    """The worker's answer -> the result (in the parent); None: the answer is the result."""
    encode: Callable[[Any], bytes] | None = None
    """The result -> bytes for the disk cache (None: results are not kept on disk)."""
    decode: Callable[[bytes], Any] | None = None
    """Bytes from the disk cache -> the result; raises ``ValueError`` for bad bytes."""
    size: Callable[[Any], int] | None = None
    """Bytes a result holds, for the memory cache's bound."""
    details: Callable[[Any], Mapping[str, Any]] | None = None
    """The worker's answer -> what the job's record should say about the compiler:
    ``stages`` (``(stage, seconds)`` pairs) and ``compiler_cache_hit``."""
    direct: bool = False
    """The answer is small and awaited in the submitting thread's event loop, which may
    then read it from the worker itself (``WorkerPool.submit_job(direct=True)``)."""
    features: tuple[tuple[str, float], ...] = ()
    """What is known of the compile's cost before it runs, as ``(name, value)`` pairs, for
    predicting it (``_core.costs``): ``source`` (log2 of the source's bytes) from any backend
    that has a source; from Triton also ``tile``, ``warps``, ``dot`` and ``stages``."""
    subject: str = "kernel"
    """What ``name`` names, in the messages of the job's errors: a ``kernel``, or the
    ``function`` a ``run()`` runs."""


class SpecBackend(Protocol):
    """A backend as ``compile_many`` sees it: a spec names its backend by its ``"kind"``
    (``"triton"`` when it names none), and the rest of the spec is the backend's."""

    needs: tuple[str, ...]
    """The keys every spec of this kind must have."""

    def label(self, spec: Mapping[str, Any]) -> str:
        """A name for the spec in progress lines, where it has no ``"label"``."""
        ...

    async def prepare_specs(self, ctx: BackendContext, specs: list[dict[str, Any]],
                            timeouts: Sequence[float | None] | None = None) -> list[Request | Exception]:
        """A request for each spec (or the exception its checks raised), in order;
        ``timeouts`` are the specs' own, for the work a key may need in a worker."""
        ...


class BackendContext(Protocol):
    """What a backend may ask of the scheduler while it prepares a request."""

    async def run_in_worker(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
                            name: str | None = None) -> Any:
        """``fn(*args)`` in a worker process, for the backend itself (not counted as a
        request): ``JobTimeout`` past ``timeout`` (None: the scheduler's default); killed
        when the await is cancelled, as nobody else waits for it."""
        ...

    async def to_thread(self, fn: Callable[[], Any]) -> Any: ...



def source_features(source: str) -> tuple[tuple[str, float], ...]:
    """The features of a compile known by its source alone (C++, CUDA, an Inductor
    kernel's module): log2 of the source's size in bytes, the cost model's ``source`` term
    (see ``aiocompile._core.costs``)."""
    return (("source", math.log2(max(len(source.encode("utf-8", errors="surrogatepass")), 1))),)
