"""Pickling a job for a worker that has not imported the parent's ``__main__``.

Functions and classes are pickled by reference (module and name). Workers never run the
parent's main script, so a reference into ``__main__`` (a script or a notebook cell) cannot
be resolved there: such objects are pickled by value with ``cloudpickle`` when it is
installed, and otherwise refused here, at submit time, with an error that says what to do.
"""

from __future__ import annotations

import io
import pickle
import types
from typing import Any


class _MainReference(Exception):
    def __init__(self, obj: object) -> None:
        self.obj = obj


class _StrictPickler(pickle.Pickler):
    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__":
            raise _MainReference(obj)
        return NotImplemented


def dumps(obj: object) -> bytes:
    """Pickle ``obj`` for a worker. Raises ``TypeError`` if that cannot be done."""
    # The C pickler alone first: the Python-level hook below costs a call per pickled
    # object, and most jobs refer to nothing in __main__. A reference to __main__ would
    # show in the bytes as its name; such bytes (or any failure) take the careful way.
    try:
        fast = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pass
    else:
        if b"__main__" not in fast:
            return fast
    buffer = io.BytesIO()
    try:
        _StrictPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return buffer.getvalue()
    except _MainReference as ref:
        main_obj = ref.obj
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"the job cannot be sent to a worker process: {exc}") from exc
    try:
        import cloudpickle
    except ImportError:
        name = getattr(main_obj, "__qualname__", repr(main_obj))
        raise TypeError(
            f"{name!r} is defined in __main__ (a script or a notebook cell), which worker "
            "processes do not import; move it into an importable module, or install "
            "cloudpickle to send it by value"
        ) from None
    try:
        data: bytes = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"the job cannot be sent to a worker process: {exc}") from exc
    return data
