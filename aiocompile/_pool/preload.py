"""What a fork server (or a fresh worker) loads before its first job: its preload entries.

``module`` is imported; ``module:function`` is imported and ``function()`` called. A
function may be a generator: what it does before its first ``yield`` happens at once, each
later step when ``step()`` is called, one at a time, so that a fork server can warm up
between forks. A broken entry makes workers slower, not wrong, so it is reported in
``problems`` rather than raised.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Iterator
from typing import Any


class Preload:
    """The preload entries: ``module`` is imported; ``module:function`` is imported and
    ``function()`` called. A function may be a generator: what it does before its first
    ``yield`` happens at once, each later step by ``step()``, one at a time.

    A broken entry makes workers slower, not wrong, so it is reported in ``problems``
    rather than raised.
    """

    def __init__(self, entries: list[str]) -> None:
        self.problems: list[str] = []
        self._steps: list[tuple[str, Iterator[Any]]] = []
        for entry in entries:
            module_name, _, func_name = entry.partition(":")
            try:
                module = importlib.import_module(module_name)
                result = getattr(module, func_name)() if func_name else None
                if isinstance(result, Iterator):
                    self._steps.append((entry, result))
                    self.step()
            except Exception:
                self.problems.append(f"preloading {entry!r} failed:\n{traceback.format_exc()}")

    @property
    def pending(self) -> bool:
        return bool(self._steps)

    def step(self) -> None:
        """Run the next step of the first unfinished entry."""
        if not self._steps:
            return
        entry, steps = self._steps[0]
        try:
            next(steps)
        except StopIteration:
            self._steps.pop(0)
        except Exception:
            self._steps.pop(0)
            self.problems.append(f"preloading {entry!r} failed:\n{traceback.format_exc()}")

    def finish(self) -> list[str]:
        while self._steps:
            self.step()
        return self.problems
