"""What the ``aiocompile`` command prints besides its tables: the lines on stderr that tell
a user what happened (``Console``), the one line of a failure that says what went wrong
(``failure_line``), and a stdout whose reader went away (``stdout_gone``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from aiocompile.errors import CompileError

__all__ = ["Console", "failure_line", "stdout_gone"]


def stdout_gone() -> None:
    """The reader of stdout went away (``| head``): what is left unread is dropped."""
    # Python flushes stdout once more at exit, which would raise again: point it at
    # /dev/null.
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


class Console(logging.Handler):
    """What the command prints on stderr besides its own lines: the library's warnings (a
    cache directory refused, a shared cache not signed), each failed request's whole
    message, and Python warnings such as Triton's, each once, as one line (Triton's
    ``TRITON_DEFAULT_FP_FUSION`` notice would otherwise come with its source line, across
    the progress bar). Worker events are left out: the table at the end sums them up.
    Lines go above a progress bar being drawn. The command is the application, so it,
    and not the library, decides that these are printed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("aiocompile: %(message)s"))
        self._logger = logging.getLogger("aiocompile")
        self._showwarning = warnings.showwarning

    def __enter__(self) -> Console:
        self._logger.addHandler(self)
        warnings.showwarning = self._warning
        return self

    def __exit__(self, *exc_info: object) -> None:
        warnings.showwarning = self._showwarning
        self._logger.removeHandler(self)

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "event", "request") == "request"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.say(self.format(record))
        except Exception:  # noqa: BLE001 - logging's own way with a handler that fails
            self.handleError(record)

    def _warning(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
        path = Path(filename)
        # The package that warned (triton), where it is an installed one; else its file.
        where = path.parts[path.parts.index("site-packages") + 1] if "site-packages" in path.parts else path.stem
        self.say(f"aiocompile: {category.__name__} from {where.removesuffix('.py')}: {message}")

    @staticmethod
    def say(line: str) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            print(line, file=sys.stderr, flush=True)
        else:
            tqdm.write(line, file=sys.stderr)


def failure_line(exc: BaseException) -> str:
    """The line of a failure's message that says what went wrong, for its row."""
    text = str(getattr(exc, "message", None) or exc).strip()
    if not text:
        return type(exc).__name__
    lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    # A tool's own verdict first ("ptxas fatal : Value 'sm_99a' is not defined ..."): the
    # lines around it name the exception that carried it and the command that ran.
    fatal = [line for line in lines if re.search(r"\bfatal\b", line, re.IGNORECASE)]
    if fatal:
        return fatal[0]
    if isinstance(exc, CompileError) and exc.command:
        # A compiler's last line is its command (or a count of errors): its first error.
        errors = [line for line in lines[1:] if "error" in line.lower()]
        if errors:
            return errors[0]
    # Triton's message is the error, then what caused it ("caused by ..."), then what was
    # being handled when it happened ("while handling ...", the least telling): the last
    # line of the error and its causes.
    parts = [part for part in text.split("\n\n") if not part.startswith("while handling")] or [text]
    kept = [" ".join(line.split()) for line in parts[-1].splitlines() if line.strip()]
    return kept[-1] if kept else lines[-1]
