"""What a compiled version's first call makes per thread, made ahead in the serving thread a
piece at a time.

PyTorch keeps the cuDNN execution plans of its convolutions in a cache of each thread's own
(they are not safe to share). A compiled version often runs its convolutions in another
memory layout than the eager model did (Inductor's layout optimization picks channels-last
for convolutional graphs), so the serving thread has none of their plans when the switch
comes, and its first compiled call makes them all at once: 11 to 12 ms of a conv net's
first compiled call on an H200 host, the event loop's thread held the whole time. The load
thread's own first call (``loading.first_call``) makes them for that thread only.

So that first call records the convolutions it makes (:func:`recording`: each operator's
arguments, tensors kept as their size, strides, dtype and device), and the serving thread
makes one plan per call after the switch (:class:`Prime`: the same operator on empty
tensors of that shape), answering those calls eagerly, until none is left. Where the
serving thread runs an event loop, the plan is made by the loop once the call's step is
done, between calls rather than inside one; elsewhere (or when calls come back to back,
the one asked for not made yet) the call makes it before it returns, taking one plan's
time more, not all of them.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiocompile._base import bridge

__all__ = ["CONVOLUTIONS", "Prime", "Primes", "make_next", "recording"]

_logger = logging.getLogger("aiocompile")

CONVOLUTIONS = frozenset({"convolution", "_convolution", "cudnn_convolution", "cudnn_convolution_transpose"})
"""The operators whose plans a thread keeps for itself (by their overload packet's name)."""


class _TensorMeta:
    """A tensor's size, strides, dtype and device: what a plan is made for."""

    __slots__ = ("size", "stride", "dtype", "device")

    def __init__(self, tensor: Any) -> None:
        self.size = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.dtype = tensor.dtype
        self.device = tensor.device

    def key(self) -> tuple[Any, ...]:
        return (self.size, self.stride, str(self.dtype), str(self.device))

    def empty(self) -> Any:
        import torch

        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)


class Prime:
    """One recorded operator call, made again on empty tensors of the same shapes."""

    def __init__(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.op = op
        self.args = args
        self.kwargs = kwargs

    def key(self) -> tuple[Any, ...]:
        def one(value: Any) -> Any:
            if isinstance(value, _TensorMeta):
                return value.key()
            if isinstance(value, (list, tuple)):
                return tuple(one(item) for item in value)
            return repr(value)

        return (str(self.op), one(self.args), tuple(sorted((name, one(v)) for name, v in self.kwargs.items())))

    def __call__(self) -> None:
        import torch

        def real(value: Any) -> Any:
            if isinstance(value, _TensorMeta):
                return value.empty()
            if isinstance(value, list):
                return [real(item) for item in value]
            if isinstance(value, tuple):
                return tuple(real(item) for item in value)
            return value

        with torch.no_grad():
            self.op(*real(self.args), **{name: real(value) for name, value in self.kwargs.items()})


@contextmanager
def recording(device_type: str = "cuda") -> Iterator[list[Prime]]:
    """Inside the block, this thread's convolutions on ``device_type`` tensors are recorded,
    one :class:`Prime` per distinct call, into the list it yields. Thread-local: torch's
    dispatch modes are."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    primes: list[Prime] = []
    seen: set[tuple[Any, ...]] = set()

    def meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return _TensorMeta(value)
        if isinstance(value, list):
            return [meta(item) for item in value]
        if isinstance(value, tuple):
            return tuple(meta(item) for item in value)
        return value

    def on_device(values: Any) -> bool:
        return any(isinstance(value, torch.Tensor) and value.device.type == device_type for value in values)

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = kwargs or {}
            if func.overloadpacket.__name__ in CONVOLUTIONS and on_device((*args, *kwargs.values())):
                prime = Prime(func, meta(args), {name: meta(value) for name, value in kwargs.items()})
                key = prime.key()
                if key not in seen:
                    seen.add(key)
                    primes.append(prime)
            return func(*args, **kwargs)

    with _Recorder():
        yield primes


def make_next(primes: collections.deque[Prime]) -> None:
    """Make the next of ``primes`` in this thread. One that fails ends them all: they are
    only a head start, and the compiled call makes whatever is left."""
    try:
        prime = primes.popleft()
    except IndexError:  # another thread took the last one
        return
    try:
        prime()
    except Exception as exc:  # noqa: BLE001
        primes.clear()
        _logger.debug("aiocompile: making %s ahead in the serving thread failed: %s: %s", prime.op,
                      type(exc).__name__, exc)


class Primes:
    """The primes a compiled version's first call left for the serving thread, and whether
    one of them is to be made by that thread's event loop."""

    def __init__(self) -> None:
        self._left: collections.deque[Prime] = collections.deque()
        self._pending = False

    def __bool__(self) -> bool:
        return bool(self._left)

    def extend(self, primes: list[Prime]) -> None:
        self._left.extend(primes)

    def make_one(self) -> None:
        """Make the next one in this thread, just after the call being answered: once the
        event loop running here is done with the present step (between calls, rather than
        inside one: a plan takes milliseconds), or now where no loop runs here, or where
        the one asked for after the call before has not been made yet (calls made back to
        back, with no step between them to make it in)."""
        if self._pending or not bridge.soon_here(self._make_asked):
            make_next(self._left)
            return
        self._pending = True

    def _make_asked(self) -> None:
        self._pending = False
        make_next(self._left)
