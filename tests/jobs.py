"""Job functions the tests send to workers (importable, so they pickle by reference)."""

import ctypes
import os
import signal
import sys
import time


def getenv(name):
    return os.environ.get(name)


def pid():
    return os.getpid()


def _of_a_child(look):
    """``look(pid)`` of a process this job starts (a compiler would be one)."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        return look(child.pid)
    finally:
        child.kill()
        child.wait()


def child_policy():
    """The scheduling policy of a process this job starts."""
    return _of_a_child(os.sched_getscheduler)


def child_group():
    """The process group of a process this job starts."""
    return _of_a_child(os.getpgid)


def start_sleeper():
    """Start a process that sleeps (as a compiler would run) and leave it running; its pid."""
    import subprocess

    return subprocess.Popen(["sleep", "30"]).pid


def echo(value):
    return value


def sleep_then(seconds, value=None):
    time.sleep(seconds)
    return value


def exit_now(code):
    os._exit(code)


def kill_self(signum=signal.SIGKILL):
    os.kill(os.getpid(), signum)
    time.sleep(10)


def segfault():
    ctypes.string_at(0)


def print_then_exit(text, code):
    print(text, file=sys.stderr, flush=True)
    os.write(2, b"native write before death\n")
    os._exit(code)


def hang():
    while True:
        time.sleep(1)


def die_in_preload():
    """A preload hook that kills the fork server while it starts."""
    os._exit(5)


def fail_in_preload():
    raise RuntimeError("this preload hook is broken")


def slow_preload():
    """A preload hook that takes minutes (as torch's and Inductor's imports can, on a busy
    machine), noting its pid in $AIOCOMPILE_TEST_PRELOAD_PID first."""
    import time

    with open(os.environ["AIOCOMPILE_TEST_PRELOAD_PID"], "w") as note:
        note.write(str(os.getpid()))
    time.sleep(600)


def mark_then_sleep(path, seconds, value=None):
    """Append this worker's pid to ``path`` (so a test can see that the job ran, and
    where), then sleep and return ``value``."""
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(seconds)
    return value


def mark_start_and_end(path, seconds, value=None):
    """Append "start <pid>" to ``path``, sleep, append "end <pid>" and return ``value``: a
    test sees every attempt at the job, and every one that ran to its end."""
    with open(path, "a") as f:
        f.write(f"start {os.getpid()}\n")
    time.sleep(seconds)
    with open(path, "a") as f:
        f.write(f"end {os.getpid()}\n")
    return value


_kept = []


def allocate_and_keep(megabytes):
    """Grow this worker's resident memory by ``megabytes`` and keep it."""
    block = bytearray(megabytes * 1024 * 1024)
    for i in range(0, len(block), 4096):
        block[i] = 1
    _kept.append(block)
    return os.getpid()


def raise_unpicklable():
    import threading

    class Unpicklable(Exception):
        def __init__(self):
            super().__init__("this exception holds a lock")
            self.lock = threading.Lock()

    raise Unpicklable()


def return_unpicklable():
    return lambda: None


def big_result(megabytes):
    return b"\x01" * (megabytes * 1024 * 1024)


def loaded_modules(names):
    """Which of ``names`` this worker had imported before the job, and its BLAS thread
    count setting."""
    return [name in sys.modules for name in names], os.environ.get("OPENBLAS_NUM_THREADS")


def setenv_then_get(name, value):
    """Set a variable in the worker, as a job may, and say what it was before."""
    before = os.environ.get(name)
    os.environ[name] = value
    return before


# -- answers this process cannot rebuild ------------------------------------------------------

WORKER_ONLY_MODULE = "aiocompile_worker_only_module"
WORKER_ONLY_SOURCE = '''
class OnlyHere(Exception):
    """An exception class only a worker that put this directory on sys.path can import."""


class Thing:
    pass
'''


def _import_worker_only(directory):
    import importlib

    if directory not in sys.path:
        sys.path.insert(0, directory)
    return importlib.import_module(WORKER_ONLY_MODULE)


def raise_worker_only(directory, message):
    """Raise an exception whose class lives in a module that only this worker can import."""
    raise _import_worker_only(directory).OnlyHere(message)


def big_result_holding_a_worker_only_object(directory, megabytes):
    """A large answer (streamed) that cannot be unpickled in the parent halfway through."""
    return [b"\x02" * (megabytes * 1024 * 1024), _import_worker_only(directory).Thing(), b"\x03" * 1024]


class ReadOnlyOutput(Exception):
    """An exception whose ``output`` is a read-only property (and empty)."""

    @property
    def output(self):
        return ""


def raise_read_only_output(text):
    print(text, file=sys.stderr, flush=True)
    raise ReadOnlyOutput("output is not mine to set")


def raise_big(megabytes):
    raise ValueError("e" * (megabytes * 1024 * 1024))


def start_tree_then_hang(path):
    """Start a child that starts a grandchild (as g++ starts cc1plus, nvcc cicc and ptxas),
    write both pids to ``path``, then hang."""
    import subprocess

    child = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    with open(path, "w") as f:
        f.write(f"{child.pid} {grandchild}\n")
    time.sleep(300)


def wait_for_path(path, timeout=60.0):
    """Return once ``path`` exists (a gate a test opens)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)
    return path
