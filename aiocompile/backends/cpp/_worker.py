"""The C++ backend's side inside a worker process: one compiler run in a scratch directory."""

from __future__ import annotations

import os
from typing import Any

from aiocompile.backends._native import _run
from aiocompile.backends._native._headers import make_dependencies

SOURCE = "source.cpp"
OUTPUT = "libsource.so"
DEPENDENCIES = "source.d"


def compile_library(spec: Any) -> dict[str, Any]:
    """Build one ``CppSpec``'s shared library; returns it as plain data."""
    with _run.scratch() as work:
        with open(os.path.join(work, SOURCE), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(spec.source)
        ran = _run.run(spec.argv, work, spec.environment)
        if ran.returncode != 0:
            raise _run.failure(ran, name=spec.name, key=spec.key, target=spec.target)
        binary = _run.output(ran, os.path.join(work, OUTPUT), name=spec.name, key=spec.key, target=spec.target)
        try:
            with open(os.path.join(work, DEPENDENCIES), encoding="utf-8", errors="surrogateescape") as f:
                dependencies = [p for p in make_dependencies(f.read()) if p != SOURCE]
        except OSError:  # a compiler that writes no dependency file where asked
            dependencies = []
    return {
        "binary": binary,
        "command": ran.command,
        "compile_time": ran.seconds,
        "stages": [("compile", ran.seconds)],
        "diagnostics": ran.output,
        "dependencies": dependencies,
    }
