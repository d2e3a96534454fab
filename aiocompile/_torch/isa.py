"""Inductor's CPU vector-ISA check, which loading a package needs.

``aoti_load_package`` compares the package's recorded device information with this
process's before it loads, and part of that information is Inductor's
``pick_vec_isa()``: for each vector instruction set the CPU claims, it builds a test
program with the C++ compiler and loads it in a fresh interpreter that imports torch.
The result is kept for the life of the process (and the built programs in Inductor's
cache directory, keyed by the compiler), so only a process's first load pays it; but
that is the serving process's first background compile, and it can take as long as the
compile itself: where the serving process's compiler is not the one the worker built with
(:mod:`._cxx`), nothing the worker built is found. (docs/benchmarks.md has the command that
times it.)

So the serving process makes it from the moment a model is wrapped
(:data:`._ahead.VEC_ISA`). Every package's compile needs it too: a worker makes it when its
code generation gets there, and finds the test programs the serving process built in
Inductor's cache (one lock per program, so the two never build one twice). The check
waits on child processes, so it holds the interpreter lock for little of its time.
"""

from __future__ import annotations

import logging

_logger = logging.getLogger("aiocompile")


def make() -> object | None:
    """Inductor's check, made in this process (kept by Inductor for the process's life):
    the instruction set it picks, or None when it failed (whoever needs it next meets the
    failure again and reports it)."""
    try:
        from torch._inductor import cpu_vec_isa

        return cpu_vec_isa.pick_vec_isa()
    except Exception as exc:  # noqa: BLE001 - reported by whoever needs it next
        _logger.debug("the CPU vector-ISA check failed: %s: %s", type(exc).__name__, exc)
        return None
