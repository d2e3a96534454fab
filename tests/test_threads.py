"""``_base.threads``: lanes, threads of their own, and imports that let the loop's thread
have the GIL between modules."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from conftest import busy_inside_handing_over, subprocess_env, threads_started, wait_until

from aiocompile._base import aside, threads


@pytest.fixture
def fresh_modules(tmp_path, monkeypatch):
    """Three importable modules no test has imported, the second importing the third."""
    names = [f"fresh_module_{id(tmp_path)}_{n}" for n in range(3)]
    (tmp_path / f"{names[0]}.py").write_text("VALUE = 0\n")
    (tmp_path / f"{names[1]}.py").write_text(f"import {names[2]}\nVALUE = 1\n")
    (tmp_path / f"{names[2]}.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield names
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def yields(monkeypatch):
    """The threads that went without the GIL before a module, one entry per module. Lane
    threads left by other tests may sleep meanwhile too: only this test's threads count."""
    seen: list[str] = []
    real_sleep = threads.time.sleep
    ours = {threading.current_thread().name, "inside-the-block"}

    class Clock:
        @staticmethod
        def sleep(seconds: float) -> None:
            name = threading.current_thread().name
            if seconds == threads.IMPORT_PAUSE and name in ours:
                seen.append(name)
            real_sleep(seconds)

    monkeypatch.setattr(threads, "time", Clock)
    return seen


def test_imports_inside_the_block_let_go_before_each_module_and_still_import(fresh_modules, yields):
    import importlib

    first, second, third = fresh_modules
    with threads.imports_yielding():
        assert importlib.import_module(first).VALUE == 0
        assert importlib.import_module(second).VALUE == 1  # and, through it, the third
        assert importlib.import_module(first).VALUE == 0  # imported already: nothing to find
    assert yields == [threading.current_thread().name] * 3
    assert sys.modules[third].VALUE == 2


def test_imports_outside_the_block_and_in_other_threads_do_not(fresh_modules, yields):
    import importlib

    first, second, _ = fresh_modules
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with threads.imports_yielding():
            inside.set()
            leave.wait(30)

    helper = threading.Thread(target=other, name="inside-the-block")
    helper.start()
    try:
        assert inside.wait(30)
        importlib.import_module(first)  # this thread is not inside
    finally:
        leave.set()
        helper.join(30)
    importlib.import_module(second)  # nobody is inside now
    assert yields == []
    assert threads._FINDER in sys.meta_path  # it stays: taking it off could disturb an import elsewhere


def test_the_block_nests():
    with threads.imports_yielding():
        with threads.imports_yielding():
            assert threads._FINDER.inside[threading.get_ident()] == 2
        assert threads._FINDER.inside[threading.get_ident()] == 1
    assert threading.get_ident() not in threads._FINDER.inside


def test_a_thread_of_its_own_runs_its_target_under_its_name():
    future = threads.start(lambda: (threading.current_thread().name, threading.current_thread().daemon),
                           "aiocompile-test")
    assert future.result(30) == ("aiocompile-test", False)


def test_a_thread_of_its_own_hands_its_error_to_the_future():
    def fails() -> None:
        raise ValueError("in the thread")

    with pytest.raises(ValueError, match="in the thread"):
        threads.start(fails, "aiocompile-test", daemon=True).result(30)


def test_a_lane_runs_work_in_its_own_threads():
    lane = threads.Lane("aiocompile-test-lane", 2)
    names = {lane.submit(lambda: threading.current_thread().name).result(30) for _ in range(4)}
    assert names and all(name.startswith("aiocompile-test-lane") for name in names)


def test_a_prestarted_lane_hands_the_first_work_to_its_waiting_thread_and_starts_none():
    lane = threads.Lane("aiocompile-test-prestarted", 2)
    done = threading.Event()
    threading.Thread(target=lambda: (lane.prestart(), done.set())).start()  # as aiocompile's own thread does
    assert done.wait(10)
    # Its thread, having run the start's no-op, waits for work (the executor counts it idle).
    idle = lane._get()._idle_semaphore
    wait_until(lambda: idle._value > 0)
    with threads_started() as started:
        assert lane.submit(lambda: threading.current_thread().name).result(10).startswith("aiocompile-test-prestarted")
    assert started == []


def test_handing_over_lowers_the_switch_interval_while_any_block_runs_and_puts_it_back():
    before = sys.getswitchinterval()
    inside = threading.Event()
    leave = threading.Event()

    def other() -> None:
        with threads.handing_over():
            inside.set()
            leave.wait(5)

    try:
        with threads.imports_yielding():  # a block of the imports' kind hands over too
            assert sys.getswitchinterval() == pytest.approx(threads.HANDOVER_INTERVAL)
            helper = threading.Thread(target=other)
            helper.start()
            assert inside.wait(5)
        # One block still runs (the other thread's): the interval stays low.
        assert sys.getswitchinterval() == pytest.approx(threads.HANDOVER_INTERVAL)
        leave.set()
        helper.join(5)
        assert sys.getswitchinterval() == pytest.approx(before)
        # Changed by someone else meanwhile: theirs stays.
        with threads.handing_over():
            sys.setswitchinterval(0.002)
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        leave.set()
        sys.setswitchinterval(before)


def test_a_thread_inside_handing_over_stands_aside_while_a_call_is_served_and_for_a_bounded_time():
    """While a call is served (``serve_begin``..``serve_end``), a thread inside
    ``handing_over`` runs no Python at its calls: it waits without the lock, until the
    call ends or for ``STAND_ASIDE_MAX`` of that run at most."""
    import time

    with busy_inside_handing_over() as (progress, _):
        aside.serve_begin()
        try:
            time.sleep(0.005)  # the helper's next call comes and it stands aside
            began = time.perf_counter()
            time.sleep(0.3)
            ended = time.perf_counter()
        finally:
            aside.serve_end()
        # It stood aside at most STAND_ASIDE_MAX of those 0.3 s, then went on.
        during = [at for at in progress if began <= at <= ended]
        assert during, "the helper stood aside past STAND_ASIDE_MAX"
        assert min(during) - began < aside.STAND_ASIDE_MAX + 0.05
        # And while a call is served without the bound running out, it makes no progress.
        aside.serve_begin()
        try:
            time.sleep(0.003)
            count = len(progress)
            time.sleep(0.01)  # within STAND_ASIDE_MAX
            assert len(progress) == count
        finally:
            aside.serve_end()
        time.sleep(0.02)
        assert len(progress) > count  # going again once the call ended


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_a_thread_standing_aside_sleeps_until_the_call_ends_rather_than_looking():
    """Standing aside, a thread waits to be woken at the end of the call: were it to look
    every so often, each look would take the interpreter lock from the call being served.
    The kernel counts the thread's wake-ups (its voluntary context switches)."""
    import time

    def switches(native_id: int) -> int:
        with open(f"/proc/self/task/{native_id}/status") as status:
            for line in status:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
        raise AssertionError("no voluntary_ctxt_switches line")

    with busy_inside_handing_over() as (progress, helper):
        aside.serve_begin()
        try:
            time.sleep(0.003)  # the helper's next call comes and it stands aside
            count, before = len(progress), switches(helper.native_id)
            time.sleep(0.012)  # within STAND_ASIDE_MAX
            woken = switches(helper.native_id) - before
            assert len(progress) == count  # it stood aside throughout
        finally:
            aside.serve_end()
        assert woken <= 2, f"the thread standing aside woke {woken} times in 12 ms"
        time.sleep(0.02)
        assert len(progress) > count  # woken once the call ended


class LeftRunning:
    """What a served call left running (as a CUDA event recorded after its kernels): its
    ``synchronize()`` waits, without the interpreter lock, until ``done`` is set, and
    raises ``fails`` then, if given."""

    def __init__(self, fails: Exception | None = None) -> None:
        self.done = threading.Event()
        self.fails = fails
        self.waited = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        self.done.wait(10)
        if self.fails is not None:
            raise self.fails


@pytest.mark.parametrize("fails", [None, RuntimeError("an illegal memory access was encountered")])
def test_a_calls_end_put_off_until_what_it_left_running_is_done_keeps_the_threads_aside(fails):
    """``serve_end(until)`` returns at once; the attached threads go on standing aside
    until ``until.synchronize()`` returns (raising or not), then the call is over."""
    import time

    with busy_inside_handing_over() as (progress, _):
        assert aside.busy() and wait_until(lambda: aside.serving() == 0)
        left = LeftRunning(fails)
        aside.serve_begin()
        try:
            time.sleep(0.003)  # the helper's next call comes and it stands aside
            # The caller goes on at once: were serve_end to wait for ``left``, which only
            # this thread sets done below, it would never return.
            aside.serve_end(left)
            assert left.waited.wait(1)
            count = len(progress)
            time.sleep(0.01)  # within STAND_ASIDE_MAX
            assert aside.serving() == 1 and len(progress) == count  # still aside
        finally:
            left.done.set()
        assert wait_until(lambda: aside.serving() == 0, timeout=1)
        time.sleep(0.01)
        assert len(progress) > count  # going again


def test_a_calls_end_put_off_for_what_never_ends_stands_the_threads_aside_for_a_bounded_time():
    import time

    with busy_inside_handing_over() as (progress, _):
        assert wait_until(lambda: aside.serving() == 0)
        left = LeftRunning()
        aside.serve_begin()
        time.sleep(0.003)
        began = time.perf_counter()
        aside.serve_end(left)
        try:
            time.sleep(0.2)
            during = [at for at in progress if at >= began]
            assert during, "the helper stood aside past STAND_ASIDE_MAX"
            assert min(during) - began < aside.STAND_ASIDE_MAX + 0.05
            assert aside.serving() == 1
        finally:
            left.done.set()
        assert wait_until(lambda: aside.serving() == 0, timeout=1)


def test_many_calls_whose_ends_are_put_off_all_end_once_what_they_left_is_done():
    assert wait_until(lambda: aside.serving() == 0)
    lefts = [LeftRunning() for _ in range(500)]
    try:
        for left in lefts:
            aside.serve_begin()
            aside.serve_end(left)
        assert aside.serving() == 500
    finally:
        for left in lefts:
            left.done.set()
    assert wait_until(lambda: aside.serving() == 0, timeout=10)


def test_nothing_is_attached_once_the_threads_inside_handing_over_have_left():
    with busy_inside_handing_over():
        assert aside.busy()
    # (Another test's threads in this process, such as a load's imports, may still run.)
    assert wait_until(lambda: not aside.busy(), timeout=120)


def test_calls_served_back_to_back_leave_a_thread_inside_handing_over_half_of_the_time():
    """Calls one after another, with no gap between them, are each a run of their own: a
    thread that stood aside for each would never run. It stands aside for at most
    ``STAND_ASIDE_SHARE`` of each ``STAND_ASIDE_WINDOW``."""
    import time

    # A unit of work is many Python calls, as an import is.
    with busy_inside_handing_over(calls_per_turn=50) as (progress, _):
        began = time.perf_counter()
        while time.perf_counter() - began < 0.4:
            aside.serve_begin()
            try:
                time.sleep(0.002)
            finally:
                aside.serve_end()
        ended = time.perf_counter()
    during = [at for at in progress if began <= at <= ended]
    # Running, it appends about every 0.6 ms: at least a quarter of 0.4 s of it.
    assert len(during) >= 0.4 * 0.25 / 0.0006, len(during)


def _inside_served_calls(patient: bool) -> tuple[int, int]:
    """A thread inside ``handing_over`` (``patient`` or not) beside calls served 80% of
    the time (4 ms, then 1 ms between): how many of its steps came inside a call, and
    how many between."""
    import time

    progress: list[float] = []
    stop = threading.Event()
    started = threading.Event()

    def step() -> None:
        pass

    def busy() -> None:
        with threads.handing_over():
            if patient:
                aside.patient()
            started.set()
            try:
                while not stop.is_set():
                    for _ in range(20):
                        step()
                    progress.append(time.perf_counter())
                    time.sleep(0.0002)
            finally:
                aside.hurried(threading.get_ident())

    helper = threading.Thread(target=busy)
    helper.start()
    served: list[tuple[float, float]] = []
    try:
        started.wait(5)
        time.sleep(0.12)  # a fresh window
        began = time.perf_counter()
        while time.perf_counter() - began < 0.6:
            aside.serve_begin()
            try:
                start = time.perf_counter()
                time.sleep(0.004)
                served.append((start + 0.001, time.perf_counter()))  # its step under way at the start may end
            finally:
                aside.serve_end()
            time.sleep(0.001)
        ended = time.perf_counter()
    finally:
        stop.set()
        helper.join(5)
    steps = [at for at in progress if began <= at <= ended]
    inside = sum(any(start <= at <= end for start, end in served) for at in steps)
    return inside, len(steps) - inside


def test_a_patient_thread_runs_between_served_calls_and_not_beside_them_until_hurried():
    """A thread whose work nobody waits for yet (``aside.patient``: the modules a load will
    need) stands aside for up to ``PATIENT_SHARE`` of each window: calls served 80% of the
    time leave it the gaps between them. Once hurried, it takes ``STAND_ASIDE_SHARE``
    only, and runs beside the calls for the rest."""
    patient_inside, patient_between = _inside_served_calls(patient=True)
    usual_inside, usual_between = _inside_served_calls(patient=False)
    assert patient_between > 0 and usual_between > 0  # neither starves
    assert usual_inside > 4 * max(patient_inside, 5), (patient_inside, usual_inside)


def test_ahead_work_is_patient_until_something_asks_for_it():
    from aiocompile._torch.ahead import Ahead

    seen: list[bool] = []
    go_on = threading.Event()

    def work() -> None:
        seen.append(threading.get_ident() in aside._SERVING.patient)
        go_on.wait(5)
        seen.append(threading.get_ident() in aside._SERVING.patient)

    made = Ahead("test-patience", work)
    made.start()
    for _ in range(500):
        if seen:
            break
        threading.Event().wait(0.01)
    finished = made.finished()  # someone is about to wait: no longer patient
    go_on.set()
    assert finished is not None and finished.result(5) is None
    assert seen == [True, False]
    assert not aside._SERVING.patient


def test_before_holding_stands_an_attached_thread_aside_while_a_call_is_served():
    """``aside.before_holding``: an attached thread about to hold the lock in a C call
    waits for the call being served to end; a thread not attached does not wait."""
    import time

    ended_at: list[float] = []
    went_on_at: dict[str, float] = {}

    def attached() -> None:
        with threads.handing_over():
            ready.wait(5)
            aside.before_holding()
            went_on_at["attached"] = time.perf_counter()

    def loose() -> None:
        ready.wait(5)
        aside.before_holding()
        went_on_at["loose"] = time.perf_counter()

    ready = threading.Event()
    helpers = [threading.Thread(target=attached), threading.Thread(target=loose)]
    for helper in helpers:
        helper.start()
    time.sleep(0.01)  # both waiting for ready, nothing served yet
    aside.serve_begin()
    try:
        ready.set()
        time.sleep(0.008)  # within STAND_ASIDE_MAX
    finally:
        ended_at.append(time.perf_counter())
        aside.serve_end()
    for helper in helpers:
        helper.join(5)
    assert went_on_at["loose"] < ended_at[0]
    assert went_on_at["attached"] >= ended_at[0]


EXITS_ATTACHED = """
import threading, time
from aiocompile._base import aside, threads

def busy():
    with threads.imports_yielding():  # attached: stands aside for calls being served
        started.set()
        while True:
            sum(range(10))  # Python calls, each one the hook sees

started = threading.Event()
threading.Thread(target=busy, daemon=True).start()
started.wait(10)
aside.serve_begin()  # a call being served, then over, as the program ends
aside.serve_end()
import logging
logging.getLogger("exiting").addHandler(logging.StreamHandler())  # Python run as modules are cleared
"""


def test_a_program_that_exits_with_a_thread_still_standing_aside_prints_nothing():
    """The hook that stands attached threads aside stays in place while one is attached;
    as the interpreter exits, Python still runs (a daemon thread, the main thread clearing
    modules) after the module's names are cleared, and the hook must not fail there."""
    done = subprocess.run([sys.executable, "-c", EXITS_ATTACHED], capture_output=True, text=True, timeout=60,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_a_background_compiles_own_scheduler_thread_starts_the_lane_before_it_makes_the_scheduler(monkeypatch):
    """The thread that makes a wrapper's own scheduler starts the background lane's first
    thread before anything else: a first call made while the scheduler is being made (it
    imports the pool's modules, long on busy CPUs) then starts no thread."""
    torch = pytest.importorskip("torch")
    from aiocompile._torch import background, warming

    making = threading.Event()
    release = threading.Event()
    real_new = warming._new_scheduler

    def slow_new(*args, **kwargs):
        making.set()
        assert release.wait(60)
        return real_new(*args, **kwargs)

    monkeypatch.setattr(warming, "_new_scheduler", slow_new)
    lane = threads.Lane("aiocompile-test-background", 2)  # none of its threads started yet
    monkeypatch.setattr(background, "_LANE", lane)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    compiled = background.compile_in_background(model, disable=True)
    try:
        assert making.wait(30)
        idle = lane._get()._idle_semaphore
        assert wait_until(lambda: idle._value > 0, timeout=30)  # started, waiting for work
        assert not compiled._scheduler.done()  # and the scheduler not made yet
    finally:
        release.set()
        compiled.close()
