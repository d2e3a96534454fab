"""The cold-start benchmark's account of where the CPUs went (``benchmarks/_cold_start_watch.py``'s
``ProcessTimes``), on real threads and processes: a thread of this process that burns CPU,
a compiler (gcc's ``cc1`` and ``as``) and a Python process it starts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_process_times_counts_threads_compilers_and_other_processes_up_to_the_moment_asked() -> None:
    import _cold_start_watch as watch

    compiler = shutil.which("gcc")
    if compiler is None:
        pytest.skip("no gcc")
    origin = time.perf_counter()
    times = watch.ProcessTimes(origin)
    burner = threading.Thread(target=_burn, args=(0.6,), name="bench-burner")
    burner.start()
    times.note_names()
    # A C source that takes the compiler a while: many functions, optimised.
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder, "many.c")
        source.write_text("\n".join(f"double f{i}(double x) {{ double y = x; for (int j = 0; j < {i % 7 + 3}; j++) "
                                    f"y = y * {i}.5 + j / (y + 1.0); return y; }}" for i in range(600)))
        subprocess.run([compiler, "-O2", "-c", str(source), "-o", str(Path(folder, "many.o"))], check=True)
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                    "while time.process_time() < end: pass"], check=True)
    burner.join()
    time.sleep(0.2)  # the sidecar's last look
    lines = times.report(time.perf_counter())
    assert len(lines) == 3, lines
    assert lines[0].startswith("CPU seconds in the first ")
    mine = {name: float(seconds) for name, seconds in re.findall(r"([\w-]+(?: \w+)?) ([\d.]+)",
                                                                 lines[1].split(": ", 1)[1])}
    assert mine["bench-burner"] >= 0.4, lines
    started = {name: float(seconds) for name, seconds, _ in re.findall(r"([a-z][a-z ]*) ([\d.]+) \((\d+)\)",
                                                                        lines[2])}
    assert started["compilers"] > 0.05, lines
    assert started["other processes"] >= 0.3, lines
    assert "fork server" not in lines[2] and "workers" not in lines[2]
    # Nothing after the moment asked is counted.
    assert "this process 0.0" in times_report_at_origin()


def times_report_at_origin() -> str:
    import _cold_start_watch as watch

    origin = time.perf_counter()
    times = watch.ProcessTimes(origin)
    time.sleep(0.2)
    _burn(0.3)
    time.sleep(0.1)
    return "\n".join(times.report(origin))
