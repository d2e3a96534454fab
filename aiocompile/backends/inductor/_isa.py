"""The serving process's CPU vector-ISA check, done while the first package compiles.

``aoti_load_package`` compares the package's recorded device information with this
process's before it loads, and part of that information is Inductor's
``pick_vec_isa()``: for each vector instruction set the CPU claims, it builds a test
program with the C++ compiler and loads it in a fresh interpreter that imports torch.
The result is kept for the life of the process (and the built programs in Inductor's
cache directory, keyed by the compiler), so only a process's first load pays it; but
that is the serving process's first background compile, and on the H100 host it took
72 s, as long as the compile itself: the serving process's compiler
(``/opt/gcc/bin/g++``) is not the one the worker built with (:mod:`._cxx`), so nothing
the worker built was found.

:func:`start` runs the check once per process in a thread of its own, from the first
background compile's submission on, beside the worker's compile; :func:`wait` is called
by the load, which then finds the answer made. The check waits on child processes, so
the thread holds the interpreter lock for little of it.
"""

from __future__ import annotations

import logging
import threading
import time

_logger = logging.getLogger("aiocompile")

_lock = threading.Lock()
_started = False
_done = threading.Event()
seconds: float | None = None
"""How long the check took in this process, once it has run."""


def start() -> None:
    """Begin the check in a thread of its own, unless it has begun already."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    threading.Thread(target=_check, name="aiocompile-vec-isa", daemon=True).start()


def make() -> object | None:
    """Inductor's check, made in this process (kept by Inductor for the process's life):
    the instruction set it picks, or None when it failed (whoever needs it next meets the
    failure again and reports it). Also a worker's warm-up (``_export.warm_up``)."""
    try:
        from torch._inductor import cpu_vec_isa

        return cpu_vec_isa.pick_vec_isa()
    except Exception as exc:  # noqa: BLE001 - reported by whoever needs it next
        _logger.debug("the CPU vector-ISA check failed: %s: %s", type(exc).__name__, exc)
        return None


def _check() -> None:
    global seconds
    began = time.perf_counter()
    try:
        isa = make()
        if isa is not None:
            seconds = time.perf_counter() - began
            _logger.debug("the CPU vector-ISA check for package loads took %.2f s (%s)", seconds, isa)
    finally:
        _done.set()


def wait(timeout: float | None = None) -> bool:
    """Wait for a check that has begun (at most ``timeout`` seconds); True when there is
    none or it has ended. A load that runs while the check does would repeat it."""
    with _lock:
        if not _started:
            return True
    return _done.wait(timeout)
