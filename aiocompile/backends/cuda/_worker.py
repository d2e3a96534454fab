"""The CUDA backend's side inside a worker process: nvcc (or hipcc) in a scratch directory,
once per image, with nvcc's own phase times."""

from __future__ import annotations

import csv
import dataclasses
import os
import re
from typing import Any

from aiocompile.backends._native import _run

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

# What Clang says of an AMD processor it does not know (where hipcc could not list them
# beforehand).
_UNKNOWN_PROCESSOR = re.compile(r"invalid target ID '(gfx[^':]+)|unknown target CPU '(gfx[^']+)'")


def read_phase_times(path: str) -> list[tuple[str, float]]:
    """nvcc's ``--time`` file: one CSV row per phase it ran (``gcc (preprocessing 1)``,
    ``cicc``, ``ptxas``, ``fatbinary``, ``nvcc (driver)``, ...), as (phase, seconds) in
    the order first run, a phase that ran several times (once per architecture) summed."""
    totals: dict[str, float] = {}
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            rows = list(csv.reader(f, skipinitialspace=True))
    except OSError:
        return []
    if not rows:
        return []
    header = [cell.strip().lower() for cell in rows[0]]
    try:
        phase, metric, unit = header.index("phase name"), header.index("metric"), header.index("unit")
    except ValueError:
        return []  # a layout this reader does not know: no stage times rather than wrong ones
    for row in rows[1:]:
        if len(row) <= max(phase, metric, unit) or row[0].strip().lower() == "source file name":
            continue
        try:
            seconds = float(row[metric]) * _UNITS[row[unit].strip()]
        except (ValueError, KeyError):
            continue
        name = row[phase].strip() or "other"  # nvcc leaves some steps unnamed (copying the PTX out)
        totals[name] = totals.get(name, 0.0) + seconds
    return list(totals.items())


def _failure(spec: Any, ran: _run.Ran) -> Exception:
    """A failed run's ``CompileError``; hipcc's names the HIP and Clang under it, and says
    so where Clang does not know an architecture."""
    if spec.vendor != "hip":
        return _run.failure(ran, name=spec.name, key=spec.key, target=spec.target)
    found = _UNKNOWN_PROCESSOR.search(ran.output)
    how = f"does not know {found.group(1) or found.group(2)}" if found else None
    return _run.failure(ran, name=spec.name, key=spec.key, target=spec.target, how=how, tool=spec.compiler.summary)


def compile_gpu_code(spec: Any) -> dict[str, Any]:
    """Build one ``CudaSpec``'s images; returns them as plain data."""
    images: dict[str, bytes] = {}
    stages: dict[str, float] = {}
    commands, diagnostics = [], []
    seconds = 0.0
    with _run.scratch() as work:
        with open(os.path.join(work, spec.source_file), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(spec.source)
        for invocation in spec.invocations:
            ran = _run.run(invocation.argv, work, spec.environment)
            if spec.vendor == "hip":
                # The command as shown (its record, its error) runs the same in a shell.
                ran = dataclasses.replace(ran, argv=("env", "HIP_PLATFORM=amd", *ran.argv))
            if ran.returncode != 0:
                raise _failure(spec, ran)
            images[invocation.label] = _run.output(ran, os.path.join(work, invocation.output), name=spec.name,
                                                   key=spec.key, target=spec.target)
            phases = read_phase_times(os.path.join(work, invocation.times)) if invocation.times else []
            for phase, duration in phases or [(spec.compiler.name, ran.seconds)]:
                stages[phase] = stages.get(phase, 0.0) + duration
            commands.append(ran.command)
            if ran.output.strip():
                diagnostics.append(ran.output.strip())
            seconds += ran.seconds
    return {
        "images": images,
        "command": "\n".join(commands),
        "compile_time": seconds,
        "stages": list(stages.items()),
        "diagnostics": "\n".join(diagnostics),
    }
