"""Sending a model to a worker process: its code by reference, its weights by value.

A server's model is usually an instance of a class defined in an importable module, or
in the server's own script (``python serve.py``: the class lives in ``__main__``, which a
worker never imports). So a model travels as a :class:`Parcel`:

- the module pickled as usual: classes and functions by reference, tensors (weights and
  buffers) by value;
- when something it references lives in ``__main__``: the main script's path and text,
  which the worker executes as a module of its own (``__aiocompile_main__``, so that an
  ``if __name__ == "__main__":`` block does not run: the rule ``multiprocessing`` sets
  for spawned processes) and reads those references from;
- when ``__main__`` has no file (a notebook, ``python -c``) or the class is local to a
  function: by value with ``cloudpickle``, if it is installed.

Anything else that will not pickle (a lock, an open file held by the model) raises
``TypeError`` here, in the parent, saying what.

Nothing here imports torch at module level: the worker's half runs in a process that has
it already.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import pickle
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any

MAIN_ALIAS = "__aiocompile_main__"


@dataclass(frozen=True)
class Parcel:
    """A pickled model (or any object) and what unpickling it needs."""

    data: bytes = field(repr=False)
    how: str
    """``reference``, ``main-script`` or ``cloudpickle``."""
    main_path: str | None = None
    main_source: str | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.data) + len(self.main_source or "")


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
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return _by_value(obj, f"{', '.join(sorted(pickler.main_names))} defined in __main__, which has no file")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    return Parcel(buffer.getvalue(), "main-script", os.path.abspath(path), source)


def _by_value(obj: Any, why: str) -> Parcel:
    try:
        import cloudpickle
    except ImportError:
        raise TypeError(
            f"the model cannot be sent to a worker process ({why}); define its class in an importable module or "
            "in the program's main script, or install cloudpickle to send it by value"
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


class _MainUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, main: types.ModuleType | None) -> None:
        super().__init__(file)
        self._main = main

    def find_class(self, module: str, name: str) -> Any:
        if module == "__main__" and self._main is not None:
            target: Any = self._main
            for part in name.split("."):
                target = getattr(target, part)
            return target
        return super().find_class(module, name)


def unpack(parcel: Parcel) -> Any:
    """The object again, in a worker. A parcel that refers into the main script executes
    that script as the module ``__aiocompile_main__`` first (its directory first on
    ``sys.path``, as when it ran as a script)."""
    if parcel.how == "cloudpickle":
        return pickle.loads(parcel.data)
    main = None
    if parcel.how == "main-script":
        assert parcel.main_path is not None and parcel.main_source is not None
        main = load_main(parcel.main_path, parcel.main_source)
    return _MainUnpickler(io.BytesIO(parcel.data), main).load()


def load_main(path: str, source: str) -> types.ModuleType:
    """Execute a main script's text as a module named ``__aiocompile_main__``."""
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    spec = importlib.util.spec_from_loader(MAIN_ALIAS, loader=None, origin=path)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = path
    sys.modules[MAIN_ALIAS] = module
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def digest(parcel: Parcel) -> str:
    """A short hash of the parcel, for names."""
    h = hashlib.sha256(parcel.data)
    if parcel.main_source:
        h.update(parcel.main_source.encode("utf-8"))
    return h.hexdigest()[:16]
