"""The jobs bench_crash.py runs (a module of their own, so both pools import them)."""

import os
import time


def _log(path, kind, name):
    with open(path, "a") as f:
        f.write(f"{kind} {name} {time.time():.6f}\n")


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
