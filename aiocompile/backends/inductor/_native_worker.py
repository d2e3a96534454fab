"""Inductor's native builds (C++, CUDA, Halide) inside a worker process.

A C++ build of Inductor is a few compiler command lines, each run in a scratch directory
beside its output, under Inductor's file lock for the source. :func:`build_commands` runs
them with nothing but the standard library, so a worker that builds C++ kernels needs no
torch: a pool that serves only a model on the CPU starts at once, without importing torch
in its fork server (seconds of a CPU, taken from ``torch.compile`` beside it). Only a build
that fails imports torch, to raise Inductor's own error class.

:func:`build_native` runs Inductor's own build callable instead (unpickling it imports
torch), for builds whose shape :mod:`._native` does not know; :func:`build_cuda` runs
``CUDACodeCache.compile``. :func:`build_halide` runs a Halide kernel's build from its parts
(the generator program, the C++ glue's command lines), again without torch in the worker;
:func:`build_halide_runtime` builds the Halide runtime every such kernel links against.

Inductor's build skips every output that already exists. A build killed in the middle
(its worker died, or its timeout killed it) may have left an output half written, which
the retry would then take for finished. So while a build runs, a marker file of the
requesting process (``owner``: its pid) stands beside Inductor's lock, and a build that
finds its own marker from an earlier attempt deletes the outputs first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from typing import Any, Callable

from aiocompile._pool.procs import environment

__all__ = ["BuildStep", "build_commands", "build_cuda", "build_halide", "build_halide_runtime", "build_native", "ready"]

BuildStep = tuple[str, str, str, str]
"""One compiler run: ``(command line, output directory, scratch directory, output file)``,
as ``CppBuilder.build`` runs it."""


def ready() -> float:
    """Warm-up for workers that only build: nothing to import. Returns 0 seconds."""
    return 0.0


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Inductor's lock for a source (its ``FileLock`` is an ``flock`` of the same file,
    which it leaves in place). Blocking: a lock held too long is the job's timeout's to
    end."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _marked(lock_path: str, owner: int, outputs: tuple[str, ...]) -> Iterator[bool]:
    """Under Inductor's lock: clear what an earlier attempt of this owner left half done,
    and yield whether the outputs are all there (nothing to build). While the build runs,
    the marker says an attempt is under way."""
    marker = f"{lock_path}.aiocompile-{owner}"
    if os.path.exists(marker):
        for path in outputs:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    cached = bool(outputs) and all(os.path.exists(path) for path in outputs)
    if cached:
        yield True
        return
    with open(marker, "w") as f:
        f.write(f"{os.getpid()}\n")
    try:
        yield False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(marker)


def _answer(outputs: tuple[str, ...], cached: bool, started: float) -> dict[str, Any]:
    size = 0
    for path in outputs:
        with contextlib.suppress(OSError):
            size += os.stat(path).st_size
    return {"outputs": outputs, "cached": cached, "size": size, "seconds": time.perf_counter() - started}


def _failed(exc: BaseException, name: str, key: str | None, target: str | None) -> BaseException:
    from aiocompile.backends.inductor._build_errors import build_error

    return build_error(exc, name=name, key=key, target=target)


def build_commands(
    lock_path: str,
    steps: tuple[BuildStep, ...],
    owner: int,
    env: Mapping[str, str | None],
    name: str,
    key: str | None,
    target: str | None,
) -> dict[str, Any]:
    """Inductor's ``_worker_compile_cpp`` for ``CppBuilder``s given as their command lines:
    under the lock, each step whose output is missing runs in its scratch directory,
    which is removed after. A compiler that fails raises Inductor's ``CppCompileError``
    with the command and its output, as a ``CompileError`` too."""
    started = time.perf_counter()
    outputs = tuple(step[3] for step in steps)
    with environment(env), _locked(lock_path), _marked(lock_path, owner, outputs) as cached:
        if not cached:
            _run_steps(steps, name, key, target)
    return _answer(outputs, cached, started)


def _run_steps(steps: tuple[BuildStep, ...], name: str, key: str | None, target: str | None) -> None:
    """``CppBuilder.build`` for each step whose output is missing, in its scratch
    directory (removed after)."""
    for command, output_dir, scratch, output in steps:
        if os.path.exists(output):
            continue
        os.makedirs(output_dir, exist_ok=True)
        os.makedirs(scratch, exist_ok=True)
        argv = shlex.split(command)
        try:
            run = subprocess.run(argv, cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
        except OSError as exc:  # the compiler is not there
            raise _failed(exc, name, key, target) from exc
        if run.returncode != 0:
            from torch._inductor.exc import CppCompileError

            error = CppCompileError(argv, run.stdout.decode("utf-8", "replace"))
            raise _failed(error, name, key, target) from error
        shutil.rmtree(scratch, ignore_errors=True)


def build_halide(
    lock_path: str,
    generate: tuple[str, ...],
    glue_lock: str | None,
    glue: tuple[BuildStep, ...],
    done: str,
    owner: int,
    env: Mapping[str, str | None],
    name: str,
    key: str | None,
    target: str | None,
) -> dict[str, Any]:
    """Inductor's ``_worker_task_halide`` given as its parts, under its lock for the
    kernel's directory: the Halide generator (``generate``, a Python program that writes
    the kernel's static library and header), the C++ glue's build (``glue``, under the
    glue's own lock as ``_worker_compile_cpp`` runs it; empty when Inductor had the glue
    already), then the ``done`` file, whose absence is what makes Inductor ask for a
    build. A generator that fails raises a ``CompileError`` with what it printed; a glue
    that does not compile, Inductor's ``CppCompileError`` as for any C++ kernel."""
    started = time.perf_counter()
    outputs = (*(step[3] for step in glue), done)
    with environment(env), _locked(lock_path), _marked(lock_path, owner, outputs) as cached:
        if not cached:
            _generate(generate, name, key, target)
            if glue:
                with _locked(glue_lock) if glue_lock is not None else contextlib.nullcontext():
                    _run_steps(glue, name, key, target)
            # Last: a build killed before this line is a build Inductor asks for again.
            with open(done, "a"):
                pass
    return _answer(outputs, cached, started)


# The end of a failed generator's output kept in its error: Halide's own message comes last.
_GENERATOR_OUTPUT_KEPT = 8000


def _generate(argv: tuple[str, ...], name: str, key: str | None, target: str | None) -> None:
    from aiocompile.errors import CompileError

    try:
        run = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    except OSError as exc:  # the interpreter is not there
        raise _failed(exc, name, key, target) from exc
    if run.returncode != 0:
        output = run.stdout.decode("utf-8", "replace").strip()[-_GENERATOR_OUTPUT_KEPT:]
        raise CompileError(f"the Halide generator exited with status {run.returncode}:\n{output}",
                           command=shlex.join(argv), kernel_name=name, key=key, target=target)


def build_halide_runtime(previous: str | None, env: Mapping[str, str | None], target: str | None) -> dict[str, Any]:
    """``HalideCodeCache.build_standalone_runtime()``: the Halide runtime compiled (with
    the ``halide`` module) and linked into the shared library that every Halide kernel of
    Inductor links against, once per cache directory, under Inductor's lock. ``previous``
    is the requesting process's record of where the runtime was, which decides where
    Inductor puts it now. ``cached``: it was built already."""
    started = time.perf_counter()
    started_ns = time.time_ns()
    from torch._inductor.codecache import HalideCodeCache

    with environment(env):
        HalideCodeCache._standalone_runtime_path = previous
        try:
            path = HalideCodeCache.build_standalone_runtime()
        except Exception as exc:
            raise _failed(exc, "halide-runtime", None, target) from exc
    done = os.path.join(os.path.dirname(path), "done")
    # A runtime built here took seconds: its done file cannot predate the job.
    cached = os.stat(done).st_mtime_ns < started_ns
    return _answer((path,), cached, started)


def build_native(
    build: Callable[[], Any],
    lock_path: str | None,
    outputs: tuple[str, ...],
    owner: int,
    env: Mapping[str, str | None],
    name: str,
    key: str | None,
    target: str | None,
) -> dict[str, Any]:
    """Run one of Inductor's own builds (``build``: what Inductor hands its own compile
    threads, such as ``_worker_compile_cpp`` with its ``CppBuilder``s, or
    :func:`build_cuda`) and report what it wrote. The files are where Inductor would have
    put them; the parent loads them. ``build`` takes Inductor's lock itself, so the
    marker is set under the lock first, and the lock let go for the build."""
    started = time.perf_counter()
    with environment(env), contextlib.ExitStack() as marks:
        cached = False
        if lock_path is not None:
            with _locked(lock_path):
                cached = marks.enter_context(_marked(lock_path, owner, outputs))
        if not cached:
            try:
                build()
            except Exception as exc:
                raise _failed(exc, name, key, target) from exc
    return _answer(outputs, cached, started)


def build_cuda(source_code: str, dst_file_ext: str, aot_compile: bool, settings: Mapping[str, Any]) -> None:
    """What ``AsyncCompile.cuda`` does in Inductor's compile thread, short of loading:
    ``CUDACodeCache.compile`` for the source (its object file first, for AOT), under the
    Inductor settings the parent compiles with (``settings``: the ``cuda.``/``cutlass.``
    ones, which make the nvcc command)."""
    from torch._inductor import config
    from torch._inductor.codecache import CUDACodeCache

    # Inductor's in-memory record of what this process compiled would answer for files
    # a retry may have just deleted; each job goes by the files alone.
    CUDACodeCache.cache_clear()
    with config.patch(dict(settings)):
        if aot_compile:
            CUDACodeCache.compile(source_code, "o")
        CUDACodeCache.compile(source_code, dst_file_ext)


def build_rocm(source_code: str, dst_file_ext: str, aot_compile: bool, settings: Mapping[str, Any]) -> None:
    """What ``AsyncCompile.rocm`` does in Inductor's compile thread, short of loading:
    ``ROCmCodeCache.compile`` for the source (its object file first, for AOT; its test
    runner where ``rocm.generate_test_runner`` asks), under the parent's ``rocm.``
    settings."""
    from torch._inductor import config
    from torch._inductor.codecache import ROCmCodeCache

    ROCmCodeCache.cache_clear()  # as build_cuda: each job goes by the files alone
    with config.patch(dict(settings)):
        if aot_compile:
            ROCmCodeCache.compile(source_code, "o")
        if config.rocm.generate_test_runner:
            ROCmCodeCache.compile(source_code, "exe")
        ROCmCodeCache.compile(source_code, dst_file_ext)
