"""``_base.collector.imports_settled``: the garbage collector paused around what aiocompile
imports into a serving process, what is alive then frozen out of later full collections,
the collector resumed as it was, and everything given back at exit."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading

from conftest import subprocess_env

from aiocompile._base import collector


def test_the_collector_is_paused_inside_then_resumed_with_what_is_alive_frozen():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with collector.imports_settled():
        assert not gc.isenabled()
        made = [[n] for n in range(1000)]  # lists: the collector tracks every one
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(made) + 1
    # Frozen: in none of the collector's generations, so no later collection walks them.
    # (A dict of plain values is not tracked at all, and counts for nothing here.)
    tracked = {id(o) for o in gc.get_objects()}
    assert id(made) not in tracked
    assert not any(id(item) in tracked for item in made)
    gc.unfreeze()  # this test process's own collector as it was


def test_a_collector_the_program_switched_off_stays_off():
    gc.disable()
    try:
        with collector.imports_settled():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_the_collector_resumes_only_once_the_last_thread_leaves():
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with collector.imports_settled():
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert inside.wait(30)
        with collector.imports_settled():
            pass
        assert not gc.isenabled()  # the other thread is still inside
    finally:
        leave.set()
        thread.join(30)
    assert gc.isenabled()
    gc.unfreeze()


EXITS = """
from aiocompile._base import collector
with collector.imports_settled():
    import triton
    import triton.language
print("imported")
"""


def test_a_program_that_exits_after_a_freeze_reports_no_leaked_objects():
    # Frozen objects are given back to the collector at exit: extension modules that
    # count their objects at exit (Triton's nanobind bindings) find none left behind.
    run = subprocess.run([sys.executable, "-c", EXITS], capture_output=True, text=True, timeout=120,
                         env=subprocess_env())
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "imported"
    assert "leaked" not in run.stderr, run.stderr[-2000:]
