"""A progress bar for many compiles: tqdm when it is installed, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(
        self, total: int, *, enabled: bool, description: str = "compiling", stream: TextIO | None = None
    ) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self._stream = stream or sys.stderr
        self._bar: Any = None
        self._plain = False
        self._last_print = 0.0
        if not enabled or total == 0:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self._plain = True
            return
        self._bar = tqdm(total=total, desc=description, unit="kernel", file=self._stream, dynamic_ncols=True)

    def started(self, name: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(name, refresh=False)

    def finished(self, name: str, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if self._bar is not None:
            self._bar.set_postfix_str(name, refresh=False)
            self._bar.update(1)
        elif self._plain:
            now = time.monotonic()
            if now - self._last_print > 0.5 or self.done == self.total:
                self._last_print = now
                failed = f", {self.failed} failed" if self.failed else ""
                print(f"[{self.done}/{self.total}{failed}] {name}", file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
