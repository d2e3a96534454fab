"""The garbage collector around what aiocompile imports into a serving process.

With torch imported, a process tracks several hundred thousand objects, and a full
collection walks them all, holding the interpreter lock for a tenth of a second or more:
every thread stops, an event loop's included. Importing a package's worth of modules in a
thread of aiocompile's (the scheduler's stack when a wrapper makes its own scheduler;
Inductor's runtime, which loading a compiled graph needs) allocates enough to set off
several, each a stall of the serving loop that no call of the user's made.

:func:`imports_settled` is put around such work: the collector is paused while it runs
(nothing it makes is garbage), then everything alive is moved out of the collector's
reach with :func:`gc.freeze`, so that no later full collection walks it again; the
collector is resumed as it was. Frozen objects are never collected while the process
runs (what was garbage at that moment stays allocated); at the interpreter's exit they
are given back to the collector (:func:`gc.unfreeze`), so that its last collection
finds them as it would have.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_inside = 0
_resume = False
_unfreeze_at_exit = False


@contextlib.contextmanager
def imports_settled() -> Iterator[None]:
    """Pause the collector for the block (several threads may be inside at once), then
    freeze what is alive and resume it as it was, once the last one leaves."""
    global _inside, _resume, _unfreeze_at_exit
    with _lock:
        if _inside == 0:
            _resume = gc.isenabled()
            gc.disable()
        _inside += 1
        if not _unfreeze_at_exit:
            atexit.register(gc.unfreeze)
            _unfreeze_at_exit = True
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                gc.freeze()
                if _resume:
                    gc.enable()
