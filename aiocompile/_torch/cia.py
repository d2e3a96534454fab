"""Torch's walk over its CompositeImplicitAutograd operators, made in pieces that stand
aside.

Importing Inductor's decompositions (``torch._inductor.decomposition``, which a load of
the Python form needs) asks ``torch.export``'s decomposition table for its keys. That
walks every namespace of ``torch.ops`` and, for each, calls
``torch._export.utils._materialize_cpp_cia_ops``: a loop over every operator the
dispatcher has a CompositeImplicitAutograd kernel for, which once the operators exist
makes only C calls (``str.split``, ``getattr``). The thread running it reaches no Python
call for the whole loop, so it cannot stand aside (:mod:`aiocompile._base.aside`) for a
call being served, and each of a model's operators in that call waits for the lock a
switch interval. The loop runs once per namespace: dozens of times, milliseconds each.

:func:`in_pieces` puts, for the duration of a block, an equivalent of that function in
its place that makes the same lookups ``PIECE`` operators at a time, each piece a Python
call: a point where the thread stands aside. Other threads that call it meanwhile get the
same result. Where torch has no such function, or another has been put in its place,
nothing is changed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["PIECE", "in_pieces"]

PIECE = 32
"""How many operators one piece looks up (tens of microseconds on a CPU)."""

_NAME = "_materialize_cpp_cia_ops"


class _Patch:
    """How many :func:`in_pieces` blocks are running, and what they replaced."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.original: Any = None


_PATCH = _Patch()


def _lookup(ops: Any, names: Sequence[str]) -> None:
    """One piece: what torch's loop does for each of ``names`` (``namespace::op[.overload]``)."""
    for qualified in names:
        namespace, op_name = tuple(qualified.split("::"))
        parts = op_name.split(".")
        if len(parts) not in (1, 2):
            raise AssertionError(f"expected 1 or 2 parts, got {len(parts)}")
        overload = parts[1] if len(parts) == 2 else "default"
        getattr(getattr(getattr(ops, namespace), parts[0]), overload)


def materialize() -> None:
    """Make every CompositeImplicitAutograd operator the dispatcher knows an attribute of
    ``torch.ops``, as torch's own function does, ``PIECE`` at a time."""
    import torch

    names = torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    for start in range(0, len(names), PIECE):
        _lookup(torch.ops, names[start:start + PIECE])


@contextlib.contextmanager
def in_pieces() -> Iterator[None]:
    """Inside the block (in any number of threads at once), torch's walk is made by
    :func:`materialize`; the last block to end puts torch's own back."""
    utils = _utils()
    with _PATCH.lock:
        if utils is not None and _PATCH.inside == 0:
            current = getattr(utils, _NAME, None)
            if callable(current) and getattr(current, "__module__", None) == utils.__name__:
                _PATCH.original = current
                setattr(utils, _NAME, materialize)
        _PATCH.inside += 1
    try:
        yield
    finally:
        with _PATCH.lock:
            _PATCH.inside -= 1
            if _PATCH.inside == 0 and _PATCH.original is not None:
                if utils is not None and getattr(utils, _NAME, None) is materialize:
                    setattr(utils, _NAME, _PATCH.original)
                _PATCH.original = None


def _utils() -> Any:
    """``torch._export.utils``, or None where it cannot be imported."""
    try:
        from torch._export import utils
    except Exception:  # noqa: BLE001 - no walk to make in pieces
        return None
    return utils
