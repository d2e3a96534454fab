"""Which configuration a tuning times when, and how long.

Timing every configuration as Triton's autotuner does (its ``do_bench``: 25 ms of warm-up
and 100 ms of runs by default) costs each at least that, one after another on a GPU,
whatever the pool does with the compiles: seconds for a list of a couple of dozen. Many of
them lose by far; many others differ by less than the timings' own noise. So a tuning
goes in two rounds (``SchedulerConfig.tuning_screen``):

1. **Short**: each configuration, as soon as it has compiled (in whatever order the
   compiles end, while the others still compile), is timed with a fifth of those times.
   A configuration that fails here (out of resources, a fault, a crash, a hang) is out,
   with its reason.
2. **Full**: of those whose short timing is within ``margin`` of the fastest, the
   ``FULL_AT_MOST`` fastest are timed as the autotuner times them, in the autotuner's
   order; the fastest of these wins, as Triton's ``min`` picks it. The others keep their
   short timing, with why they were left out.
   With one configuration left, its short timing decides: there is nothing to compare.
   If every one timed in full then fails, those left out come back, ranked by their
   short timings.

Without the short round (``tuning_screen=None``, a ``do_bench`` or CUDA graphs of the
kernel's own, fewer than ``MIN_CONFIGS`` configurations) each configuration is timed in
full as soon as it and those before it in the autotuner's order have compiled, as Triton
times them in order. (The order matters on a GPU whose clocks drop as it warms up under
timings run back to back: the configurations listed first, often the favourites, are
timed first.)
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiocompile._tuning.benchpool import Timed
from aiocompile._tuning.plan import DO_BENCH_DEFAULTS

MIN_CONFIGS = 4
"""Fewer configurations than this are timed in full at once: a short round would save
less than it costs."""
FULL_AT_MOST = 4
"""Of those within the margin, the fastest this many are timed in full. Short timings
agree with Triton's own of the same configurations as closely as full timings run back to
back after them do (those drift up as the GPU warms; docs/benchmarks.md, Autotuning):
timing more of them in full would sharpen nothing."""
SHORT_FRACTION = 0.2
"""The short round's share of the autotuner's warm-up and repetition times."""


@dataclass(frozen=True)
class Screen:
    """The short round: ``do_bench`` with ``warmup_ms`` and ``rep_ms``; those within
    ``margin`` times the fastest go on to the full round."""

    warmup_ms: float
    rep_ms: float
    margin: float

    @property
    def settings(self) -> tuple[float, float]:
        return (self.warmup_ms, self.rep_ms)


def screen_for(timing: tuple[Any, ...], margin: float | None, configs: int) -> Screen | None:
    """The short round for a tuning that times with ``timing`` (``Hooks.timing``), or None
    where every configuration is timed in full."""
    if margin is None or configs < MIN_CONFIGS:
        return None
    if timing[0] == "default":
        warmup, rep = DO_BENCH_DEFAULTS
    elif timing[0] == "do_bench":
        warmup, rep = float(timing[1]), float(timing[2])
    else:  # a benchmarker of the kernel's own: timed only as it says
        return None
    return Screen(warmup * SHORT_FRACTION, rep * SHORT_FRACTION, margin)


Submit = Callable[[int, Any, "tuple[float, float] | None"], "cf.Future[Timed]"]
"""Sends configuration ``index`` (its compiled kernel) to be timed, short (the settings)
or in full (None)."""
Seen = Callable[[int, Timed, str, bool], None]
"""Told of each timing's outcome, once: the configuration's index, the outcome, the round
(``"short"`` or ``"full"``), and whether it is the configuration's last."""


class Rounds:
    """The timings of one tuning. ``compiled`` is told of each compile as it ends (in any
    order); ``outcomes`` then waits for every timing and says what each configuration
    measured, and which were left out after the short round."""

    def __init__(self, order: Iterable[int], submit: Submit, screen: Screen | None) -> None:
        self._order = list(order)
        self._submit = submit
        self.screen = screen
        self._ready: dict[int, Any] = {}
        self._compiled: dict[int, Any] = {}
        self._following = 0
        self._short: dict[cf.Future[Timed], int] = {}
        self._full: dict[cf.Future[Timed], int] = {}
        self.left_out: dict[int, str] = {}
        """Configurations not timed in full, and why (their short timing stands)."""

    def compiled(self, index: int, kernel: Any | None) -> None:
        """Configuration ``index`` has compiled (``kernel``) or failed to (None)."""
        if self.screen is not None:
            if kernel is not None:
                self._compiled[index] = kernel
                self._short[self._submit(index, kernel, self.screen.settings)] = index
            return
        self._ready[index] = kernel
        while self._following < len(self._order) and self._order[self._following] in self._ready:
            following = self._order[self._following]
            ready = self._ready.pop(following)
            if ready is not None:
                self._full[self._submit(following, ready, None)] = following
            self._following += 1

    def outcomes(self, seen: Seen) -> dict[int, Timed]:
        """Every timing's outcome, by configuration (blocking: call it once every compile
        has ended)."""
        outcomes: dict[int, Timed] = {}
        if self.screen is None:
            self._wait_full(outcomes, seen)
            return outcomes
        short: dict[int, Timed] = {}
        medians: dict[int, float] = {}
        for future in cf.as_completed(self._short):
            index = self._short[future]
            outcome = short[index] = future.result()
            if outcome.ok and outcome.timings:
                medians[index] = outcome.timings[0]
            else:
                outcomes[index] = outcome
                seen(index, outcome, "short", True)
        if not medians:
            return outcomes
        kept = self._rank(medians, self.screen.margin)
        for index in medians:
            if index not in kept:
                outcomes[index] = short[index]
            seen(index, short[index], "short", index not in kept or len(kept) == 1)
        if len(kept) == 1:
            outcomes[kept[0]] = short[kept[0]]
            return outcomes
        for index in kept:  # in the autotuner's order
            self._full[self._submit(index, self._compiled[index], None)] = index
        self._wait_full(outcomes, seen)
        if not any(outcomes[index].ok for index in kept):
            # Every configuration timed in full failed there: those left out, which ran
            # in the short round, are what is left.
            self.left_out.clear()
        return outcomes

    def _rank(self, medians: dict[int, float], margin: float) -> list[int]:
        """The configurations to time in full, in the autotuner's order: the
        ``FULL_AT_MOST`` fastest of those within ``margin`` of the fastest. Why each other
        one is left out goes to ``left_out``."""
        position = {index: place for place, index in enumerate(self._order)}
        ranked = sorted(medians, key=lambda index: (medians[index], position[index]))  # equals: the autotuner's order
        fastest = medians[ranked[0]]
        near = [index for index in ranked if medians[index] <= fastest * margin]
        chosen = set(near[:FULL_AT_MOST])
        for place, index in enumerate(ranked):
            if index in chosen:
                continue
            ratio = medians[index] / fastest if fastest > 0 else float("inf")
            if index in near:
                why = f"the {_ordinal(place + 1)} fastest: only the {FULL_AT_MOST} fastest are"
            else:
                why = f"beyond {margin:g}x: only those within it are"
            self.left_out[index] = f"left out after a short timing at {ratio:.3f}x the fastest's ({why} timed in full)"
        return [index for index in self._order if index in chosen]

    def _wait_full(self, outcomes: dict[int, Timed], seen: Seen) -> None:
        for future in cf.as_completed(self._full):
            index = self._full[future]
            outcomes[index] = future.result()
            seen(index, outcomes[index], "full", True)

    def cancel(self) -> None:
        for future in (*self._short, *self._full):
            future.cancel()


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
