"""Inductor's CPU vector-ISA check, which a package's compile needs.

Inductor's C++ code generation asks ``pick_vec_isa()``: for each vector instruction set
the CPU claims, it builds a test program with the C++ compiler and loads it in a fresh
interpreter that imports torch, one after another. The answer is kept for the life of the
process, and the built programs in Inductor's cache directory (keyed by the compiler and
its flags, built under a file lock each); so a process pays the loads once, and the builds
are paid once per cache. But every worker is a process of its own, and a check in each,
on a machine of few CPUs, made the first compiles wait for it several times over.

So, for a model on the CPU, from the moment it is wrapped (or ``warm("cpu")`` is called),
:func:`start_builds` starts a process (``python -m aiocompile._torch.isa``) that builds
every candidate's test program at once, one thread each, while the fork server imports
torch and the compile's modules and the worker exports and lowers the model; the
compile's own check, when its code generation gets there, waits on the builds' locks,
finds the programs built and only loads each. The answer is Inductor's own; only the
builds moved earlier, out of the compile's way.

The serving process never needs the answer, and imports nothing for it: it loads
packages with torch's C++ loader (:mod:`.aoti`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

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


def build_candidates() -> int:
    """Build (and load once) the test program of every instruction set this CPU claims,
    all at once, one thread each, into Inductor's cache; returns how many passed."""
    from torch._inductor import cpu_vec_isa

    claimed = cpu_vec_isa.x86_isa_checker() if hasattr(cpu_vec_isa, "x86_isa_checker") else []
    candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                  if all(flag in claimed for flag in str(isa).split())]
    passed: list[object] = []

    def build(isa: object) -> None:
        try:
            if isa:  # Inductor's own test of it: the builds (and loads) its check makes
                passed.append(isa)
        except Exception as exc:  # noqa: BLE001 - the fork server's own check meets it again
            _logger.debug("building the %s test program failed: %s", isa, exc)

    threads = [threading.Thread(target=build, args=(isa,)) for isa in candidates]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(passed)


BUILD_NICE = 10
"""How much nicer than the serving process the builds run: behind its own threads."""

if __name__ == "__main__":
    os.nice(BUILD_NICE)  # the compilers it starts inherit it
    build_candidates()
