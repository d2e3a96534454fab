"""Where a background compile stands: one small state machine per input signature
(``_Entry``), and the frozen snapshots ``status()`` returns (``ShapeStatus``,
``BackgroundStatus``).

A signature is ``compiling`` from its first call until its compile ends: ``compiled``
once the package is loaded and in use (its first calls in a thread may still be answered
eagerly while that thread makes what the compiled version's first call would: ``thread_plans``),
``failed`` otherwise; ``compiled`` becomes
``failed`` if the compiled version ever raises at a call. ``eager`` is for a signature that
is never compiled (``disable=True``). ``TRANSITIONS`` names every move there is; anything
else is refused.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiocompile._torch import thread_plans

__all__ = ["STATES", "TRANSITIONS", "BackgroundStatus", "ShapeStatus"]

STATES = ("compiling", "compiled", "failed", "eager")
TRANSITIONS = frozenset({("compiling", "compiled"), ("compiling", "failed"), ("compiled", "failed")})


@dataclass(frozen=True)
class ShapeStatus:
    """Where one input signature stands."""

    signature: str
    """The inputs, readable: ``f32[4, 128, 256] cpu`` per argument."""
    state: str
    """``compiling``, ``compiled``, ``failed`` or ``eager`` (never compiled: see ``error``)."""
    error: str | None = None
    """Why it failed (or why it stays eager): the error's type and message."""
    repro: str | None = None
    """The repro bundle's directory, for a failed compile that wrote one."""
    seconds: float | None = None
    """From the first call with this signature to compiled (or failed)."""
    stages: tuple[tuple[str, float], ...] = ()
    """The worker's stages (load, export, compile, trial) and their seconds."""
    max_abs_difference: float | None = None
    """The largest difference between the compiled and the eager output in the worker's
    trial run."""
    eager_calls: int = 0
    compiled_calls: int = 0
    compiler: str | None = None
    """The C++ compiler the worker built the package with, and why, when it is not
    Inductor's default (``docs/torch.md``, "The C++ compiler")."""
    form: str | None = None
    """What the worker built: ``"package"`` (AOTInductor's) or ``"python"`` (Inductor's
    Python wrapper); None until it has answered."""
    form_reason: str | None = None
    """Why the worker built a package where the Python form was asked for."""

    def to_dict(self) -> dict[str, Any]:
        return {"signature": self.signature, "state": self.state, "error": self.error, "repro": self.repro,
                "seconds": self.seconds, "stages": dict(self.stages),
                "max_abs_difference": self.max_abs_difference, "eager_calls": self.eager_calls,
                "compiled_calls": self.compiled_calls, "compiler": self.compiler,
                "form": self.form, "form_reason": self.form_reason}


@dataclass(frozen=True)
class BackgroundStatus:
    """A snapshot of every signature a :class:`BackgroundCompiled` has met."""

    model: str
    shapes: tuple[ShapeStatus, ...] = ()
    eager_calls: int = 0
    """Calls answered eagerly that belong to no signature here: inputs that could not be
    keyed, or signatures met beyond ``max_signatures``."""

    def _with(self, state: str) -> tuple[str, ...]:
        return tuple(shape.signature for shape in self.shapes if shape.state == state)

    @property
    def compiled(self) -> tuple[str, ...]:
        return self._with("compiled")

    @property
    def compiling(self) -> tuple[str, ...]:
        return self._with("compiling")

    @property
    def failed(self) -> tuple[str, ...]:
        return self._with("failed")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "eager_calls": self.eager_calls,
                "compiled": list(self.compiled), "compiling": list(self.compiling), "failed": list(self.failed),
                "shapes": [shape.to_dict() for shape in self.shapes]}


class _Entry:
    """One signature's life (see the module docstring). A plain class, not a dataclass:
    this module is imported by the first ``compile_in_background``, in the serving loop."""

    __slots__ = ("text", "state", "error", "runner", "constants", "primes", "started", "seconds", "stages",
                 "difference", "compiler", "form", "form_reason", "eager_calls", "compiled_calls", "done")

    def __init__(self, text: str) -> None:
        self.text = text
        self.state = "compiling"
        self.error: BaseException | None = None
        self.runner: Any = None
        self.constants: Mapping[str, Any] | None = None
        """What the loaded package reads its weights from: kept alive here."""
        self.primes = thread_plans.Primes()
        """What the compiled version's first call would make in the calling thread, made
        one per call before it is used there."""
        self.started = time.monotonic()
        self.seconds: float | None = None
        self.stages: tuple[tuple[str, float], ...] = ()
        self.difference: float | None = None
        self.compiler: str | None = None
        self.form: str | None = None
        self.form_reason: str | None = None
        self.eager_calls = 0
        self.compiled_calls = 0
        self.done: cf.Future[None] = cf.Future()
        """Resolved when the entry leaves ``compiling``."""

    def move(self, state: str, error: BaseException | None = None) -> bool:
        """Go to ``state`` if that is a transition there is; returns whether it moved."""
        if (self.state, state) not in TRANSITIONS:
            return False
        self.state = state
        if error is not None:
            self.error = error
        if self.seconds is None:
            self.seconds = time.monotonic() - self.started
        if not self.done.done():
            self.done.set_result(None)
        return True

    def snapshot(self) -> ShapeStatus:
        error = self.error
        return ShapeStatus(
            signature=self.text, state=self.state,
            error=None if error is None else f"{type(error).__name__}: {error}",
            repro=getattr(error, "repro", None), seconds=self.seconds, stages=self.stages,
            max_abs_difference=self.difference, eager_calls=self.eager_calls, compiled_calls=self.compiled_calls,
            compiler=self.compiler, form=self.form, form_reason=self.form_reason,
        )


def describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The inputs, readable: ``f32[4, 128, 256] cpu`` for a tensor, ``repr`` for a value,
    ``name=...`` for a keyword, a container's leaves in parentheses."""
    import torch

    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            dtype = _DTYPE_NAMES.get(str(value.dtype), str(value.dtype).replace("torch.", ""))
            text = f"{dtype}[{', '.join(str(s) for s in value.shape)}] {value.device}"
            if not value.is_contiguous():
                text += f" stride ({', '.join(str(s) for s in value.stride())})"
            return text
        if isinstance(value, (tuple, list, dict)):
            return f"({', '.join(one(leaf) for leaf in torch.utils._pytree.tree_leaves(value))})"
        return repr(value)

    return ", ".join([one(value) for value in args] + [f"{name}={one(value)}" for name, value in kwargs.items()])


_DTYPE_NAMES = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16", "torch.float64": "f64",
                "torch.int64": "i64", "torch.int32": "i32", "torch.int8": "i8", "torch.uint8": "u8",
                "torch.bool": "bool"}
