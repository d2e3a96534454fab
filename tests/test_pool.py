"""The worker pool: Executor contract, start methods, warm-up, output capture, faults."""

import concurrent.futures as cf
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from typing import Any

import jobs
import pytest
from conftest import ROOT, alive, child_pids, subprocess_env, wait_until
from native_sources import marked, needs_cpp, processes

import aiocompile
from aiocompile import WorkerCrashed, WorkerPool

START_METHODS = ["forkserver", "spawn", "fork"]


@pytest.mark.parametrize("start_method", START_METHODS)
def test_executor_contract(start_method):
    before = child_pids()
    with WorkerPool(2, start_method=start_method, preload=()) as pool:
        assert pool.submit(jobs.echo, 41).result(timeout=60) == 41
        assert list(pool.map(jobs.echo, range(10))) == list(range(10))
        worker_pid = pool.submit(jobs.pid).result(timeout=60)
        assert worker_pid != os.getpid()
        assert worker_pid in child_pids()
        if start_method == "forkserver":
            # Workers are children of the fork server, not of this process.
            assert _ppid(worker_pid) != os.getpid()
    assert pool.closed
    with pytest.raises(aiocompile.SchedulerClosed):
        pool.submit(jobs.echo, 1)
    assert child_pids() == before


def _ppid(pid):
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rfind(")") + 2:].split()[1])


def test_many_jobs_are_spread_over_all_workers():
    with WorkerPool(2, preload=()) as pool:
        futures = [pool.submit(jobs.sleep_then, 0.05, i) for i in range(8)]
        assert [f.result(timeout=60) for f in futures] == list(range(8))
        assert pool.counters.workers_started == 2
        assert pool.counters.queue_depth_max >= 6


async def test_warm_starts_every_worker_and_compiles_once_in_each():
    async with aiocompile.Scheduler(workers=2) as sched:
        await sched.warm("cuda:80")
        assert sched.statistics().workers_started == 2
        assert len(sched.worker_pids()) == 2
        await sched.warm("cuda:80")  # idempotent: every slot holds a warmed worker
        assert sched.statistics().workers_started == 2


def test_warm_jobs_go_one_to_each_worker():
    with WorkerPool(3, preload=()) as pool:
        warm = pool.warm(jobs.pid)
        pids = [job.future.result(timeout=60) for job in warm]
        assert len(set(pids)) == 3


def test_unpicklable_job_is_refused_at_submit():
    with WorkerPool(1, preload=()) as pool:
        with pytest.raises(TypeError, match="cannot be sent"):
            pool.submit(jobs.echo, lambda: None)
        main_function = _function_from_main()
        assert pool.counters.workers_started == 0
        try:
            import cloudpickle  # noqa: F401
        except ImportError:
            with pytest.raises(TypeError, match="__main__"):
                pool.submit(main_function, 1)
            assert pool.counters.workers_started == 0
        else:  # where cloudpickle is installed, __main__ functions travel by value
            assert pool.submit(main_function, 1).result(timeout=60) == 2


def test_a_main_function_is_loaded_once_per_worker_and_sent_again_when_rebound():
    namespace = {"__name__": "__main__", "calls": 0, "offset": 1}
    exec(
        "def count(x):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    return x + offset, calls\n",
        namespace,
    )
    count = namespace["count"]
    pytest.importorskip("cloudpickle")
    with WorkerPool(1, preload=()) as pool:
        # The worker keeps the function it loaded: its globals there live on between jobs.
        answers = [pool.submit(count, 10).result(timeout=60) for _ in range(3)]
        assert answers == [(11, 1), (11, 2), (11, 3)]
        # A global the function refers to, bound to another object, sends it again.
        namespace["offset"] = 100
        assert pool.submit(count, 10).result(timeout=60) == (110, 1)
        # So does a new definition under the same name (a notebook cell run again).
        exec("def count(x):\n    return -x, None\n", namespace)
        assert pool.submit(namespace["count"], 10).result(timeout=60) == (-10, None)
        assert namespace["calls"] == 0  # the parent's globals are untouched
        assert pool.counters.workers_started == 1


def test_a_main_function_goes_to_each_worker_once_and_again_to_a_new_worker(monkeypatch):
    pytest.importorskip("cloudpickle")
    from aiocompile._pool import roster

    namespace = {"__name__": "__main__"}
    exec(
        "import os\n"
        "def answer(x):\n"
        "    if x == 'die':\n"
        "        os._exit(7)\n"
        "    return x * 2, os.getpid()\n",
        namespace,
    )
    answer = namespace["answer"]
    written: list[bytes] = []
    write_all = roster._write_all

    def noted(fd: int, parts: list[bytes]) -> None:
        written.append(b"".join(parts))
        write_all(fd, parts)

    monkeypatch.setattr(roster, "_write_all", noted)
    definition = b"__main__"  # what the by-value pickle holds, and no job's payload does
    with WorkerPool(1, preload=(), max_crashes=1) as pool:
        answers = [pool.submit(answer, n).result(timeout=60) for n in range(4)]
        assert [value for value, _ in answers] == [0, 2, 4, 6]
        assert len({pid for _, pid in answers}) == 1
        # The function went with the first job only; the next three named it by digest.
        assert [definition in frame for frame in written] == [True, False, False, False]
        with pytest.raises(aiocompile.WorkerCrashed):
            pool.submit(answer, "die").result(timeout=60)
        written.clear()
        value, pid = pool.submit(answer, 5).result(timeout=60)
        # Its replacement was sent the function with its first job.
        assert value == 10 and pid != answers[0][1]
        assert [definition in frame for frame in written] == [True]


def test_a_main_function_named_by_digest_takes_any_keyword_and_raises_its_own_error():
    """A job of a __main__ function names it by digest as its first argument: the
    function's own keywords (even ``digest``) reach it as given, and what it raises comes
    back with its own frame in the worker's traceback."""
    pytest.importorskip("cloudpickle")
    namespace = {"__name__": "__main__"}
    exec(
        "def keyed(x, digest=None, **rest):\n"
        "    if x < 0:\n"
        "        raise ValueError(f'negative: {x}')\n"
        "    return x, digest, rest\n",
        namespace,
    )
    keyed = namespace["keyed"]
    with WorkerPool(1, preload=()) as pool:
        assert pool.submit(keyed, 1, digest="mine", other=2).result(timeout=60) == (1, "mine", {"other": 2})
        with pytest.raises(ValueError, match="negative: -1") as caught:
            pool.submit(keyed, -1).result(timeout=60)
        assert "in keyed" in str(caught.value.__cause__)


def _function_from_main():
    namespace = {"__name__": "__main__"}
    exec("def plus_one(x):\n    return x + 1\n", namespace)
    return namespace["plus_one"]


def test_bad_results_and_exceptions_come_back_as_clear_errors():
    with WorkerPool(1, preload=()) as pool:
        with pytest.raises(TypeError, match="could not be pickled"):
            pool.submit(_returns_a_lambda).result(timeout=60)
        with pytest.raises(aiocompile.JobError, match="UnpicklableError.*could not be pickled"):
            pool.submit(_raises_unpicklable).result(timeout=60)
        with pytest.raises(RuntimeError, match="SystemExit"):
            pool.submit(sys.exit, 3).result(timeout=60)
        big = pool.submit(jobs.echo, b"x" * (100 * 1024 * 1024)).result(timeout=120)
        assert len(big) == 100 * 1024 * 1024
        # None of that cost the worker its life.
        assert pool.counters.workers_started == 1 and pool.counters.worker_crashes == 0


def _returns_a_lambda():
    return lambda: None


class UnpicklableError(Exception):
    def __init__(self):
        super().__init__("no pickling")
        self.lock = __import__("threading").Lock()


def _raises_unpicklable():
    raise UnpicklableError()


@pytest.mark.parametrize(
    ("job", "args", "exitcode"),
    [(jobs.exit_now, (3,), 3), (jobs.kill_self, (), -signal.SIGKILL), (jobs.segfault, (), -signal.SIGSEGV)],
    ids=["os._exit", "SIGKILL", "SIGSEGV"],
)
def test_a_crash_costs_only_the_crashing_job(job, args, exitcode):
    with WorkerPool(2, preload=(), max_crashes=2) as pool:
        innocent = [pool.submit(jobs.sleep_then, 0.3, i) for i in range(2)]
        poison = pool.submit_job(job, args, name="poison", key="k1")
        with pytest.raises(aiocompile.WorkerCrashed) as info:
            poison.future.result(timeout=60)
        assert [f.result(timeout=60) for f in innocent] == [0, 1]
        error = info.value
        assert error.exitcode == exitcode and error.attempts == 2
        assert error.kernel_name == "poison" and error.key == "k1"
        assert pool.counters.worker_crashes == 2 and pool.counters.retries == 1
        # The pool carries on.
        assert pool.submit(jobs.echo, "still here").result(timeout=60) == "still here"


def test_the_tail_of_what_a_dying_worker_printed_is_kept():
    with WorkerPool(1, preload=(), max_crashes=1) as pool:
        with pytest.raises(aiocompile.WorkerCrashed) as info:
            pool.submit(jobs.print_then_exit, "last words of the job", 9).result(timeout=60)
    assert "last words of the job" in info.value.output
    assert "native write before death" in info.value.output
    assert info.value.exitcode == 9


def test_a_timeout_kills_only_that_job_s_worker():
    with WorkerPool(2, preload=()) as pool:
        slow = pool.submit_job(jobs.hang, timeout=0.5, name="slow")
        other = pool.submit(jobs.sleep_then, 1.0, "other")
        assert pool.submit(jobs.pid).result(timeout=60)
        started = time.monotonic()
        with pytest.raises(aiocompile.JobTimeout) as info:
            slow.future.result(timeout=60)
        assert time.monotonic() - started < 5
        assert isinstance(info.value, TimeoutError) and info.value.timeout == 0.5
        assert other.result(timeout=60) == "other"
        assert slow.worker_pid not in child_pids()
        assert pool.counters.timeouts == 1 and pool.counters.worker_crashes == 0
        assert pool.submit(jobs.echo, 1).result(timeout=60) == 1


def test_a_spurious_wake_up_of_the_fork_server_channel_is_harmless():
    # The supervisor may be told the control socket is readable after the message there
    # was already taken; that must not read as the fork server's end.
    from aiocompile._pool.launch import ZygoteLauncher

    launcher = ZygoteLauncher(preload=())
    try:
        first = launcher.launch()
        launcher.on_readable()
        launcher.on_readable()
        second = launcher.launch()
        assert launcher.fileno() is not None
        launcher.kill(first)
        assert launcher.wait_exit(first, 10) == -signal.SIGKILL
        launcher.kill(second)
        assert launcher.wait_exit(second, 10) == -signal.SIGKILL
    finally:
        launcher.close()


def test_a_fork_server_that_cannot_start_fails_jobs_instead_of_hanging():
    with WorkerPool(1, preload=("jobs:die_in_preload",)) as pool:
        future = pool.submit(jobs.echo, 1)
        with pytest.raises(RuntimeError, match="could not start worker processes"):
            future.result(timeout=120)


@pytest.mark.parametrize("queued", ["job", "prepare"])
def test_a_close_with_nothing_left_to_run_stops_a_fork_server_still_starting(tmp_path, monkeypatch, caplog, queued):
    """Closing with the queue cancelled (as a scheduler's close does, and the interpreter's
    exit) does not wait for a fork server's preload: it is stopped, with what it started,
    and the queued job fails with ``SchedulerClosed``. Quietly: no warning."""
    note = tmp_path / "preload.pid"
    monkeypatch.setenv("AIOCOMPILE_TEST_PRELOAD_PID", str(note))
    pool = WorkerPool(1, preload=("jobs:slow_preload",))
    with caplog.at_level("WARNING", logger="aiocompile"):
        if queued == "job":
            future = pool.submit(jobs.echo, 1)
        else:
            pool.start()
        assert wait_until(note.exists, timeout=120), "the fork server's preload never began"
        preloading = int(note.read_text())
        began = time.monotonic()
        pool.shutdown(wait=True, cancel_futures=True)
        took = time.monotonic() - began
    assert took < 30, f"the close waited {took:.1f} s for the fork server's preload"
    assert wait_until(lambda: not alive([preloading]), timeout=10)
    if queued == "job":
        with pytest.raises(aiocompile.SchedulerClosed):
            future.result(timeout=10)
    assert "could not prepare" not in caplog.text and "could not start" not in caplog.text


def test_a_broken_preload_is_reported_and_workers_still_run(caplog):
    with caplog.at_level("WARNING", logger="aiocompile"):
        with WorkerPool(1, preload=("jobs:fail_in_preload",)) as pool:
            assert pool.submit(jobs.echo, 1).result(timeout=60) == 1
    assert "this preload hook is broken" in caplog.text


def test_cancelling_a_queued_job_removes_it():
    with WorkerPool(1, preload=()) as pool:
        blocker = pool.submit(jobs.sleep_then, 0.5, "first")
        queued = pool.submit(jobs.echo, "never")
        assert queued.cancel()
        assert blocker.result(timeout=60) == "first"
        assert pool.submit(jobs.echo, "next").result(timeout=60) == "next"
        with pytest.raises(cf.CancelledError):
            queued.result()


PARENT_DIES = textwrap.dedent('''
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import jobs
    from aiocompile import WorkerPool

    pool = WorkerPool(2, preload=(), start_method=sys.argv[2])
    busy = pool.submit(jobs.hang)           # this worker is inside a job when the parent dies
    idle = pool.submit(jobs.pid).result()   # this one is idle
    print("ready", flush=True)
    time.sleep(60)
''')


@pytest.mark.parametrize("start_method", START_METHODS)
def test_workers_exit_when_the_parent_is_killed(start_method):
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT_DIES, str(ROOT / "tests"), start_method],
        stdout=subprocess.PIPE, text=True, env=subprocess_env(),
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        descendants = child_pids(proc.pid)
        assert len(descendants) >= 2
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and alive(descendants):
        time.sleep(0.02)
    assert not alive(descendants), f"still running 2 s after the parent died: {alive(descendants)}"


COMPILING_PARENT_DIES = textwrap.dedent('''
    import asyncio, sys
    sys.path.insert(0, sys.argv[1])
    import aiocompile
    from native_sources import SLOW_CPP, SLOW_CPP_FLAGS

    async def main():
        config = aiocompile.SchedulerConfig(workers=1, preload=(), start_method=sys.argv[2])
        sched = aiocompile.Scheduler(config=config)
        await sched.compile_cpp(SLOW_CPP, flags=(*SLOW_CPP_FLAGS, "-D" + sys.argv[3]))

    asyncio.run(main())
''')


@needs_cpp
@pytest.mark.parametrize("start_method", START_METHODS)
def test_the_compilers_of_a_job_die_with_the_parent_under_every_start_method(start_method):
    """A parent killed while its worker runs g++ (the driver, cc1plus, and as beside it
    with -pipe): the worker and every compiler process go too, whoever started the worker."""
    marker = f"AIOCOMPILE_ORPHAN_{uuid.uuid4().hex}"  # in the command lines of c++ and cc1plus
    proc = subprocess.Popen([sys.executable, "-c", COMPILING_PARENT_DIES, str(ROOT / "tests"), start_method, marker],
                            env=subprocess_env())
    descendants: set[int] = set()
    try:
        def compiling() -> bool:
            descendants.update(child_pids(proc.pid))
            running = {name for pid, _, name, _ in processes() if pid in descendants}
            return {"cc1plus", "as"} <= running

        assert wait_until(compiling, 60), "the compile never ran cc1plus and as"
    finally:
        proc.kill()
        proc.wait()
    try:
        assert wait_until(lambda: not alive(descendants), 5), \
            [(pid, name) for pid, _, name, _ in processes() if pid in alive(descendants)]
        assert marked(marker) == []
    finally:
        for pid in alive(descendants):  # a failure here must not leave cc1plus spinning
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)



def test_workers_run_nicer_than_this_process():
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    with WorkerPool(1, preload=(), worker_nice=7) as pool:
        pid = pool.submit(jobs.pid).result(timeout=60)
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + 7)
        # The fork server the worker came from (its parent) too: its start-up and forks
        # run behind this process's threads.
        fork_server = pool.submit(os.getppid).result(timeout=60)
        assert fork_server != os.getpid()
        assert os.getpriority(os.PRIO_PROCESS, fork_server) == min(19, mine + 7)
    with WorkerPool(1, preload=()) as pool:
        pid = pool.submit(jobs.pid).result(timeout=60)
        assert os.getpriority(os.PRIO_PROCESS, pid) == mine
    assert aiocompile.SchedulerConfig().worker_nice == 10
    with pytest.raises(ValueError, match="worker_nice"):
        aiocompile.SchedulerConfig(worker_nice=25)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_idle_workers_their_fork_server_and_their_compilers_run_under_sched_idle():
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    with WorkerPool(1, preload=(), worker_nice=3, worker_idle=True) as pool:
        pid = pool.submit(jobs.pid).result(timeout=60)
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + 3)
        fork_server = pool.submit(os.getppid).result(timeout=60)
        assert fork_server != os.getpid() and os.sched_getscheduler(fork_server) == os.SCHED_IDLE
        # What a worker starts (a compiler) inherits it.
        assert pool.submit(jobs.child_policy).result(timeout=60) == os.SCHED_IDLE
    with WorkerPool(1, preload=()) as pool:
        pid = pool.submit(jobs.pid).result(timeout=60)
        assert os.sched_getscheduler(pid) == os.sched_getscheduler(0) != os.SCHED_IDLE
    assert aiocompile.SchedulerConfig().worker_idle is False
    assert aiocompile.SchedulerConfig.from_env({"AIOCOMPILE_WORKER_IDLE": "yes"}).worker_idle is True
    with pytest.raises(TypeError, match="worker_idle"):
        aiocompile.SchedulerConfig(worker_idle=1)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10's Popen makes no group without a session")
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_pool_processes_lead_groups_of_their_own_in_this_session(start_method):
    """A fork server and the workers lead process groups of their own (a Ctrl-C for the
    application does not reach them; killing a group kills its compilers) but stay in this
    process's session: where Linux groups each session for the scheduler (autogroup), a
    pool in a session of its own took the CPU as an equal of the serving process,
    SCHED_IDLE or not."""
    with WorkerPool(1, preload=(), start_method=start_method, worker_idle=True) as pool:
        worker = pool.submit(jobs.pid).result(timeout=60)
        parent = pool.submit(os.getppid).result(timeout=60)
        processes = [worker] if parent == os.getpid() else [worker, parent]
        if start_method == "forkserver":
            assert parent != os.getpid()  # the fork server
        for pid in processes:
            assert os.getsid(pid) == os.getsid(0), pid
            assert os.getpgid(pid) == pid != os.getpgid(0), pid
        # What a worker starts stays in its group.
        assert pool.submit(jobs.child_group).result(timeout=60) == worker


_CTRL_C = """
import os, signal, time, sys
sys.path.insert(0, os.environ["TESTS_DIR"])
import jobs
from aiocompile._pool.pool import WorkerPool
signal.signal(signal.SIGINT, lambda *_: print("interrupted", flush=True))
def running(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
with WorkerPool(1, preload=(), start_method=sys.argv[1]) as pool:
    worker = pool.submit(jobs.pid).result(timeout=60)
    compiler = pool.submit(jobs.start_sleeper).result(timeout=60)
    os.killpg(os.getpgid(0), signal.SIGINT)  # what a terminal's Ctrl-C does to its foreground group
    time.sleep(0.5)
    print(pool.submit(jobs.pid).result(timeout=60) == worker, pool.counters.worker_crashes, running(compiler),
          flush=True)
    os.kill(compiler, signal.SIGKILL)
"""


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_ctrl_c_for_the_application_does_not_reach_its_pool(start_method):
    """The program's process group gets the SIGINT; its fork server, its workers and what
    they run (a compiler), in groups of their own, go on: the same worker answers the next
    job, and the compiler still runs."""
    run = subprocess.run([sys.executable, "-c", _CTRL_C, start_method], capture_output=True, text=True, timeout=120,
                         env=subprocess_env(TESTS_DIR=os.path.dirname(__file__)), start_new_session=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["interrupted", "True", "0", "True"], (run.stdout, run.stderr[-2000:])


def test_jobs_submitted_from_many_threads_at_once_each_run_once_amid_crashes():
    """Idle workers are taken by whichever thread submits first, or by the supervisor:
    from four threads at once, with workers dying under some jobs, every job runs and
    answers exactly once, and crashes are charged to the jobs that caused them."""
    pool = WorkerPool(3, max_crashes=1)
    try:
        results: dict[tuple[int, int], Any] = {}
        lock = threading.Lock()

        def submitter(thread: int) -> None:
            for i in range(150):
                if i % 25 == 24:
                    future = pool.submit(jobs.exit_now, 3)
                else:
                    future = pool.submit(jobs.echo, (thread, i))
                with lock:
                    results[(thread, i)] = future

        threads = [threading.Thread(target=submitter, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for (thread, i), future in results.items():
            if i % 25 == 24:
                with pytest.raises(WorkerCrashed):
                    future.result(timeout=120)
            else:
                assert future.result(timeout=120) == (thread, i)
        assert pool.counters.worker_crashes == 4 * 6
        assert pool.counters.retries == 0  # no innocent job was caught in a crash
    finally:
        pool.shutdown(wait=True)


@pytest.mark.parametrize(("timeout", "exc"), [("5", TypeError), (0, ValueError), (-1.0, ValueError),
                                             (float("nan"), ValueError), (float("inf"), ValueError),
                                             (True, TypeError)])
def test_a_bad_timeout_is_refused_at_submit_and_the_pool_carries_on(timeout, exc):
    pool = WorkerPool(1)
    try:
        assert pool.submit(abs, -1).result(timeout=60) == 1  # the worker is up and idle
        with pytest.raises(exc, match="timeout"):
            pool.submit_job(abs, (-2,), timeout=timeout)
        assert pool.submit_job(abs, (-3,), timeout=30).future.result(timeout=60) == 3
    finally:
        pool.shutdown(wait=True)


def test_a_payload_naming_main_only_as_data_is_pickled_once(monkeypatch):
    """A job's pickle that holds the name ``__main__`` only inside a bytes value (a pickled
    model a background compile carries) is checked without being pickled again; a real
    reference to ``__main__`` still takes the careful way."""
    import pickle

    from aiocompile._pool import serialize

    carefully: list[object] = []
    real = serialize._dumps_carefully

    def noting(obj: object) -> bytes:
        carefully.append(obj)
        return real(obj)

    monkeypatch.setattr(serialize, "_dumps_carefully", noting)
    data = b"\x8c\x08__main__\x94" * 1000
    job = (len, (data,), {})
    payload, definition = serialize.dumps_apart(job)
    assert definition is None and carefully == []
    assert pickle.loads(payload) == job

    class Local:  # pickled by reference into __main__ would fail in a worker
        pass

    Local.__module__ = "__main__"
    with contextlib.suppress(TypeError):  # refused without cloudpickle; sent by value with it
        serialize.dumps_apart((len, (Local,), {}))
    assert len(carefully) == 1


@pytest.mark.parametrize("buffers", [0, 1500])
def test_a_large_job_is_written_in_parts_whole_and_in_order(buffers):
    """In parts, uncopied; with more out-of-band buffers than one ``writev`` takes (a
    model of many large weights), in several."""
    import pickle

    from aiocompile._pool import protocol, roster

    payload = os.urandom(3 * protocol.JOINED_MAX + 17)
    extra = tuple(pickle.PickleBuffer(bytes([n % 256]) * 100) for n in range(buffers))
    parts = protocol.encode_job(7, {"A": "1"}, ["/x"], payload, None, extra)
    assert len(parts) == 2 + buffers and parts[1] is payload  # the payload itself, uncopied
    small = protocol.encode_job(7, {"A": "1"}, ["/x"], b"small")
    assert len(small) == 1
    read, write = os.pipe()
    received = bytearray()

    def drain() -> None:
        while chunk := os.read(read, 65536):  # a pipe takes 64 KiB at a time: partial writes
            received.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        roster._write_all(write, parts)
    finally:
        os.close(write)
        reader.join(10)
        os.close(read)
    assert bytes(received) == b"".join(parts)
    message = protocol.decode_job(memoryview(bytes(received))[4:])
    assert bytes(message.payload) == payload and [bytes(b) for b in message.buffers] == [bytes(b) for b in extra]


def test_a_large_parcel_goes_beside_the_jobs_pickle_and_arrives_whole():
    """A pickled model (``Parcel``) and a background compile's inputs are offered out of
    band: the pool's own jobs carry them as buffers beside a small pickle, written uncopied;
    any other pickling copies them in as before."""
    import pickle

    from aiocompile._pool import serialize
    from aiocompile._pool.job import Job
    from aiocompile._torch.parcel import Parcel, digest

    parcel = Parcel(os.urandom(serialize.OUT_OF_BAND_MIN + 1), "reference")
    small = Parcel(b"small", "reference")
    job = Job.create(1, digest, (parcel,), None, timeout=None, max_crashes=1, name=None, key=None, apart=True)
    assert len(job.buffers) == 1 and job.buffers[0].raw().nbytes == len(parcel.data)
    assert len(job.payload) < 4096
    assert Job.create(2, digest, (small,), None, timeout=None, max_crashes=1, name=None, key=None,
                      apart=True).buffers == ()
    # Pickled any other way (another executor's jobs, a copy), it is in the pickle itself.
    assert pickle.loads(serialize.dumps((digest, (parcel,), {})))[1][0] == parcel
    with WorkerPool(1, preload=(), max_crashes=1) as pool:
        assert pool.submit(digest, parcel).result(timeout=60) == digest(parcel)
        assert pool.submit(digest, small).result(timeout=60) == digest(small)
        # A job after one with buffers: the worker reads each message whole.
        assert pool.submit(len, b"after").result(timeout=60) == 5


def test_a_job_that_takes_the_careful_way_carries_no_buffers():
    """A job whose first pickling fails (here a function of __main__ that pickle cannot
    find) after a large parcel was offered out of band goes the careful way, every value
    in its pickle, and no buffer beside it."""
    import pickle

    pytest.importorskip("cloudpickle")
    from aiocompile._pool import serialize
    from aiocompile._torch.parcel import Parcel

    parcel = Parcel(os.urandom(serialize.OUT_OF_BAND_MIN + 1), "reference")
    scale = lambda x: 2 * x  # noqa: E731 - a lambda: pickled by reference, it cannot be found
    scale.__module__ = "__main__"
    buffers: list = []
    payload, definition = serialize.dumps_apart((len, (parcel, scale), {}), buffers)
    assert buffers == [] and definition is None
    _, (back, function), _ = pickle.loads(payload)
    assert back == parcel and function(21) == 42
