"""The jobs bench_crash.py runs (a module of their own, so both pools import them)."""

import os
import time

# The pids of the pool's workers before the fault (filled in by the benchmark).
POOL_PIDS: list = []


def _log(path, kind, name):
    with open(path, "a") as f:
        f.write(f"{kind} {name} {time.time():.6f} {os.getpid()}\n")


def noop():
    return os.getpid()


def innocent(name, seconds, path):
    _log(path, "start", name)
    time.sleep(seconds)
    return name


def poison(path):
    _log(path, "start", "poison")
    _log(path, "death", "poison")
    os._exit(1)
