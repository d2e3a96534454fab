"""An HTTP service that serves a PyTorch model at once, and compiled as soon as it can.

The model (a few transformer blocks, defined here, in the server's own file) is wrapped
with ``aiocompile.torch.compile_in_background``: every request is answered from the
first one on, eagerly while a worker process exports and compiles the model for the
request's shape, compiled from then on. Nothing the service does waits for a compile::

    pip install -e ".[serve,torch]"
    python examples/serve_model.py --port 8000 --warm 4x128
    curl 'http://127.0.0.1:8000/predict?batch=4&seq=128&check=1'
    curl  http://127.0.0.1:8000/status

It is a plain ASGI application (``create_app()``) run by uvicorn.

Endpoints (GET):

- ``/predict?batch=B&seq=S[&seed=N][&check=1]``: the model on a ``B x S x dim`` input
  drawn from ``seed`` (``1 <= B <= 64``, ``1 <= S <= 1024``). JSON: the output's shape,
  sum and mean, the input signature, how the request was answered (``served``:
  ``eager`` or ``compiled``), and the signature's state after it. With ``check=1`` the
  eager model runs too and the answer carries the largest difference between the two
  (0 when the request was answered eagerly).
- ``/status``: ``compiled.status().to_dict()``: every signature met, compiled, compiling
  or failed (with its error and repro bundle), and how many calls each way.
- ``/healthz``: answers at once.

Bad input (a missing, malformed or out-of-range ``batch`` or ``seq``, an unknown
parameter) gets a 400 saying what is wrong, an unknown path a 404.

``--warm BxS[,BxS...]`` starts compiles for those shapes at start-up, without waiting for
them: the service answers meanwhile. ``--dim``, ``--heads`` and ``--blocks`` size the
model; ``--device`` picks ``cpu`` or ``cuda`` (``auto``: CUDA where torch sees it).

The model runs in a thread (``anyio.to_thread``), so that a forward pass does not hold the
event loop either. The compiles run in the workers of the scheduler
``compile_in_background`` makes (configured from ``AIOCOMPILE_*``), closed at shutdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl

import anyio
import torch
from torch import nn

import aiocompile.torch as aiotorch

log = logging.getLogger("serve_model")

MAX_BATCH = 64
MAX_SEQ = 1024

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


# -- the model: defined in the server's own file -------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, dim: int, heads: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(blocks)))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x))


# -- configuration ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    dim: int = 256
    heads: int = 4
    blocks: int = 2
    device: str = "auto"
    warm: tuple[tuple[int, int], ...] = ()
    """Shapes (batch, seq) to compile at start-up."""

    def __post_init__(self) -> None:
        for name in ("dim", "heads", "blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of heads ({self.heads})")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``4x128,1x128`` as ``((4, 128), (1, 128))``."""
    shapes = []
    for part in text.split(","):
        if not part.strip():
            continue
        batch, _, seq = part.strip().lower().partition("x")
        if not (batch.isdigit() and seq.isdigit()):
            raise ValueError(f"a shape is BATCHxSEQ, such as 4x128, got {part!r}")
        shapes.append((check_range("batch", int(batch), MAX_BATCH), check_range("seq", int(seq), MAX_SEQ)))
    return tuple(shapes)


class BadRequest(ValueError):
    """The request asked for something the service does not serve: a 400."""


def check_range(name: str, value: int, most: int) -> int:
    if not 1 <= value <= most:
        raise BadRequest(f"{name} must be from 1 to {most}, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class Query:
    batch: int
    seq: int
    seed: int = 0
    check: bool = False


def parse_query(query: bytes) -> Query:
    try:
        pairs = parse_qsl(query.decode("ascii"), keep_blank_values=True, strict_parsing=bool(query))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"malformed query string: {exc}") from None
    params: dict[str, str] = {}
    for name, value in pairs:
        if name not in ("batch", "seq", "seed", "check"):
            raise BadRequest(f"unknown query parameter {name!r}: expected batch, seq, and optionally seed, check")
        if name in params:
            raise BadRequest(f"query parameter {name!r} given twice")
        params[name] = value
    for name in ("batch", "seq"):
        if name not in params:
            raise BadRequest(f"missing query parameter {name!r}")

    def integer(name: str, most: int, least: int = 1) -> int:
        text = params[name]
        if not text.isdigit():
            raise BadRequest(f"{name} must be a whole number from {least} to {most}, got {text!r}")
        value = int(text)
        if not least <= value <= most:
            raise BadRequest(f"{name} must be from {least} to {most}, got {value}")
        return value

    if params.get("check", "0") not in ("0", "1"):
        raise BadRequest(f"check must be 0 or 1, got {params['check']!r}")
    return Query(batch=integer("batch", MAX_BATCH), seq=integer("seq", MAX_SEQ),
                 seed=integer("seed", 2**31 - 1, 0) if "seed" in params else 0, check=params.get("check") == "1")


# -- the ASGI application -----------------------------------------------------------------------


class App:
    """The service as an ASGI callable: ``await app(scope, receive, send)``."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.config = config or ModelConfig()
        self.device = self.config.torch_device()
        self.model: Transformer | None = None
        self.compiled: aiotorch.BackgroundCompiled | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, send)
        else:
            raise RuntimeError(f"this service speaks HTTP only, not {scope['type']!r}")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tasks:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    try:
                        self._start(tasks)
                    except Exception as exc:
                        log.exception("start-up failed")
                        await send({"type": "lifespan.startup.failed", "message": f"{type(exc).__name__}: {exc}"})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    tasks.cancel_scope.cancel()
                    if self.compiled is not None:
                        await self.compiled.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    def _start(self, tasks: Any) -> None:
        config = self.config
        torch.manual_seed(0)
        self.model = Transformer(config.dim, config.heads, config.blocks).to(self.device).eval()
        # Every call answered at once: eagerly, until a worker has compiled the model for
        # the call's shape. The scheduler it makes starts loading its workers now.
        self.compiled = aiotorch.compile_in_background(self.model)
        for batch, seq in config.warm:
            tasks.start_soon(self._warm, batch, seq)
        log.info("serving %s on %s; compiling in the background", type(self.model).__name__, self.device)

    async def _warm(self, batch: int, seq: int) -> None:
        assert self.compiled is not None
        shape = await self.compiled.ready(self._input(batch, seq, 0))
        log.info("%s: %s%s", shape.signature, shape.state, f" ({shape.error})" if shape.error else "")

    def _input(self, batch: int, seq: int, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(batch, seq, self.config.dim, generator=generator).to(self.device)

    async def _http(self, scope: Scope, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path not in ("/healthz", "/status", "/predict"):
            await _send_json(send, 404, {"error": f"no such path: {path}", "paths": ["/healthz", "/predict",
                                                                                     "/status"]})
            return
        if method != "GET":
            await _send_json(send, 405, {"error": f"{method} is not allowed here, only GET"},
                             headers=[(b"allow", b"GET")])
            return
        compiled = self.compiled
        if path == "/healthz":
            await _send_json(send, 200, {"status": "ok"})
            return
        if compiled is None:
            await _send_json(send, 503, {"error": "the service is not running"})
            return
        if path == "/status":
            await _send_json(send, 200, compiled.status().to_dict())
            return
        try:
            query = parse_query(scope.get("query_string", b""))
        except BadRequest as exc:
            await _send_json(send, 400, {"error": str(exc)})
            return
        body = await anyio.to_thread.run_sync(self._predict, compiled, query)
        await _send_json(send, 200, body)

    def _predict(self, compiled: aiotorch.BackgroundCompiled, query: Query) -> dict[str, Any]:
        """One request's inference (in a thread)."""
        x = self._input(query.batch, query.seq, query.seed)
        with torch.inference_mode():
            before = compiled.state(x)
            out = compiled(x)
            body: dict[str, Any] = {
                "shape": list(out.shape), "sum": float(out.sum()), "mean": float(out.mean()),
                "served": "compiled" if before == "compiled" else "eager", "state": compiled.state(x),
            }
            if query.check:
                assert self.model is not None
                difference = (out - self.model(x)).abs().max().item()
                body["max_abs_difference"] = difference if math.isfinite(difference) else None
        return body


async def _send_json(send: Send, status: int, value: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(value).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def create_app(config: ModelConfig | None = None) -> App:
    return App(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--warm", default="", help="shapes to compile at start-up: BxS[,BxS...], such as 4x128")
    parser.add_argument("--log-level", default="info")
    options = parser.parse_args(argv)
    try:
        config = ModelConfig(dim=options.dim, heads=options.heads, blocks=options.blocks, device=options.device,
                             warm=parse_shapes(options.warm))
    except ValueError as exc:
        parser.error(str(exc))

    import uvicorn

    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    log.setLevel(options.log_level.upper())
    uvicorn.run(create_app(config), host=options.host, port=options.port, lifespan="on",
                log_level=options.log_level, timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
