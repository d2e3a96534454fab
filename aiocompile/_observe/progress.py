"""A progress bar for many compiles.

tqdm's ``tqdm.auto`` draws it: a text bar on a terminal, the notebook widget inside
Jupyter. It shows only when asked for and when someone can see it (a terminal or a
notebook): a bar written into a log file or a pipe is noise. Without tqdm, a line at most
twice a second on a terminal.

The bar names the kernels being compiled right now: it listens to the scheduler's worker
events (``job_started``/``job_ended``), which arrive in the pool's supervisor thread, so
the names it keeps are guarded by a lock and the bar is redrawn at most five times a
second from there.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Any, Callable, TextIO

from aiocompile.records import WorkerEvent

_REDRAW_EVERY = 0.2


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (where tqdm draws a widget)."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def visible(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty()) or in_notebook()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return in_notebook()


class Progress:
    """``finished(label, ok)`` per item; ``on_event`` as a scheduler listener."""

    def __init__(
        self, total: int, *, enabled: bool, description: str = "compiling", stream: TextIO | None = None,
        names: set[str] | None = None, subscribe: Callable[[Callable[[Any], None]], Callable[[], None]] | None = None,
    ) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self._stream = stream or sys.stderr
        self._names = names
        self._lock = threading.Lock()
        self._running: collections.Counter[str] = collections.Counter()
        self._bar: Any = None
        self._plain = False
        self._last_print = 0.0
        self._last_redraw = 0.0
        self._unsubscribe: Callable[[], None] | None = None
        self.enabled = bool(enabled) and total > 0 and visible(self._stream)
        if not self.enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self._plain = True
            return
        self._bar = tqdm(total=total, desc=description, unit="kernel", file=self._stream, dynamic_ncols=True)
        if subscribe is not None:
            self._unsubscribe = subscribe(self.on_event)

    def postfix(self) -> str:
        """The kernels running now, as the bar shows them."""
        with self._lock:
            running = sorted(self._running)
        if not running:
            return ""
        shown = ", ".join(running[:2])
        return shown if len(running) <= 2 else f"{shown} +{len(running) - 2}"

    def on_event(self, event: Any) -> None:
        """A scheduler listener: keep track of which of our kernels run in a worker."""
        if not isinstance(event, WorkerEvent) or event.warm_up or event.name is None:
            return
        if event.event not in ("job_started", "job_ended"):
            return
        if self._names is not None and event.name not in self._names:
            return
        with self._lock:
            if event.event == "job_started":
                self._running[event.name] += 1
            else:
                self._running[event.name] -= 1
                if self._running[event.name] <= 0:
                    del self._running[event.name]
        bar = self._bar
        if bar is not None:
            bar.set_postfix_str(self.postfix(), refresh=False)
            now = time.monotonic()
            if now - self._last_redraw >= _REDRAW_EVERY:
                self._last_redraw = now
                bar.refresh()

    def finished(self, name: str, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if self._bar is not None:
            self._bar.set_postfix_str(self.postfix(), refresh=False)
            self._bar.update(1)
        elif self._plain:
            now = time.monotonic()
            if now - self._last_print > 0.5 or self.done == self.total:
                self._last_print = now
                failed = f", {self.failed} failed" if self.failed else ""
                print(f"[{self.done}/{self.total}{failed}] {name}", file=self._stream, flush=True)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
