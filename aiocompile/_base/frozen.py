"""Frozen dataclasses made in a hurry, where one is made for every request.

A frozen dataclass's ``__init__`` sets each field with a call to ``object.__setattr__``
(it must get past its own ``__setattr__``, which refuses): for the nineteen fields of a
``JobRecord`` that was most of the cost of making one, paid on every request's way out,
and for a ``Request``, on every ``run()``'s way in. :func:`build` fills the instance's
``__dict__`` in one step instead. It is only for plain frozen dataclasses (no
``__post_init__``, no ``__slots__``, no field needing a default), given every field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

_FIELDS: dict[type, frozenset[str]] = {}


def build(cls: type[T], values: dict[str, Any]) -> T:
    """``cls(**values)``, for a frozen dataclass ``cls`` and a value for every field."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(field.name for field in dataclasses.fields(cls))  # type: ignore[arg-type]
    if len(values) != len(names):
        raise TypeError(f"{cls.__name__} needs every field: {sorted(names)}, got {sorted(values)}")
    instance: T = object.__new__(cls)
    instance.__dict__.update(values)
    return instance
