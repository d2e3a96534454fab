"""Inductor's CPU vector-ISA check, which a package's compile needs.

Inductor's C++ code generation asks ``pick_vec_isa()``: for each vector instruction set
the CPU claims, it builds a test program with the C++ compiler and loads it in a fresh
interpreter, one after another. The answer is kept for the life of the process, and the
built programs in Inductor's cache directory (keyed by the compiler and its flags, built
under a file lock each); so a process pays the loads once, and the builds are paid once
per cache. But every worker is a process of its own, and a check in each, on a machine of
few CPUs, made the first compiles wait for it several times over.

Two ways ahead of it, the check's own code throughout (the answer is Inductor's):

- :class:`Check` makes the whole check in the calling process, each candidate in a thread
  of its own, the test programs built at once. The fork server of a scheduler
  ``compile_in_background`` makes for a model on the CPU makes it in its preload, beside
  the imports that follow (``export.prepare_fork_server``), and joins its threads before it
  forks: every worker starts with the answer in memory, and its compile neither builds nor
  loads a test program.
- :func:`start_builds` starts a process (``python -m aiocompile._torch.isa``) that makes
  the same check: for ``install()``, whose compiles make their check in the serving
  process and in its scheduler's workers, which then find the programs built (waiting on
  the builds' locks) and only load each.

Each instruction set's test, once its program is built, loads that program in a fresh
interpreter (half a second, a process of its own), in every process that makes the check.
In aiocompile's processes (:func:`remember_loads`) a load that succeeded is remembered
beside the program, with the program's size and time and torch's build: a later check in
another of them (a worker's compile, after the serving process's check) finds it and loads
nothing. A program built again, or another torch, is loaded again.

The serving process of a background compile needs the answer only to load a CPU model's
Python form, whose kernels' cache keys hold it: it makes the check ahead, from the moment
the model is wrapped, with a :class:`Check` whose builds run as the pool's processes do
(nicer, ``SCHED_IDLE``), while it imports the rest of what the load needs
(``ahead.GRAPH_LOAD``). It has torch imported already, so its builds begin seconds before
a new fork server's could, which then finds them built or being built. A package needs no
answer here: torch's C++ loader loads it (:mod:`.aoti`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

from aiocompile._base import pyc

_logger = logging.getLogger("aiocompile")

BUILD_TIMEOUT = 600.0
"""Seconds the builds may take before they are stopped (Inductor's check builds what is
missing itself)."""

_lock = threading.Lock()
_builds: subprocess.Popen[bytes] | None = None


def start_builds() -> None:
    """Start building the candidates' test programs in a process of their own, once per
    process (a thread reaps it); nothing when Inductor is told to build none."""
    global _builds
    with _lock:
        if _builds is not None or os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") is not None:
            return
        _builds = subprocess.Popen([sys.executable, "-m", "aiocompile._torch.isa"], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    threading.Thread(target=_reap, args=(_builds,), name="aiocompile-isa-builds", daemon=True).start()


def _reap(builds: subprocess.Popen[bytes]) -> None:
    try:
        builds.wait(BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        builds.kill()
        builds.wait()


LOADED_SUFFIX = ".aiocompile-loads"
"""Beside a test program that loaded: what it was and which torch loaded it (:func:`remember_loads`)."""

_remembering = threading.Lock()


def remember_loads() -> bool:
    """In this process (and the processes forked from it), each successful load of a test
    program is remembered beside it, and a program remembered so is not loaded again
    (Inductor's ``VecISA._probe_load``, wrapped once). False where this torch has no such
    step (its check then loads each program, as without this)."""
    from torch._inductor import cpu_vec_isa

    vec_isa = getattr(cpu_vec_isa, "VecISA", None)
    probe = getattr(vec_isa, "_probe_load", None)
    if vec_isa is None or not callable(probe):
        return False
    with _remembering:
        if getattr(probe, "_aiocompile_remembers", False):
            return True

        def _probe_load(self: object, output_path: str) -> bool:
            stamp = _stamp(output_path)
            marker = output_path + LOADED_SUFFIX
            if stamp is not None and _read(marker) == stamp:
                return True
            loaded = bool(probe(self, output_path))
            if loaded and stamp is not None:
                pyc.write(marker, stamp.encode("utf-8"))  # whole or not at all
            return loaded

        _probe_load._aiocompile_remembers = True  # type: ignore[attr-defined]
        vec_isa._probe_load = _probe_load
    return True


def _stamp(path: str) -> str | None:
    """What a load of the program at ``path`` depends on: the program (its size and
    modification time) and the torch whose libraries it links to."""
    import torch

    try:
        stat = os.stat(path)
    except OSError:
        return None
    return f"{stat.st_size} {stat.st_mtime_ns} {torch.__version__} {os.path.dirname(torch.__file__)}"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, ValueError):
        return None


class Check:
    """Inductor's check, started by the constructor: each instruction set this CPU claims
    in a thread of its own (its test programs built at once, by Inductor's own test of
    each), ``nice`` steps nicer than the caller and with ``idle`` under ``SCHED_IDLE``, as
    a pool's processes (``procs.lower_priority``); :meth:`finish` waits for them and makes
    the check itself, which then finds every answer made."""

    def __init__(self, nice: int = 0, idle: bool = False) -> None:
        from torch._inductor import cpu_vec_isa

        remember_loads()
        self._cpu_vec_isa = cpu_vec_isa
        claimed = cpu_vec_isa.x86_isa_checker() if hasattr(cpu_vec_isa, "x86_isa_checker") else []
        candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                      if all(flag in claimed for flag in str(isa).split())]
        self.threads = [threading.Thread(target=self._test, args=(isa, nice, idle), name=f"aiocompile-isa-{isa}",
                                         daemon=True)
                        for isa in candidates]
        for thread in self.threads:
            thread.start()

    @staticmethod
    def _test(isa: object, nice: int, idle: bool) -> None:
        if nice or idle:
            # Imported here: ``import aiocompile.torch`` imports this module, and none of
            # the pool's.
            from aiocompile._pool.procs import lower_priority

            # This thread's own priority on Linux (its Python steps are a few), and its
            # children's: the compiler and the loads of the test programs.
            lower_priority(threading.get_native_id(), nice, idle)
        try:
            bool(isa)  # Inductor's own test of it: the build and the load its check makes; kept
        except Exception as exc:  # noqa: BLE001 - the check meets it again, and answers
            _logger.debug("testing the %s instruction set failed: %s", isa, exc)

    def finish(self) -> int:
        """Wait for the threads, then make the check (kept in this process for its life,
        and in every process forked from it); returns how many instruction sets passed."""
        for thread in self.threads:
            thread.join()
        return len(self._cpu_vec_isa.valid_vec_isa_list())


def build_candidates() -> int:
    """Build (and load once) the test program of every instruction set this CPU claims,
    all at once, into Inductor's cache; returns how many passed."""
    return Check().finish()


BUILD_NICE = 10
"""How much nicer than the serving process the builds run: behind its own threads."""

if __name__ == "__main__":
    os.nice(BUILD_NICE)  # the compilers it starts inherit it
    build_candidates()
