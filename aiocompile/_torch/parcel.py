"""Sending a model to a worker process: its code by reference, its weights by value.

A server's model is usually an instance of a class defined in an importable module, or
in the server's own script (``python serve.py``: the class lives in ``__main__``, which a
worker never imports). So a model travels as a :class:`Parcel`:

- the module pickled as usual: classes and functions by reference, tensors (weights and
  buffers) by value;
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

import hashlib
import io
import pickle
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any

from aiocompile._pool import serialize


@dataclass(frozen=True)
class Parcel:
    """A pickled model (or any object) and what unpickling it needs."""

    data: bytes = field(repr=False)
    how: str
    """``reference`` or ``cloudpickle``."""

    @property
    def size(self) -> int:
        return len(self.data)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Sent to the pool's own workers, the pickled model goes beside the job's pickle,
        # uncopied (``serialize.out_of_band``).
        data = serialize.out_of_band(self.data) if protocol >= 5 else self.data
        return _parcel, (data, self.how)


def _parcel(data: Any, how: str) -> Parcel:
    return Parcel(serialize.as_bytes(data), how)


class _MainSeen(pickle.Pickler):
    """A pickler that notes whether anything was pickled by reference into ``__main__``,
    and lets other threads run between two tensors.

    Packing runs in a thread of the serving process while its calls go on, and copying
    the weights holds the interpreter lock: a serving thread that lets go of the lock (a
    GPU synchronisation, a socket's write) would wait for the packer to be made to give
    it back, up to the switch interval (5 ms) each time. Offering the lock before each
    tensor bounds that wait by one tensor's copy."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.main_names: set[str] = set()
        self._tensor = _tensor_type()

    def reducer_override(self, obj: Any) -> Any:
        if not _offered_at(obj, self._tensor) and isinstance(obj, (type, types.FunctionType)) \
                and getattr(obj, "__module__", None) == "__main__":
            self.main_names.add(getattr(obj, "__qualname__", repr(obj)))
        return NotImplemented


def _tensor_type() -> type | None:
    """``torch.Tensor`` when torch is imported (a model's weights are then tensors)."""
    return getattr(sys.modules.get("torch"), "Tensor", None)


def _offered_at(obj: Any, tensor: type | None) -> bool:
    """Before a tensor is copied, offer the interpreter lock to a waiting thread (see
    :class:`_MainSeen`); whether ``obj`` is one."""
    if tensor is not None and isinstance(obj, tensor):
        time.sleep(0)
        return True
    return False


def pack(obj: Any) -> Parcel:
    """``obj`` as a parcel for a worker (blocking: copies every weight; call it off the
    event loop). Raises ``TypeError`` when it cannot be sent."""
    buffer = io.BytesIO()
    pickler = _MainSeen(buffer)
    try:
        pickler.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        return _by_value(obj, f"{type(exc).__name__}: {exc}")
    if not pickler.main_names:
        return Parcel(buffer.getvalue(), "reference")
    # A worker has no ``__main__`` of the program's, and must not make one by running
    # the program's script: what lives there travels by value.
    return _by_value(obj, f"{', '.join(sorted(pickler.main_names))} defined in the program's __main__")


def _by_value(obj: Any, why: str) -> Parcel:
    try:
        import cloudpickle
    except ImportError:
        raise TypeError(
            f"the model cannot be sent to a worker process ({why}): move its class into an importable module, "
            "or install cloudpickle to send it by value (a worker never runs the program's script)"
        ) from None
    tensor = _tensor_type()

    class Offering(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            _offered_at(obj, tensor)
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    try:
        Offering(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return Parcel(buffer.getvalue(), "cloudpickle")
    except Exception as exc:
        raise TypeError(f"the model cannot be sent to a worker process: {type(exc).__name__}: {exc}") from exc


# -- the worker's half --------------------------------------------------------------------------


def unpack(parcel: Parcel) -> Any:
    """The object again, in a worker (whatever came by value with ``cloudpickle`` is
    rebuilt from the parcel alone: no script is run)."""
    return pickle.loads(parcel.data)


def digest(parcel: Parcel) -> str:
    """A short hash of the parcel, for names."""
    return hashlib.sha256(parcel.data).hexdigest()[:16]
