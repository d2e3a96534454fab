"""The one state-machine helper that every process manager of aiocompile uses: a worker of
the pool (``handle``), a benchmark process (``_tuning.benchproc``), a job handed to a
foreign executor (``_foreign.sent``).

Each machine names its states and its events as enums and every allowed move in one table,
``{(state, event): next_state}``; everything else asks the machine rather than keeping
flags of its own. A move the table does not allow is a bug in the caller, and raises
:class:`InvalidTransition` at once instead of leaving the object in a state nobody planned.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from typing import TypeVar

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class Label(enum.Enum):
    """An enum of states or events: its members hash by identity (as they compare), which a
    table's lookup does on every move, in C rather than through ``Enum.__hash__``."""

    __hash__ = object.__hash__


class InvalidTransition(RuntimeError):
    """An object was asked to do what its state does not allow: a bug in aiocompile."""


class Transitions(Mapping[tuple[S, E], S]):
    """The moves a kind of object may make, ``{(state, event): next_state}``; ``what``
    names the kind in messages. Read-only."""

    def __init__(self, what: str, table: Mapping[tuple[S, E], S]) -> None:
        self.what = what
        self._table = dict(table)

    def __getitem__(self, move: tuple[S, E]) -> S:
        return self._table[move]

    def __iter__(self) -> Iterator[tuple[S, E]]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def after(self, state: S, event: E, who: object = None) -> S:
        """The state after ``event`` in ``state``; :class:`InvalidTransition` if there is
        none. ``who`` says which object in the message, a process by its pid (the message
        is made only then: a move is made on every job's way)."""
        target = self._table.get((state, event))
        if target is None:
            name = "" if who is None else f" (pid {who})" if isinstance(who, int) else f" ({who})"
            raise InvalidTransition(f"a {state.value} {self.what}{name} cannot take {event.value!r}")
        return target

    def events(self, state: S) -> set[E]:
        """The events ``state`` may take."""
        return {event for (source, event) in self._table if source is state}

    def reachable(self, start: S) -> set[S]:
        """Every state some moves lead to from ``start`` (``start`` included)."""
        seen, frontier = {start}, [start]
        while frontier:
            state = frontier.pop()
            for (source, _), target in self._table.items():
                if source is state and target not in seen:
                    seen.add(target)
                    frontier.append(target)
        return seen


def from_every(states: Iterable[S], event: E, target: S) -> dict[tuple[S, E], S]:
    """``event`` taking every state of ``states`` to ``target`` (a death, say)."""
    return {(state, event): target for state in states}
