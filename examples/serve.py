"""An HTTP service that compiles Triton kernels on demand, while it keeps answering.

Each kernel request names a row length; the service needs a kernel specialised for it
(``BLOCK``, the next power of two, is a compile-time constant), compiles it the first time
that block size is asked for, and answers from memory after that::

    pip install -e ".[serve]"
    python examples/serve.py --port 8000
    curl 'http://127.0.0.1:8000/softmax?cols=1000'
    curl 'http://127.0.0.1:8000/layernorm?cols=3000&rows=64'
    curl  http://127.0.0.1:8000/metrics

It is a plain ASGI application (``create_app()``; ``uvicorn --factory serve:create_app
--app-dir examples`` serves it too) run by uvicorn.

Endpoints (GET):

- ``/softmax?cols=N[&rows=R]``, ``/layernorm?cols=N[&rows=R]``: the kernel of
  ``examples/kernels.py`` for ``BLOCK = next_power_of_two(N)`` (``1 <= N <= 16384``, ``R``
  rows, default 8, at most 4096). JSON: the kernel's name, key (Triton's hash), target,
  block, warps, the outcome of this request (``compiled``, ``joined`` another request's
  compile, ``cache_hit``), the kernel's compile time and how long this request waited for
  it. Where torch sees a GPU and no target was forced, the kernel also runs on an R x N
  input and the answer carries its largest error against torch (a wrong result is a 500).
- ``/healthz``: answers at once.
- ``/metrics``: Prometheus text, from ``aiocompile.prometheus.SchedulerCollector`` in the
  service's own registry.

Bad input (a missing, malformed or out-of-range ``cols`` or ``rows``, an unknown
parameter) gets a 400 saying what is wrong, an unknown path a 404.

Configuration (flags, or the environment variables they default to):

- ``--mode aiocompile`` (``AIOCOMPILE_SERVE_MODE``): compile in aiocompile's worker pool.
  ``--mode loop`` compiles with ``triton.compile`` in the request handler, in the event
  loop's thread, as code that does not hand compiles off does; every other request waits.
  ``benchmarks/bench_serving.py`` compares the two.
- ``--target`` (``AIOCOMPILE_SERVE_TARGET``): ``auto`` (the default) is the current GPU
  when torch sees one, else ``cuda:90``, compiled for on the CPU. Or any target such as
  ``cuda:80`` or ``hip:gfx942``: compiled for, never launched.
- ``--workers`` and the scheduler's own ``AIOCOMPILE_*`` variables (see
  ``aiocompile.SchedulerConfig``).

The scheduler is created when the server starts (ASGI lifespan), its workers warmed, and
closed with ``aclose()`` when it stops.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl

import anyio
import triton
from kernels import add_kernel, layer_norm_kernel, softmax_kernel
from triton.compiler import ASTSource

import aiocompile
import aiocompile.records

MAX_COLS = 16384
MAX_ROWS = 4096
DEFAULT_ROWS = 8
MODES = ("aiocompile", "loop")

log = logging.getLogger("serve")

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


# -- configuration -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the service compiles: ``mode`` (``aiocompile`` or ``loop``), ``target``
    (``auto`` or a target such as ``cuda:90``) and, for aiocompile, ``workers`` (None: the
    scheduler's default) and whether to ``warm`` them at start-up."""

    mode: str = "aiocompile"
    target: str = "auto"
    workers: int | None = None
    warm: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.target != "auto":
            parse_target(self.target)
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ServeConfig:
        return cls(mode=environ.get("AIOCOMPILE_SERVE_MODE", "").strip() or "aiocompile",
                   target=environ.get("AIOCOMPILE_SERVE_TARGET", "").strip() or "auto")


def parse_target(text: str) -> aiocompile.Target:
    """``cuda:90`` or ``hip:gfx942`` as an ``aiocompile.Target`` (the loop mode hands
    ``triton.compile`` its ``GPUTarget``)."""
    backend, _, arch = text.strip().lower().partition(":")
    if backend == "cuda" and arch.isdigit():
        return aiocompile.Target("cuda", int(arch), 32)
    if backend == "hip" and arch.startswith("gfx"):
        return aiocompile.Target("hip", arch, 64 if arch.startswith("gfx9") else 32)
    raise ValueError(f"unknown target {text!r}: expected 'auto' or one such as 'cuda:90' or 'hip:gfx942'")


# -- the kernels ----------------------------------------------------------------------------


class BadRequest(ValueError):
    """The request asked for something the service does not serve: a 400."""


@dataclasses.dataclass(frozen=True)
class Op:
    """A kernel endpoint: the kernel, its signature, and how to run and check it on a GPU.
    ``BLOCK`` is each kernel's last argument and only constexpr."""

    kernel: Any
    signature: Mapping[str, str]
    check: Callable[[Callable[..., None], int, int], dict[str, Any]]

    @staticmethod
    def specialise(cols: int) -> tuple[int, int]:
        """``(BLOCK, num_warps)`` for rows of ``cols`` values: the whole row in one block,
        more warps for longer rows."""
        block = 1 << (cols - 1).bit_length()
        return block, 4 if block <= 2048 else 8 if block <= 8192 else 16


def _check_softmax(launch: Callable[..., None], rows: int, cols: int) -> dict[str, Any]:
    import torch

    x = torch.randn(rows, cols, device="cuda")
    out = torch.empty_like(x)
    launch((rows, 1, 1), out, x, x.stride(0), out.stride(0), cols)
    return _verdict(out, torch.softmax(x, dim=-1), rtol=1.3e-6, atol=1e-5)


def _check_layer_norm(launch: Callable[..., None], rows: int, cols: int) -> dict[str, Any]:
    import torch

    x = torch.randn(rows, cols, device="cuda", dtype=torch.float16)
    weight = torch.randn(cols, device="cuda", dtype=torch.float16)
    bias = torch.randn(cols, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    launch((rows, 1, 1), x, y, weight, bias, x.stride(0), cols, 1e-5)
    expected = torch.nn.functional.layer_norm(x.float(), (cols,), weight.float(), bias.float(), 1e-5)
    return _verdict(y.float(), expected, rtol=1e-2, atol=1e-2)


def _verdict(actual: Any, expected: Any, *, rtol: float, atol: float) -> dict[str, Any]:
    """Whether the kernel's output is torch's (within the tolerances of tests/test_gpu.py),
    and their largest difference (null for NaN, which is no JSON number)."""
    import torch

    error = (actual - expected).abs().max().item()
    correct = bool(torch.allclose(actual, expected, rtol=rtol, atol=atol))
    return {"max_abs_error": error if math.isfinite(error) else None, "correct": correct}


OPS = {
    "/softmax": Op(softmax_kernel, {"out_ptr": "*fp32", "in_ptr": "*fp32", "in_row_stride": "i32",
                                    "out_row_stride": "i32", "n_cols": "i32"}, _check_softmax),
    "/layernorm": Op(layer_norm_kernel, {"x_ptr": "*fp16", "y_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16",
                                         "row_stride": "i32", "n_cols": "i32", "eps": "fp32"}, _check_layer_norm),
}


def parse_query(query: bytes) -> tuple[int, int]:
    """``(cols, rows)`` from a kernel request's query string, or ``BadRequest``."""
    try:
        pairs = parse_qsl(query.decode("ascii"), keep_blank_values=True, strict_parsing=bool(query))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"malformed query string: {exc}") from None
    params: dict[str, str] = {}
    for name, value in pairs:
        if name not in ("cols", "rows"):
            raise BadRequest(f"unknown query parameter {name!r}: expected cols and optionally rows")
        if name in params:
            raise BadRequest(f"query parameter {name!r} given twice")
        params[name] = value
    if "cols" not in params:
        raise BadRequest("missing query parameter 'cols' (the row length, 1 to 16384)")

    def integer(name: str, text: str, most: int) -> int:
        if not text.isdigit():
            raise BadRequest(f"{name} must be a whole number from 1 to {most}, got {text!r}")
        value = int(text)
        if not 1 <= value <= most:
            raise BadRequest(f"{name} must be from 1 to {most}, got {value}")
        return value

    cols = integer("cols", params["cols"], MAX_COLS)
    rows = integer("rows", params["rows"], MAX_ROWS) if "rows" in params else DEFAULT_ROWS
    return cols, rows


# -- two ways to compile ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Built:
    """A kernel ready for a request, and how this request came by it."""

    name: str
    key: str
    target: str
    outcome: str | None
    compile_seconds: float
    num_warps: int
    launch: Callable[..., None]  # launch(grid, *runtime_args), on a GPU


# The records of the request being served. aiocompile reports a request's record from
# the coroutine that awaited it, so a listener reading this variable sees the record of
# the request in whose task it was called, and no other.
_request_records: contextvars.ContextVar[list[aiocompile.records.JobRecord] | None] = contextvars.ContextVar(
    "serve_request_records", default=None)


def _keep_request_record(event: object) -> None:
    records = _request_records.get()
    if records is not None and isinstance(event, aiocompile.records.JobRecord):
        records.append(event)


class PooledCompiler:
    """Compiles in aiocompile's worker pool: the event loop only waits."""

    def __init__(self, config: ServeConfig, target: str | None) -> None:
        self._target = target
        self.scheduler = aiocompile.Scheduler(workers=config.workers, config=aiocompile.SchedulerConfig.from_env())
        self._unsubscribe = self.scheduler.subscribe(_keep_request_record)
        self._warm = config.warm

    async def start(self) -> None:
        if self._warm:
            # Readies the workers, and pays this process's first-key cost (hashing Triton).
            await self.scheduler.warm(self._target or "cuda:90")

    async def build(self, op: Op, block: int, num_warps: int, launching: bool) -> Built:
        records: list[aiocompile.records.JobRecord] = []
        token = _request_records.set(records)
        try:
            kernel = await self.scheduler.compile_triton(op.kernel, signature=op.signature,
                                                         constexprs={"BLOCK": block}, target=self._target,
                                                         num_warps=num_warps)
        finally:
            _request_records.reset(token)
        if launching:
            await kernel.load()  # loads the binary and builds its launcher in a thread

        def launch(grid: tuple[int, int, int], *args: Any) -> None:
            kernel[grid](*args)

        outcome = next((record.outcome for record in records if record.key == kernel.key), None)
        return Built(kernel.name, kernel.key, kernel.target, outcome, kernel.compile_time,
                     kernel.metadata["num_warps"], launch)

    async def close(self) -> None:
        self._unsubscribe()
        await self.scheduler.aclose()


class InLoopCompiler:
    """Compiles with ``triton.compile`` in the request handler: the event loop is held for
    the whole compile. Kernels are kept in a dict, so a block size compiles once."""

    def __init__(self, config: ServeConfig, target: str | None) -> None:
        self._gpu_target = None if target is None else parse_target(target).to_gpu_target()
        self._kernels: dict[tuple[str, int], tuple[Any, float]] = {}
        self.scheduler = None

    async def start(self) -> None:
        # What a pool's warm-up does for its workers: pay Triton's one-time set-up here,
        # before serving, rather than in the first request.
        if self._gpu_target is None:
            from triton.runtime import driver

            self._gpu_target = driver.active.get_current_target()
        signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
        triton.compile(ASTSource(add_kernel, signature, {"BLOCK": 16}), target=self._gpu_target)

    async def build(self, op: Op, block: int, num_warps: int, launching: bool) -> Built:
        found = self._kernels.get((op.kernel.__name__, block))
        outcome = "cache_hit"
        if found is None:
            started = time.perf_counter()
            signature = {**op.signature, "BLOCK": "constexpr"}
            compiled = triton.compile(ASTSource(op.kernel, signature, {"BLOCK": block}),
                                      target=self._gpu_target, options={"num_warps": num_warps})
            found = self._kernels[op.kernel.__name__, block] = (compiled, time.perf_counter() - started)
            outcome = "compiled"
        compiled, seconds = found

        def launch(grid: tuple[int, int, int], *args: Any) -> None:
            compiled[grid](*args, block)  # a CompiledKernel takes its constexprs too

        target = f"{compiled.metadata.target.backend}:{compiled.metadata.target.arch}"
        return Built(op.kernel.__name__, compiled.hash, target, outcome, seconds, compiled.metadata.num_warps, launch)

    async def close(self) -> None:
        pass


# -- the ASGI application ---------------------------------------------------------------------


def _gpu_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class App:
    """The service as an ASGI callable: ``await app(scope, receive, send)``."""

    def __init__(self, config: ServeConfig | None = None) -> None:
        self.config = config or ServeConfig.from_env()
        self._compiler: PooledCompiler | InLoopCompiler | None = None
        self._launching = False
        self._registry: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, send)
        else:
            raise RuntimeError(f"this service speaks HTTP only, not {scope['type']!r}")

    # -- lifespan

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self._start()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": f"{type(exc).__name__}: {exc}"})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start(self) -> None:
        from prometheus_client import CollectorRegistry

        config = self.config
        # Looking for a GPU imports torch (about a second): only when the target is not given.
        self._launching = config.target == "auto" and _gpu_visible()
        target = None if self._launching else "cuda:90" if config.target == "auto" else config.target
        self._registry = CollectorRegistry()
        if config.mode == "aiocompile":
            from aiocompile.prometheus import SchedulerCollector

            pooled = PooledCompiler(config, target)
            self._registry.register(SchedulerCollector(pooled.scheduler))
            self._compiler = pooled
        else:
            self._compiler = InLoopCompiler(config, target)
        await self._compiler.start()
        log.info("serving in %s mode, target %s%s", config.mode, target or "this GPU",
                 ", launching kernels" if self._launching else "")

    async def _stop(self) -> None:
        compiler, self._compiler = self._compiler, None
        if compiler is None:
            return
        await compiler.close()
        if compiler.scheduler is not None:
            stats = compiler.scheduler.statistics()
            log.info("scheduler closed: %d requests, %d compiled, %d joined, %d from memory", stats.submitted,
                     stats.compiled, stats.joined, stats.cache_hits)

    # -- requests

    async def _http(self, scope: Scope, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        op = OPS.get(path)
        if path not in ("/healthz", "/metrics") and op is None:
            await _send_json(send, 404, {"error": f"no such path: {path}", "paths": ["/healthz", "/metrics", *OPS]})
            return
        if method != "GET":
            await _send_json(send, 405, {"error": f"{method} is not allowed here, only GET"},
                             headers=[(b"allow", b"GET")])
            return
        if path == "/healthz":
            await _send_json(send, 200, {"status": "ok", "mode": self.config.mode})
        elif path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            await _send(send, 200, generate_latest(self._registry), CONTENT_TYPE_LATEST.encode())
        else:
            assert op is not None
            try:
                cols, rows = parse_query(scope.get("query_string", b""))
            except BadRequest as exc:
                await _send_json(send, 400, {"error": str(exc)})
                return
            status, body = await self._kernel(op, cols, rows)
            await _send_json(send, status, body)

    async def _kernel(self, op: Op, cols: int, rows: int) -> tuple[int, dict[str, Any]]:
        compiler = self._compiler
        if compiler is None:
            return 503, {"error": "the service is not running"}
        block, num_warps = op.specialise(cols)
        started = time.perf_counter()
        try:
            built = await compiler.build(op, block, num_warps, self._launching)
        except aiocompile.CompileError as exc:
            log.warning("%s", exc)
            return 500, {"error": f"{type(exc).__name__}: {exc}"}
        except aiocompile.SchedulerClosed:
            return 503, {"error": "the service is stopping"}
        body: dict[str, Any] = {
            "kernel": built.name, "key": built.key, "target": built.target, "mode": self.config.mode,
            "cols": cols, "rows": rows, "block": block, "num_warps": built.num_warps,
            "outcome": built.outcome, "compile_seconds": built.compile_seconds,
            "wait_seconds": time.perf_counter() - started, "launched": self._launching,
        }
        if not self._launching:
            return 200, body
        # Launching and checking waits for the GPU: in a thread, so that the loop does not.
        body.update(await anyio.to_thread.run_sync(op.check, built.launch, rows, cols))
        return (200 if body["correct"] else 500), body


async def _send(send: Send, status: int, body: bytes, content_type: bytes,
                headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send: Send, status: int, value: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await _send(send, status, json.dumps(value).encode(), b"application/json", headers)


def create_app(config: ServeConfig | None = None) -> App:
    """The service as an ASGI application (configured from the environment by default)."""
    return App(config)


# -- the command ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    try:
        defaults = ServeConfig.from_env()
    except ValueError as exc:
        parser.error(f"in the environment: {exc}")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--mode", choices=MODES, default=defaults.mode,
                        help="compile in aiocompile's pool, or with triton.compile in the event loop "
                             "(default: $AIOCOMPILE_SERVE_MODE or aiocompile)")
    parser.add_argument("--target", default=defaults.target,
                        help="auto (this GPU if torch sees one, else cuda:90), or e.g. cuda:80, hip:gfx942 "
                             "(default: $AIOCOMPILE_SERVE_TARGET or auto)")
    parser.add_argument("--workers", type=int, default=None,
                        help="compile worker processes (default: $AIOCOMPILE_WORKERS or one per CPU)")
    parser.add_argument("--no-warm", dest="warm", action="store_false",
                        help="start workers on the first compile rather than at start-up")
    parser.add_argument("--access-log", action="store_true", help="log every request")
    parser.add_argument("--log-level", default="info")
    options = parser.parse_args(argv)
    try:
        config = ServeConfig(mode=options.mode, target=options.target, workers=options.workers, warm=options.warm)
    except ValueError as exc:
        parser.error(str(exc))

    import uvicorn

    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    log.setLevel(options.log_level.upper())
    uvicorn.run(create_app(config), host=options.host, port=options.port, lifespan="on",
                log_level=options.log_level, access_log=options.access_log, timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
