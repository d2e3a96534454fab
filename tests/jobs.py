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
