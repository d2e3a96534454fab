"""Shared test set-up.

Every ``async def`` test runs twice: under asyncio, driven by pytest-asyncio, and under
trio, driven by anyio's pytest plugin. The test ids say which (``[asyncio]``/``[trio]``).
Tests therefore use no async fixtures; a test that needs a scheduler gets the
session-wide one (a ``Scheduler`` is not tied to an event loop) or makes its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# Compiles in tests must really compile: give Triton an empty cache for this session.
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="aiocompile-tests-triton-"))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# Repro bundles of failed compiles go to the default root under $XDG_CACHE_HOME: keep the
# tests' out of the user's own cache directory.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="aiocompile-tests-cache-")


def _hold_loggings_lock_while_capture_begins() -> None:
    """pytest's log capture walks ``logging``'s table of loggers, without the lock that
    guards it, as each test phase begins (``catching_logs.__enter__``, pytest 9.2). A module
    imported meanwhile in another thread adds its logger, and the phase fails with
    "dictionary changed size during iteration": aiocompile imports in threads of its own
    (a load's imports, Inductor's settings) that go on after the test that started them.
    The walk is made here holding that lock, which ``logging.getLogger`` takes too."""
    from _pytest import logging as capture

    enter = capture.catching_logs.__enter__

    def locked_enter(self):
        with logging._lock:
            return enter(self)

    capture.catching_logs.__enter__ = locked_enter


_hold_loggings_lock_while_capture_begins()

try:
    import pytest_asyncio  # noqa: F401

    _PYTEST_ASYNCIO = True
except ImportError:  # pragma: no cover - machines without it run the asyncio half with anyio's plugin
    _PYTEST_ASYNCIO = False
_TRIO = importlib.util.find_spec("trio") is not None


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    # Request anyio_backend from every async test, so that it stays in the test's fixture
    # closure whatever else the test is parametrized with.
    if collector.istestfunction(obj, name) and inspect.iscoroutinefunction(obj):
        pytest.mark.usefixtures("anyio_backend")(obj)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not inspect.iscoroutinefunction(metafunc.function):
        return
    # Parametrizing anyio_backend itself (rather than a fixture of our own) keeps it in the
    # item's fixture closure: anyio's plugin runs the items where it is set, and
    # pytest-asyncio the ones marked asyncio, where it is None.
    if "anyio_backend" not in metafunc.fixturenames:
        metafunc.fixturenames.append("anyio_backend")
    params = [
        pytest.param(None, marks=pytest.mark.asyncio, id="asyncio") if _PYTEST_ASYNCIO
        else pytest.param("asyncio", marks=pytest.mark.anyio, id="asyncio"),
        pytest.param("trio", marks=[pytest.mark.anyio, pytest.mark.skipif(not _TRIO, reason="trio is not installed")],
                     id="trio"),
    ]
    metafunc.parametrize("anyio_backend", params)


@pytest.fixture
def anyio_backend() -> str | None:
    # Overrides anyio's parametrized fixture; each async test parametrizes it directly.
    return None


@pytest.fixture
def async_runner(anyio_backend: str | None) -> str:
    """Which event loop runs this test: "asyncio" or "trio"."""
    return anyio_backend or "asyncio"


@pytest.fixture(scope="session")
def scheduler():
    """One scheduler for the whole session, shared by asyncio and trio tests."""
    import aiocompile

    sched = aiocompile.Scheduler(workers=2)
    yield sched
    sched.close(grace=0)


class Templates:
    """Cache directories made once for a test module and copied for each test that starts
    from one: the same files each time, without a compile (or a process) per test."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._factory = tmp_path_factory
        self._made: dict = {}

    async def copy(self, directory: Path, name: str, make):
        """Copy the template ``name`` into ``directory`` (made by ``await make(source)`` the
        first time); returns what ``make`` returned."""
        if name not in self._made:
            source = self._factory.mktemp("template")
            self._made[name] = (source, await make(source))
        source, made = self._made[name]
        shutil.copytree(source, directory, symlinks=True, dirs_exist_ok=True)
        return made


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """This module's ``Templates``."""
    return Templates(tmp_path_factory)


def subprocess_env(**extra: str) -> dict:
    """This environment, with the checkout first on PYTHONPATH, for scripts the tests run."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def child_pids(pid: int | None = None) -> set[int]:
    """Live (non-zombie) descendants of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] == "Z":
            continue
        parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def example_spec(label: str) -> dict:
    """One entry of examples/kernels.py's KERNELS (compile_triton's keyword arguments)."""
    import importlib.util

    name = "aiocompile_example_kernels"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "kernels.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    entry = dict(next(k for k in module.KERNELS if k["label"] == label))
    entry.pop("label")
    return entry


def owned_pids(sched) -> set[int]:
    """The processes a scheduler's own pool started (its fork server and what that forked,
    or its spawned workers), alive now."""
    pool = sched.port._pool
    pids = set(pool.worker_pids())
    launcher = getattr(getattr(pool, "_supervisor", None), "_launcher", None)
    zygote = getattr(getattr(launcher, "_proc", None), "pid", None)
    if zygote is not None:
        pids |= {zygote} | child_pids(zygote)
    return pids


def alive(pids) -> set[int]:
    """Those of ``pids`` that still run (zombies count as gone)."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2] != "Z":
            found.add(pid)
    return found


@contextlib.contextmanager
def threads_started():
    """The names of the threads started inside the block, in a list the block gets
    (``threading.Thread.start`` noted, then put back)."""
    import threading

    started: list[str] = []
    real_start = threading.Thread.start

    def noting_start(thread):
        started.append(thread.name)
        real_start(thread)

    threading.Thread.start = noting_start  # type: ignore[method-assign]
    try:
        yield started
    finally:
        threading.Thread.start = real_start  # type: ignore[method-assign]


@contextlib.contextmanager
def busy_inside_handing_over(calls_per_turn: int = 0):
    """A thread inside aiocompile's ``threads.handing_over`` (as a load's imports are),
    noting the time at each turn of its loop (a Python call each turn: where it stands
    aside; ``calls_per_turn`` more, as a unit of work such as an import makes many),
    running by the time the block begins; yields (those times, the thread)."""
    import threading

    from aiocompile._base import threads

    progress: list[float] = []
    stop = threading.Event()

    def step() -> None:
        pass

    def busy() -> None:
        with threads.handing_over():
            while not stop.is_set():
                for _ in range(calls_per_turn):
                    step()
                progress.append(time.perf_counter())
                time.sleep(0.0005)

    helper = threading.Thread(target=busy)
    helper.start()
    try:
        time.sleep(0.05)
        assert progress, "the helper never ran"
        yield progress, helper
    finally:
        stop.set()
        helper.join(5)


def wait_until(predicate, timeout=10.0, interval=0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@contextlib.contextmanager
def read_only_directory(path: Path):
    """Make the directory tree at ``path`` read-only to this process for the block, for
    real: by its modes when not root, by the immutable attribute (``chattr +i``) as root,
    whom modes do not stop. Skips the test where root cannot set the attribute (no
    ``chattr``, a file system without it, no CAP_LINUX_IMMUTABLE)."""
    directories = [path, *(p for p in path.rglob("*") if p.is_dir() and not p.is_symlink())]
    if os.geteuid() != 0:
        modes = {d: stat.S_IMODE(d.stat().st_mode) for d in directories}
        for d in directories:
            os.chmod(d, 0o555)
        try:
            yield
        finally:
            for d in directories:
                os.chmod(d, modes[d])
        return
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("running as root, and there is no chattr to make a directory read-only")
    made = []
    try:
        for d in directories:
            proc = subprocess.run([chattr, "+i", str(d)], capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.skip(f"running as root, and chattr +i does not work here: {proc.stderr.strip()}")
            made.append(d)
        yield
    finally:
        for d in made:
            subprocess.run([chattr, "-i", str(d)], capture_output=True)


def clear_inductor_caches():
    """Empty Inductor's in-memory caches (compiled kernels, each matmul's choice timings):
    without it, a test compiling a model another test compiled finds everything there."""
    from torch._inductor import utils

    clear = getattr(utils, "clear_caches", None) or getattr(utils, "clear_inductor_caches", None)
    if clear is not None:
        clear()


@pytest.fixture
def fresh_inductor(tmp_path, monkeypatch):
    """Empty Inductor and Triton caches, in memory and on disk, and no graph cache: every
    kernel the test's compile needs is compiled."""
    import torch
    from torch._inductor import config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    torch._dynamo.reset()
    clear_inductor_caches()
    with config.patch(fx_graph_cache=False):
        yield
    torch._dynamo.reset()
    clear_inductor_caches()
