"""Sending a model to a worker process: its code by reference, its weights by value.

A server's model is usually an instance of a class defined in an importable module, or
in the server's own script (``python serve.py``: the class lives in ``__main__``, which a
worker never imports). So a model travels as a :class:`Parcel`:

- the module pickled as usual: classes and functions by reference, tensors (weights and
  buffers) by value, each storage's bytes beside the pickle (``Parcel.weights``) rather
  than copied into it: a CPU tensor's are its own memory, uncopied; a GPU tensor's are
  copied to the host by torch, which lets the interpreter lock go meanwhile, on a stream
  of their own (:class:`_HostCopies`: the serving thread's kernels queued meanwhile do not
  wait behind the copies). (Pickled
  as torch pickles them, every storage is ``torch.save``d into the pickle holding the
  lock: 5 to 10 ms for an 8 MB embedding, a stall of every thread serving beside it.)
  Unpickling needs torch alone, as torch's own pickles do;
- when something it references lives in ``__main__`` (the program's script, a notebook,
  ``python -c``) or is local to a function: by value with ``cloudpickle``, which carries
  those classes with their methods and the globals they read. The script itself is never
  run anywhere but in the program's own process: a script without an
  ``if __name__ == "__main__":`` guard, or one that reads ``sys.argv`` at its top, would
  otherwise start a second program inside a worker. Without ``cloudpickle`` such a model
  is refused here, saying to move its class into a module.

Anything else that will not pickle (a lock, an open file held by the model) raises
``TypeError`` here, in the parent, saying what.

Nothing here imports torch at module level: the worker's half runs in a process that has
it already.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import io
import pickle
import sys
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from aiocompile._pool import serialize


@dataclass(frozen=True)
class Parcel:
    """A pickled model (or any object) and what unpickling it needs."""

    data: bytes = field(repr=False)
    how: str
    """``reference`` or ``cloudpickle``."""
    weights: tuple[bytes | memoryview, ...] = field(default=(), repr=False)
    """The storages' bytes, the pickle's out-of-band buffers in its order."""

    @property
    def size(self) -> int:
        return len(self.data) + sum(memoryview(weight).nbytes for weight in self.weights)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Sent to the pool's own workers, the pickled model and its weights go beside the
        # job's pickle, uncopied (``serialize.out_of_band``).
        if protocol >= 5:
            return _parcel, (serialize.out_of_band(self.data), self.how,
                             tuple(serialize.out_of_band(weight) for weight in self.weights))
        return _parcel, (self.data, self.how, tuple(bytes(weight) for weight in self.weights))


def _parcel(data: Any, how: str, weights: Sequence[Any] = ()) -> Parcel:
    # The weights stay the buffers received: unpickling copies each into a storage.
    return Parcel(serialize.as_bytes(data), how, tuple(_bytes_like(weight) for weight in weights))


def _bytes_like(value: Any) -> bytes | memoryview:
    return value if isinstance(value, bytes | memoryview) else memoryview(value)


class _MainSeen(pickle.Pickler):
    """A pickler that notes whether anything was pickled by reference into ``__main__``,
    puts the weights beside the pickle (:func:`_storage_reduction`), and lets other
    threads run between two tensors.

    Packing runs in a thread of the serving process while its calls go on, and copying
    the weights holds the interpreter lock: a serving thread that lets go of the lock (a
    GPU synchronisation, a socket's write) would wait for the packer to be made to give
    it back, up to the switch interval (5 ms) each time. Offering the lock before each
    tensor bounds that wait by one tensor's copy."""

    def __init__(self, file: io.BytesIO, weights: list[pickle.PickleBuffer], copies: _HostCopies) -> None:
        super().__init__(file, protocol=5, buffer_callback=weights.append)
        self.main_names: set[str] = set()
        self._torch = sys.modules.get("torch")
        self._copies = copies

    def reducer_override(self, obj: Any) -> Any:
        if _offered_at(obj, self._torch):
            return NotImplemented
        if isinstance(obj, (type, types.FunctionType)):
            if getattr(obj, "__module__", None) == "__main__":
                self.main_names.add(getattr(obj, "__qualname__", repr(obj)))
            return NotImplemented
        return _storage_reduction(obj, self._torch, self._copies)


def _offered_at(obj: Any, torch: Any) -> bool:
    """Before a tensor is pickled, offer the interpreter lock to a waiting thread (see
    :class:`_MainSeen`); whether ``obj`` is one. (No torch imported: no tensors.)"""
    if torch is not None and isinstance(obj, torch.Tensor):
        time.sleep(0)
        return True
    return False


def _storage_reduction(obj: Any, torch: Any, copies: _HostCopies) -> Any:
    """How a tensor's storage pickles here: its bytes as an out-of-band buffer, rebuilt by
    torch's own functions (``UntypedStorage.from_buffer``, ``.to(device=...)``, a
    ``TypedStorage`` around it), as ``torch.load`` would place it. ``NotImplemented``
    for anything else (pickled as usual) and for a storage of no real memory (``meta``)."""
    if torch is None:
        return NotImplemented
    storage = torch.storage
    if type(obj) is storage.TypedStorage:
        return _partial(storage.TypedStorage, wrap_storage=obj._untyped_storage, dtype=obj.dtype, _internal=True), ()
    if type(obj) is not storage.UntypedStorage or obj.device.type == "meta":
        return NotImplemented
    device = obj.device
    if device.type != "cpu":
        # Copied to the host by torch, which lets the lock go meanwhile; the host's
        # storage then pickles as a CPU storage, placed back by the loader.
        host = copies.to_host(torch.empty(0, dtype=torch.uint8, device=device).set_(obj))
        return _partial(storage.UntypedStorage.to, device=str(device)), (host,)
    return _partial(storage.UntypedStorage.from_buffer, dtype=torch.uint8), (_memory_of(obj),)


class _HostCopies:
    """One packing's copies of GPU storages to the host, each GPU's on a stream of its own.

    Copied on the current stream, where the serving thread queues its eager calls'
    kernels, each copy waited for the kernels queued before it and made those queued
    after it wait: an eager call on a GPU host took 10 ms while a model was packed beside
    it. The stream first waits for what the current stream holds when the packing begins
    (writes to the weights queued before it are in the copies); the later calls, which
    read the weights, run beside the copies."""

    def __init__(self) -> None:
        self._streams: dict[Any, Any] = {}

    def to_host(self, tensor: Any) -> Any:
        """``tensor``'s bytes on the host, as a CPU storage."""
        device = tensor.device
        if device.type != "cuda":
            return tensor.cpu().untyped_storage()
        torch = sys.modules["torch"]  # a GPU tensor: torch is imported
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            self._streams[device] = stream
        with torch.cuda.stream(stream):
            return tensor.cpu().untyped_storage()


# A rebuild function with its keyword arguments, pickled by reference to torch's own.
_partial: Callable[..., Any] = functools.partial


def _memory_of(host: Any) -> pickle.PickleBuffer | bytes:
    """A CPU storage's own memory as a buffer (uncopied; the buffer keeps it alive)."""
    size = host.nbytes()
    if not size:
        return b""
    memory = (ctypes.c_ubyte * size).from_address(host.data_ptr())
    memory.storage = host
    return pickle.PickleBuffer(memory)


def pack(obj: Any) -> Parcel:
    """``obj`` as a parcel for a worker (blocking, seconds for a large GPU model, whose
    weights are copied to the host; call it off the event loop). A CPU model's weights are
    its own memory, uncopied: what a worker receives is what they hold when the job is
    sent. Raises ``TypeError`` when it cannot be sent."""
    buffer = io.BytesIO()
    weights: list[pickle.PickleBuffer] = []
    copies = _HostCopies()
    pickler = _MainSeen(buffer, weights, copies)
    try:
        pickler.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        return _by_value(obj, f"{type(exc).__name__}: {exc}", copies)
    if not pickler.main_names:
        return Parcel(buffer.getvalue(), "reference", _raw(weights))
    # A worker has no ``__main__`` of the program's, and must not make one by running
    # the program's script: what lives there travels by value.
    return _by_value(obj, f"{', '.join(sorted(pickler.main_names))} defined in the program's __main__", copies)


def import_pickler() -> None:
    """Import ``cloudpickle`` now, where it is installed (a model of ``__main__`` travels
    with it), so that the caller may do it where imports are made in the background
    (``threads.imports_yielding``): compiling its source, where it has no bytecode, held
    the interpreter lock 10 ms."""
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        pass


def _by_value(obj: Any, why: str, copies: _HostCopies) -> Parcel:
    try:
        import cloudpickle
    except ImportError:
        raise TypeError(
            f"the model cannot be sent to a worker process ({why}): move its class into an importable module, "
            "or install cloudpickle to send it by value (a worker never runs the program's script)"
        ) from None
    torch = sys.modules.get("torch")

    class Offering(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if not _offered_at(obj, torch):
                reduced = _storage_reduction(obj, torch, copies)
                if reduced is not NotImplemented:
                    return reduced
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    weights: list[pickle.PickleBuffer] = []
    try:
        Offering(buffer, protocol=5, buffer_callback=weights.append).dump(obj)
        return Parcel(buffer.getvalue(), "cloudpickle", _raw(weights))
    except Exception as exc:
        raise TypeError(f"the model cannot be sent to a worker process: {type(exc).__name__}: {exc}") from exc


def _raw(weights: list[pickle.PickleBuffer]) -> tuple[memoryview, ...]:
    return tuple(weight.raw() for weight in weights)


# -- the worker's half --------------------------------------------------------------------------


def unpack(parcel: Parcel) -> Any:
    """The object again, in a worker (whatever came by value with ``cloudpickle`` is
    rebuilt from the parcel alone: no script is run)."""
    return pickle.loads(parcel.data, buffers=parcel.weights)


def digest(parcel: Parcel) -> str:
    """A short hash of the parcel, for names."""
    hashed = hashlib.sha256(parcel.data)
    for weight in parcel.weights:
        hashed.update(weight)
    return hashed.hexdigest()[:16]
