"""Reading an event log back: a plain-text summary and a timeline of the workers.

``read_events(path)`` parses the JSON-lines file that ``event_log=`` appends to (see
``events``) back into the frozen values it was written from: a :class:`JobRecord` per
request, a :class:`WorkerEvent` per attempt (``job_ended``) and per worker coming and
going. ``summary_table(events)`` renders them as text; ``draw_timeline(events, png)``
draws one lane per worker with a bar per attempt.

A log is not always tidy. Several schedulers (and processes) may append to one file, so
events are ordered by their own timestamps, not by line; a process killed while writing
leaves its last line cut short, so a line that is not a whole event is skipped and
counted, never fatal; event kinds this version does not know are passed over.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from aiocompile.records import FAILURES, OUTCOMES, JobRecord, Outcome, WorkerEvent

__all__ = ["Events", "draw_timeline", "read_events", "summary_table"]

_RECORD_FIELDS = frozenset(field.name for field in dataclasses.fields(JobRecord))
_WORKER_FIELDS = frozenset(field.name for field in dataclasses.fields(WorkerEvent))
_RECORD_TIMES = ("queued_at", "finished_at", "total_time")

# Worker exits that were not the pool's own choice: marked on the timeline, spelled out
# with their exit status in the summary.
_DEATHS = ("crashed", "timeout", "killed", "start_failed")

# An attempt's start and its worker's start and exit are stamped in different places, so
# they may disagree by a moment; within this many seconds an attempt still belongs to
# that worker rather than to another process that had the same pid.
_PID_REUSE_SLACK = 1.0


@dataclass(frozen=True)
class Events:
    """What an event log holds, each kind in time order."""

    requests: tuple[JobRecord, ...] = ()
    """One record per request (``"request"`` lines), by ``finished_at``."""
    attempts: tuple[WorkerEvent, ...] = ()
    """One ``job_ended`` event per attempt at a job, by ``time``."""
    workers: tuple[WorkerEvent, ...] = ()
    """``worker_started`` and ``worker_exited`` events, by ``time``."""
    skipped: int = 0
    """Lines that were not a whole event: cut short, not JSON, or missing fields."""
    warnings: tuple[str, ...] = ()
    """What the schedulers that wrote the log warned of (``"warning"`` lines), each once,
    in order."""

    @property
    def empty(self) -> bool:
        return not (self.requests or self.attempts or self.workers)

    @property
    def span(self) -> tuple[float, float] | None:
        """The first and last moment any event mentions, or None for no events."""
        moments = [t for record in self.requests for t in (record.queued_at, record.finished_at)]
        moments += [event.time for event in self.attempts + self.workers]
        moments += [event.started_at for event in self.attempts if event.started_at is not None]
        return (min(moments), max(moments)) if moments else None


# -- reading ---------------------------------------------------------------------------------


class _Unreadable(ValueError):
    """A line that is not a whole event."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _record(data: dict[str, Any]) -> JobRecord:
    if not isinstance(data.get("name"), str) or not isinstance(data.get("outcome"), str):
        raise _Unreadable("a request without name or outcome")
    if not all(_is_number(data.get(name)) for name in _RECORD_TIMES):
        raise _Unreadable("a request without its times")
    fields = {name: value for name, value in data.items() if name in _RECORD_FIELDS}
    stages = data.get("stages") or {}
    if not isinstance(stages, dict) or not all(_is_number(v) for v in stages.values()):
        raise _Unreadable("stages that are not a dict of seconds")
    fields["stages"] = tuple(stages.items())
    try:
        fields["outcome"] = Outcome(fields["outcome"])
    except ValueError:
        raise _Unreadable(f"an outcome that is none: {fields['outcome']!r}") from None
    try:
        return JobRecord(**fields)
    except TypeError as exc:  # a required field is missing
        raise _Unreadable(str(exc)) from None


def _worker_event(data: dict[str, Any]) -> WorkerEvent:
    if not _is_number(data.get("time")):
        raise _Unreadable("a worker event without its time")
    if data["event"] == "job_ended" and not (_is_number(data.get("started_at")) and isinstance(data.get("pid"), int)):
        raise _Unreadable("an attempt without its worker or start")
    fields = {name: value for name, value in data.items() if name in _WORKER_FIELDS}
    try:
        return WorkerEvent(**fields)
    except TypeError as exc:
        raise _Unreadable(str(exc)) from None


def _decode(line: str) -> JobRecord | WorkerEvent | str | None:
    """The event on one line (a warning's message for a ``"warning"``); None for a kind
    this reader passes over."""
    try:
        data = json.loads(line)
    except ValueError:
        raise _Unreadable("not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("event"), str):
        raise _Unreadable("not an event")
    kind = data["event"]
    if kind == JobRecord.event:
        return _record(data)
    if kind in ("job_ended", "worker_started", "worker_exited"):
        return _worker_event(data)
    if kind == "warning":
        if not isinstance(data.get("message"), str):
            raise _Unreadable("a warning without its message")
        return str(data["message"])
    return None


def read_events(path: str | os.PathLike[str]) -> Events:
    """Parse an event log. Raises ``FileNotFoundError`` (an ``OSError``) if it cannot be
    opened; lines that are not whole events are counted in ``Events.skipped``."""
    requests: list[JobRecord] = []
    attempts: list[WorkerEvent] = []
    workers: list[WorkerEvent] = []
    warnings: dict[str, None] = {}
    skipped = 0
    # A line cut short may end inside a multi-byte character: replace rather than fail,
    # and let the JSON decoder reject that line alone.
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not line.strip():
                continue
            try:
                event = _decode(line)
            except _Unreadable:
                skipped += 1
                continue
            if isinstance(event, JobRecord):
                requests.append(event)
            elif isinstance(event, str):
                warnings[event] = None
            elif event is not None:
                (attempts if event.event == "job_ended" else workers).append(event)
    return Events(
        requests=tuple(sorted(requests, key=lambda record: record.finished_at)),
        attempts=tuple(sorted(attempts, key=lambda event: event.time)),
        workers=tuple(sorted(workers, key=lambda event: event.time)),
        skipped=skipped,
        warnings=tuple(warnings),
    )


# -- workers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Worker:
    """One worker process's life as the log tells it; None where the log does not say."""

    pid: int
    started: float | None
    exited: float | None
    status: str | None
    """How it exited (``worker_exited``'s status)."""
    exitcode: int | None
    attempts: tuple[WorkerEvent, ...]

    @property
    def first_seen(self) -> float:
        moments = [self.started, self.exited] + [_attempt_start(attempt) for attempt in self.attempts]
        return min(t for t in moments if t is not None)

    @property
    def busy(self) -> float:
        return sum(attempt.time - _attempt_start(attempt) for attempt in self.attempts)

    def lifetime(self, log_end: float) -> float:
        """Seconds from its start (or first job) to its exit (or the end of the log)."""
        return (log_end if self.exited is None else self.exited) - self.first_seen


def _attempt_start(attempt: WorkerEvent) -> float:
    return attempt.time if attempt.started_at is None else attempt.started_at


def _workers(events: Events) -> list[_Worker]:
    """Every worker process in the log, in the order they first appear.

    Keyed by pid, except that a pid seen starting again is a new process (the system
    reused the number), and each attempt goes to the process whose pid it names and
    whose life (as far as the log knows it) covers the attempt's start.
    """
    lives: dict[int, list[dict[str, Any]]] = {}
    for event in events.workers:
        if event.pid is None:
            continue
        same_pid = lives.setdefault(event.pid, [])
        if event.event == "worker_started":
            same_pid.append(_new_life(event.pid, started=event.time))
        elif same_pid and same_pid[-1]["exited"] is None:
            same_pid[-1].update(exited=event.time, status=event.status, exitcode=event.exitcode)
        else:  # its start is not in the log
            same_pid.append(_new_life(event.pid, exited=event.time, status=event.status, exitcode=event.exitcode))
    for attempt in events.attempts:
        assert attempt.pid is not None  # _worker_event refuses attempts without one
        same_pid = lives.setdefault(attempt.pid, [])
        owner = _covering(same_pid, _attempt_start(attempt))
        if owner is None:  # neither start nor exit of its worker is in the log
            owner = _new_life(attempt.pid)
            same_pid.append(owner)
        owner["attempts"].append(attempt)
    workers = [
        _Worker(life["pid"], life["started"], life["exited"], life["status"], life["exitcode"],
                tuple(life["attempts"]))
        for same_pid in lives.values() for life in same_pid
    ]
    return sorted(workers, key=lambda worker: worker.first_seen)


def _covering(lives: list[dict[str, Any]], moment: float) -> dict[str, Any] | None:
    for life in lives:
        begins = -math.inf if life["started"] is None else life["started"] - _PID_REUSE_SLACK
        ends = math.inf if life["exited"] is None else life["exited"] + _PID_REUSE_SLACK
        if begins <= moment <= ends:
            return life
    return None


def _new_life(pid: int, **known: Any) -> dict[str, Any]:
    life: dict[str, Any] = {"pid": pid, "started": None, "exited": None, "status": None, "exitcode": None,
                            "attempts": []}
    life.update(known)
    return life


def _exit_text(status: str | None, exitcode: int | None) -> str:
    """How a worker (or an attempt) ended, with the signal or exit status where that
    was not the pool's own doing."""
    if status is None:
        return "still running at the end of the log"
    if status not in _DEATHS or exitcode is None:
        return status
    if exitcode < 0:
        try:
            return f"{status} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"{status} (signal {-exitcode})"
    return f"{status} (exit status {exitcode})"


# -- the text report ------------------------------------------------------------------------


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], align: str = "l") -> list[str]:
    """Columns padded to their widest cell, aligned as ``align`` says column by column:
    ``l`` or ``r``; columns past its end (numbers, mostly) are ``r``."""
    rows = [list(row) for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    align = align.ljust(len(widths), "r")

    def line(cells: Sequence[str]) -> str:
        padded = [cell.ljust(width) if how == "l" else cell.rjust(width)
                  for cell, width, how in zip(cells, widths, align)]
        return "  ".join(padded).rstrip()

    return [line(headers)] + [line(row) for row in rows]


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1000
    return f"{ms:.1f}" if ms < 10 else f"{ms:.0f}"


def _clock(moment: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(moment))


def _header(events: Events, workers: list[_Worker]) -> list[str]:
    span = events.span
    if span is None:
        return ["no events"]
    start, end = span
    lines = [
        f"{end - start:.2f} s of events, from {_clock(start)} to {_clock(end)}: "
        f"{len(events.requests)} requests, {len(events.attempts)} attempts, {len(workers)} workers"
    ]
    if events.skipped:
        lines.append(f"{events.skipped} unreadable line(s) skipped")
    return lines


def _outcome_table(requests: Sequence[JobRecord]) -> list[str]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for record in requests:
        counts[record.outcome] = counts.get(record.outcome, 0) + 1
    total = len(requests)
    rows = [(outcome, str(n), f"{100 * n / total:.0f}%") for outcome, n in counts.items() if n]
    rows.append(("total", str(total), ""))
    return _table(("outcome", "requests", "share"), rows)


def _kernel_table(requests: Sequence[JobRecord]) -> list[str]:
    groups: dict[tuple[str, str | None], list[JobRecord]] = {}
    for record in requests:
        groups.setdefault((record.name, record.target), []).append(record)
    # Stage columns in the order the compiler reports them, whoever reported them first.
    stages = list(dict.fromkeys(stage for record in requests for stage, _ in record.stages))

    def worker_seconds(group: list[JobRecord]) -> float:
        return sum(record.run_time or 0.0 for record in group)

    rows = []
    for (name, target), group in sorted(groups.items(), key=lambda item: worker_seconds(item[1]), reverse=True):
        outcomes: list[str] = [str(record.outcome) for record in group]
        run_times = sorted(record.run_time for record in group
                           if record.outcome == "compiled" and record.run_time is not None)
        stage_means = []
        for stage in stages:
            seconds = [record.stage_times[stage] for record in group if stage in record.stage_times]
            stage_means.append(_ms(statistics.fmean(seconds)) if seconds else "-")
        rows.append([
            name, target or "-", str(len(group)), str(outcomes.count("compiled")),
            str(sum(outcomes.count(hit) for hit in ("cache_hit", "disk_hit", "shared_hit"))),
            str(outcomes.count("joined")),
            str(sum(outcomes.count(failure) for failure in FAILURES)),
            _ms(statistics.median_low(run_times)) if run_times else "-",
            _ms(run_times[-1]) if run_times else "-",
            *stage_means,
        ])
    headers = ("kernel", "target", "requests", "compiled", "hits", "joined", "failed", "p50 ms", "max ms", *stages)
    note = "p50 and max: worker run time of compiled requests"
    if stages:
        note += f"; {stages[0]}..{stages[-1]}: mean ms per stage"
    return _table(headers, rows, align="ll") + [f"({note}; slowest kernels first)"]


def _worker_table(workers: list[_Worker], log_end: float) -> list[str]:
    warm_ups = [sum(attempt.warm_up for attempt in worker.attempts) for worker in workers]
    rows = []
    for worker, warm in zip(workers, warm_ups):
        lifetime = worker.lifetime(log_end)
        use = f"{100 * worker.busy / lifetime:.0f}%" if lifetime > 0 else "-"
        counts = [str(len(worker.attempts) - warm)] + ([str(warm)] if any(warm_ups) else [])
        rows.append([str(worker.pid), *counts, f"{worker.busy:.2f}", f"{lifetime:.2f}", use,
                     _exit_text(worker.status, worker.exitcode)])
    counted = ["jobs"] + (["warm-ups"] if any(warm_ups) else [])
    headers = ["worker", *counted, "busy s", "alive s", "busy", "exit"]
    return _table(headers, rows, align="l" + "r" * (len(headers) - 2) + "l")


def _failure_lines(events: Events, start: float) -> list[str]:
    rows = []
    for attempt in events.attempts:
        if attempt.status not in ("crashed", "timeout"):
            continue
        took = attempt.time - _attempt_start(attempt)
        rows.append([f"+{attempt.time - start:.2f} s", str(attempt.pid), attempt.name or "?",
                     str(attempt.attempt), f"{took:.2f} s", _exit_text(attempt.status, attempt.exitcode)])
    if not rows:
        return []
    return _table(("at", "worker", "kernel", "attempt", "after", "ended"), rows, align="rrlrrl")


def summary_table(events: Events) -> str:
    """A plain-text report of an event log: its span, the requests by outcome, a line per
    kernel (slowest first), a line per worker, and every crash and timeout."""
    workers = _workers(events)
    sections = [_header(events, workers)]
    span = events.span
    if span is None:
        return "\n".join(sections[0]) + "\n"
    if events.requests:
        sections.append(_outcome_table(events.requests))
        sections.append(_kernel_table(events.requests))
    if workers:
        sections.append(_worker_table(workers, span[1]))
    failures = _failure_lines(events, span[0])
    if failures:
        sections.append(["crashes and timeouts:"] + ["  " + line for line in failures])
    if events.warnings:
        sections.append(["warnings:"] + ["  " + warning for warning in events.warnings])
    return "\n\n".join("\n".join(section) for section in sections) + "\n"


# -- the timeline ----------------------------------------------------------------------------

# category: (bar colour, colour of the kernel name written inside), in legend order.
_PALETTE = {
    "ok": ("#3a9d4a", "white"),
    "warm-up": ("#9ecae1", "black"),
    "error": ("#f28e2b", "black"),
    "crashed": ("#d62728", "white"),
    "timeout": ("#7b3fa0", "white"),
    "cancelled/closed": ("#9e9e9e", "black"),
    "lost": ("#dcdcdc", "black"),
    "other": ("#555555", "white"),
}
_LANE_HEIGHT = 0.62
_MIN_LABEL_PIXELS = 20.0
"""Bars narrower than this get no name: not even a few letters would fit."""


def _category(attempt: WorkerEvent) -> str:
    # A warm-up that failed is shown as the failure it was: that is what to look at.
    if attempt.warm_up and attempt.status == "ok":
        return "warm-up"
    if attempt.status in ("cancelled", "closed"):
        return "cancelled/closed"
    return attempt.status if attempt.status in _PALETTE else "other"


def _lanes(events: Events) -> list[_Worker]:
    # A worker that ran nothing, was not seen starting and left as asked (say, one
    # started during a shutdown) would be an empty lane with nothing to say.
    return [worker for worker in _workers(events)
            if worker.attempts or worker.started is not None or worker.status in _DEATHS]


def draw_timeline(events: Events, path: str | os.PathLike[str], *, title: str | None = None) -> None:
    """Write a PNG of the workers over time: a lane per worker process, a bar per attempt
    at a job coloured by how it ended, the worker's lifetime as a thin line, and an x
    where a worker died (crashed, killed for a timeout or a cancel, or failed to start).

    Raises ``ValueError`` when the log holds no attempts (there is nothing to draw), and
    ``ImportError`` without matplotlib (``pip install 'aiocompile[plot]'``).
    """
    span = events.span
    if span is None or not events.attempts:
        raise ValueError("the events hold no job attempts: there is no timeline to draw")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError("drawing a timeline needs matplotlib: pip install 'aiocompile[plot]'") from exc

    start, end = span
    length = max(end - start, 1e-3)
    lanes = _lanes(events)
    # A Figure with its own Agg canvas: no pyplot, no global figure registry or backend.
    figure = Figure(figsize=(12, 1.6 + 0.45 * len(lanes)), dpi=100, layout="constrained")
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_subplot()

    bars: list[tuple[float, float, int, WorkerEvent]] = []
    died = False
    for lane, worker in enumerate(lanes):
        first = worker.first_seen - start
        last = (end if worker.exited is None else worker.exited) - start
        axes.hlines(lane, first, last, colors="#777777", linewidth=1, zorder=1)
        if worker.status in _DEATHS and worker.exited is not None:
            axes.plot(last, lane, marker="x", color="black", markersize=9, markeredgewidth=2, zorder=4)
            died = True
        for attempt in worker.attempts:
            left = _attempt_start(attempt) - start
            # Jobs of a few milliseconds in a log of minutes would not show at all: draw
            # every bar at least a sliver wide.
            width = max(attempt.time - _attempt_start(attempt), length / 600)
            bars.append((left, width, lane, attempt))
    used = list(dict.fromkeys(sorted((_category(a) for *_, a in bars), key=list(_PALETTE).index)))
    half = _LANE_HEIGHT / 2
    for category in used:
        # One collection per colour rather than a patch per bar: a log of thousands of
        # jobs draws in a moment.
        rectangles = [[(left, lane - half), (left + width, lane - half), (left + width, lane + half),
                       (left, lane + half)]
                      for left, width, lane, attempt in bars if _category(attempt) == category]
        axes.add_collection(PolyCollection(rectangles, facecolors=_PALETTE[category][0], edgecolors="white",
                                           linewidths=0.6, zorder=2), autolim=False)

    axes.set_yticks(range(len(lanes)), labels=[f"worker {worker.pid}" for worker in lanes])
    axes.set_ylim(len(lanes) - 0.5, -0.5)  # the first worker on top
    axes.set_xlim(0, length * 1.01)
    axes.set_xlabel("seconds since the first event")
    axes.grid(axis="x", color="#e4e4e4", linewidth=0.8)
    axes.set_axisbelow(True)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    handles: list[Any] = [Patch(color=_PALETTE[category][0], label=category) for category in used]
    handles.append(Line2D([], [], color="#777777", linewidth=1, label="worker alive"))
    if died:
        handles.append(Line2D([], [], color="black", marker="x", linestyle="none", markersize=8, markeredgewidth=2,
                              label="worker died"))
    axes.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncols=min(len(handles), 9),
                frameon=False, fontsize=9, handlelength=1.4, columnspacing=1.2)
    figure.suptitle(title or _default_title(events, len(lanes), end - start), fontsize=11)

    # Names go inside bars that have room for them, which is known in pixels only once
    # the layout is settled; they stay out of the layout so it does not move again.
    canvas.draw()
    renderer = canvas.get_renderer()
    for left, width, lane, attempt in bars:
        (x0, _), (x1, _) = axes.transData.transform([(left, lane), (left + width, lane)])
        room = x1 - x0 - 6
        if room < _MIN_LABEL_PIXELS:
            continue
        label = axes.text(left + width / 2, lane, attempt.name or "?", ha="center", va="center", fontsize=8,
                          color=_PALETTE[_category(attempt)][1], clip_on=True, zorder=3)
        label.set_in_layout(False)
        if not _shorten_to_fit(label, room, renderer):
            label.remove()
    figure.savefig(os.fspath(path), format="png")


def _shorten_to_fit(label: Any, room: float, renderer: Any) -> bool:
    """Cut the label's text down (ending in an ellipsis) until it is at most ``room``
    pixels wide; False if not even its first three letters fit."""
    name = label.get_text()
    width = label.get_window_extent(renderer).width
    if width <= room:
        return True
    # Start from the length that fits in proportion, then step down to what really fits
    # (letters differ in width).
    keep = min(len(name) - 1, int(len(name) * room / width))
    while keep >= 3:
        label.set_text(name[:keep] + "\u2026")
        if label.get_window_extent(renderer).width <= room:
            return True
        keep -= 1
    return False


def _default_title(events: Events, workers: int, seconds: float) -> str:
    return (f"{len(events.requests)} requests, {len(events.attempts)} attempts "
            f"on {workers} worker{'s' if workers != 1 else ''} over {seconds:.1f} s")
