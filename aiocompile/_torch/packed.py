"""A model packed for the worker once, and shared by the compiles under way.

A packing (:func:`.parcel.pack`) copies every weight to the host: seconds, and a copy of
the model's size. Compiles of several input signatures under way at once share one; once
none is, it is dropped, and the next compile packs the model again (weights changed in
place since are packed as they are then). Packed in the calling thread, which runs beside
the serving process's calls (``BackgroundCompiled._submit`` hands the lock over there).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from aiocompile._base import collector, threads

if TYPE_CHECKING:
    from aiocompile._torch.parcel import Parcel

__all__ = ["PackedModel"]


class PackedModel:
    """``model``'s parcel while a compile uses it: :meth:`take` for each compile, then
    :meth:`release` once its worker has what it needs (or it failed)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._lock = threading.Lock()
        self._parcel: Parcel | None = None
        self._users = 0

    def take(self) -> Parcel:
        """The model packed: the shared parcel, or a new one. Raises what packing raised
        (a model that will not pickle), the use released."""
        with self._lock:
            parcel = self._parcel
            self._users += 1
        if parcel is None:
            with collector.imports_settled(), threads.imports_yielding():
                from aiocompile._torch import parcel as _parcel

                _parcel.import_pickler()
            try:
                parcel = _parcel.pack(self._model)
            except BaseException:
                self.release()
                raise
            with self._lock:
                if self._parcel is None:
                    self._parcel = parcel
        return parcel

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users <= 0:
                self._users = 0
                self._parcel = None
