"""Inductor's native builds (its C++ kernels, CUDA/CUTLASS and Halide ones) as requests.

Inductor builds a C++ kernel in three steps, all in ``CppCodeCache.load_async``: it writes
the source into its cache directory and makes the ``CppBuilder`` commands for it (in the
calling thread: this picks the vector ISA and the precompiled header); it hands
``_worker_compile_cpp(lock_path, builders)`` to a compile thread (``submit_fn``), unless
the library is already on disk; and whoever asks for the kernel waits for that, then
loads the library (``cdll`` or a Python extension module) in its own thread.

:func:`cpp_request` turns the second step into a request: the command lines of
Inductor's ``CppBuilder``s run in a worker as ``CppBuilder.build`` runs them
(``_native_worker.build_commands``, which needs no torch), under Inductor's lock, so the
library is the one Inductor would have built, in the place it would have put it. A build
of another shape (a builder of another class, a remote build) runs as the very callable
Inductor would have run (``_native_worker.build_native``, torch imported in the worker).
The first and third steps stay where Inductor runs them. :func:`cuda_request` does the
same for ``AsyncCompile.cuda``: ``CUDACodeCache.compile`` in a worker,
``CUDACodeCache.load`` in the parent; :func:`rocm_request` for ``AsyncCompile.rocm``, with
``ROCmCodeCache`` (Inductor's HIP builds, which run ROCm's Clang).

A Halide kernel (``HalideCodeCache.generate_halide_async``) is built by a task Inductor
hands its ``submit_fn`` too: under a lock for the kernel's directory, a Python program
(the generator) that writes the kernel's static library, the C++ glue's build (the
Python binding, linked with that library and Halide's runtime), and a ``done`` file.
:func:`halide_request` sends those parts to a worker (``_native_worker.build_halide``,
without torch); Inductor loads the binding in the parent as it always does. Halide's
runtime, which Inductor builds in the calling thread on the first kernel of a cache
directory (importing Halide there), is built first in a worker
(:func:`halide_runtime_request`), where Inductor then finds it.

Keys: Inductor's own key for the source (the hash its files are named after: the source
with its compile command), with the commands themselves (where the outputs go, which
compiler), the source file as written (so that a cache directory emptied and refilled
builds afresh) and the environment the build reads.

torch is imported only inside functions: importing this module costs nothing.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from aiocompile.backends import Request
from aiocompile.backends.inductor import _native_worker
from aiocompile.backends.inductor._native_worker import BuildStep

__all__ = ["BUILD_ENV_NAMES", "InductorBuild", "cpp_request", "cuda_request", "halide_request",
           "halide_runtime_request", "rocm_request"]

# Environment variables a compiler reads (where to find itself, its headers, libraries and
# scratch space; nvcc's CUDA), sent with each build and part of its key: the workers' own
# environment is the one this process had when the pool started.
BUILD_ENV_NAMES = (
    "PATH",
    "TMPDIR",
    "CPATH",
    "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH",
    "LIBRARY_PATH",
    "LD_LIBRARY_PATH",
    "CUDA_HOME",
    "CUDA_PATH",
)
# A CUDA build works out its paths in the worker, from Inductor's cache directory; a C++
# build has them in its commands.
_CUDA_ENV_NAMES = (*BUILD_ENV_NAMES, "TORCHINDUCTOR_CACHE_DIR")
# Halide's runtime: its directory, and the compiler command it is named after, are worked
# out in the worker.
_HALIDE_RUNTIME_ENV_NAMES = (*_CUDA_ENV_NAMES, "CXX")

# The Inductor settings a CUDA build reads in the worker (the nvcc command, CUTLASS).
_CUDA_SETTING_PREFIXES = ("cuda.", "cutlass.")

# A ROCm build: where ROCm is (Inductor's settings name its Clang, headers and libraries;
# Clang looks for the HIP runtime and device libraries as these variables say), and the
# ``rocm.`` settings that make the command (architectures, Composable Kernel, options).
_ROCM_ENV_NAMES = (*_CUDA_ENV_NAMES, "ROCM_HOME", "ROCM_PATH", "HIP_PATH", "HIP_DEVICE_LIB_PATH")
_ROCM_SETTING_PREFIXES = ("rocm.",)


@dataclass(frozen=True)
class InductorBuild:
    """What one of Inductor's native builds wrote: ``outputs``, the files Inductor loads
    (its library last), and their ``size`` in bytes. ``cached``: they were on disk
    already, nothing was compiled."""

    name: str
    key: str | None
    outputs: tuple[str, ...]
    size: int
    cached: bool


def _environment(names: tuple[str, ...] = BUILD_ENV_NAMES) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def _key(kind: str, *parts: Any) -> str:
    return hashlib.sha256(repr((kind, parts)).encode("utf-8")).hexdigest()


def _written(paths: Any) -> tuple[tuple[str, int, int], ...]:
    """Each source file as written: its inode and modification time (the file Inductor
    writes once per cache directory)."""
    found = []
    for path in paths if isinstance(paths, (list, tuple)) else ():
        try:
            stat = os.stat(path)
        except (OSError, TypeError):
            continue
        found.append((str(path), stat.st_ino, stat.st_mtime_ns))
    return tuple(found)


def _is_builder(value: Any) -> bool:
    return callable(getattr(value, "get_target_file_path", None)) and callable(
        getattr(value, "get_command_line", None))


def _cpp_parts(build: Callable[[], Any]) -> tuple[str | None, tuple[Any, ...]]:
    """Inductor's lock path and ``CppBuilder``s in the callable it submits
    (``functools.partial(_worker_compile_cpp, lock_path, builders)``; one builder rather
    than a sequence in older releases); ``(None, ())`` for a callable of another shape."""
    if not isinstance(build, functools.partial):
        return None, ()
    lock_path = None
    builders: list[Any] = []
    for arg in build.args:
        if isinstance(arg, str) and arg.endswith(".lock"):
            lock_path = arg
        elif _is_builder(arg):
            builders.append(arg)
        elif isinstance(arg, (list, tuple)) and arg and all(_is_builder(b) for b in arg):
            builders.extend(arg)
    return lock_path, tuple(builders)


def _steps(builders: tuple[Any, ...]) -> tuple[BuildStep, ...] | None:
    """The builders as the command lines ``CppBuilder.build`` would run, each in its
    scratch directory; None unless every one is a plain ``CppBuilder`` building locally
    (not a subclass with a build of its own, not a remote build)."""
    from torch._inductor import cpp_builder

    base = getattr(cpp_builder, "CppBuilder", None)
    scratch_name = getattr(cpp_builder, "_BUILD_TEMP_DIR", None)
    if base is None or not isinstance(scratch_name, str) or not builders:
        return None
    steps = []
    for builder in builders:
        output_dir, name = getattr(builder, "_output_dir", None), getattr(builder, "_name", None)
        if (type(builder).build is not base.build or getattr(builder, "_use_relative_path", True)
                or not isinstance(output_dir, str) or not output_dir or not isinstance(name, str)):
            return None
        steps.append((builder.get_command_line(), output_dir, os.path.join(output_dir, f"{name}_{scratch_name}"),
                      str(builder.get_target_file_path())))
    return tuple(steps)


def cpp_request(build: Callable[[], Any]) -> Request:
    """The request for one C++ build Inductor would have run in a compile thread (what
    ``CppCodeCache.load_async`` hands its ``submit_fn``): its command lines, run without
    torch in the worker (``_native_worker.build_commands``), or else the callable itself."""
    lock_path, builders = _cpp_parts(build)
    outputs = tuple(str(b.get_target_file_path()) for b in builders)
    env = _environment()
    pid = os.getpid()  # marks the builds this process has under way
    if lock_path is None or not builders:
        # A shape this module does not know: still built in a worker, but neither keyed
        # nor shared.
        name = getattr(getattr(build, "func", build), "__name__", "cpp")
        args: tuple[Any, ...] = (build, lock_path, outputs, pid, env, name, None, "cpu")
        return _request("inductor-cpp", name, None, "cpu", _native_worker.build_native, args)
    name = os.path.basename(lock_path)[: -len(".lock")]
    commands = tuple(b.get_command_line() for b in builders)
    sources = _written(getattr(builders[0], "_orig_source_paths", None))
    key = _key("inductor-cpp", name, commands, sources, sorted(env.items()))
    steps = _steps(builders)
    if steps is None:
        args = (build, lock_path, outputs, pid, env, name, key, "cpu")
        return _request("inductor-cpp", name, key, "cpu", _native_worker.build_native, args)
    args = (lock_path, steps, pid, env, name, key, "cpu")
    return _request("inductor-cpp", name, key, "cpu", _native_worker.build_commands, args)


def cuda_request(source_code: str, dst_file_ext: str, aot_compile: bool) -> Request:
    """The request for ``AsyncCompile.cuda(source_code, dst_file_ext, aot_compile)``'s
    build: ``CUDACodeCache.compile`` in a worker, under this process's CUDA settings."""
    from torch._inductor.codecache import CUDACodeCache

    steps = ("o", dst_file_ext) if dst_file_ext == "so" or aot_compile else (dst_file_ext,)
    return _device_code_request("cuda", CUDACodeCache, _CUDA_SETTING_PREFIXES, _CUDA_ENV_NAMES,
                                _native_worker.build_cuda, source_code, dst_file_ext, aot_compile, steps)


def rocm_request(source_code: str, dst_file_ext: str, aot_compile: bool) -> Request:
    """The request for ``AsyncCompile.rocm(source_code, dst_file_ext, aot_compile)``'s
    build: ``ROCmCodeCache.compile`` in a worker, under this process's ROCm settings."""
    from torch._inductor.codecache import ROCmCodeCache

    steps = ("o", dst_file_ext) if aot_compile else (dst_file_ext,)
    return _device_code_request("rocm", ROCmCodeCache, _ROCM_SETTING_PREFIXES, _ROCM_ENV_NAMES,
                                _native_worker.build_rocm, source_code, dst_file_ext, aot_compile, steps)


def _device_code_request(kind: str, code_cache: Any, setting_prefixes: tuple[str, ...], env_names: Any,
                         build_fn: Callable[..., Any], source_code: str, dst_file_ext: str, aot_compile: bool,
                         steps: tuple[str, ...]) -> Request:
    """A CUDA or ROCm build: Inductor's own names for the files (the source written, as its
    compile would), keyed by them, the source, the kind's settings and environment."""
    from torch._inductor import config
    from torch._inductor.codecache import get_lock_dir

    outputs = []
    inductor_key = ""
    suffix = len(code_cache._SOURCE_CODE_SUFFIX)
    for ext in dict.fromkeys(steps):
        inductor_key, input_path = code_cache.write(source_code, ext)
        outputs.append(input_path[:-suffix] + ext)
    lock_path = os.path.join(get_lock_dir(), inductor_key + ".lock")
    save = getattr(config, "save_config_portable", None) or config.get_config_copy
    settings = {k: v for k, v in save().items() if k.startswith(setting_prefixes)}
    env = _environment(env_names)
    backend = f"inductor-{kind}"
    key = _key(backend, inductor_key, tuple(outputs), aot_compile, _written([input_path]),
               sorted(settings.items(), key=lambda kv: kv[0]), sorted(env.items()))
    build = functools.partial(build_fn, source_code, dst_file_ext, aot_compile, settings)
    args = (build, lock_path, tuple(outputs), os.getpid(), env, inductor_key, key, kind)
    return _request(backend, inductor_key, key, kind, _native_worker.build_native, args)


def halide_request(task: Callable[[], Any], target: str = "cpu") -> Request:
    """The request for one Halide kernel's build, the task ``generate_halide_async`` hands
    its ``submit_fn``: ``functools.partial(_worker_task_halide, lock_path, jobs)``, whose
    jobs are the generator's command (``subprocess.check_call``), the glue's build
    (``_worker_compile_cpp``, absent where Inductor has the glue already) and the ``done``
    file (``touch``). Built from those parts without torch in the worker; a task of
    another shape runs as Inductor's own callable (``_native_worker.build_native``)."""
    parts = _halide_parts(task)
    env = _environment()
    pid = os.getpid()
    if parts is None:
        lock_path = _lock_of(task)
        name = _halide_name(lock_path) if lock_path is not None else "halide"
        args: tuple[Any, ...] = (task, lock_path, (), pid, env, name, None, target)
        return _request("inductor-halide", name, None, target, _native_worker.build_native, args)
    lock_path, generate, glue_lock, glue_builders, done = parts
    name = _halide_name(lock_path)
    outputs = (*(str(b.get_target_file_path()) for b in glue_builders), done)
    # The generator as written: Inductor writes it afresh whenever the kernel is not built
    # (a cache directory emptied and refilled), and that is a build of its own.
    key = _key("inductor-halide", name, generate, tuple(b.get_command_line() for b in glue_builders), done,
               _written([generate[1]] if len(generate) > 1 else []), sorted(env.items()))
    steps = _steps(glue_builders) if glue_builders else ()
    if steps is None:
        args = (task, lock_path, outputs, pid, env, name, key, target)
        return _request("inductor-halide", name, key, target, _native_worker.build_native, args)
    args = (lock_path, generate, glue_lock, steps, done, pid, env, name, key, target)
    return _request("inductor-halide", name, key, target, _native_worker.build_halide, args)


def halide_runtime_request(previous: str | None, target: str = "cpu") -> Request:
    """The request for Halide's runtime library (``HalideCodeCache.build_standalone_runtime``),
    built in a worker; ``previous`` is Inductor's record in this process of where it was.
    Not keyed: Inductor's lock and ``done`` file make a second build find the first."""
    args = (previous, _environment(_HALIDE_RUNTIME_ENV_NAMES), target)
    return _request("inductor-halide", "halide-runtime", None, target, _native_worker.build_halide_runtime, args)


def _halide_name(lock_path: str) -> str:
    """Inductor's key for a Halide kernel: its directory's name (``<hash>.halide``)."""
    return os.path.splitext(os.path.basename(os.path.dirname(lock_path)))[0]


def _lock_of(task: Callable[[], Any]) -> str | None:
    if isinstance(task, functools.partial) and task.args and isinstance(task.args[0], str):
        return task.args[0]
    return None


def _halide_parts(task: Callable[[], Any]) -> tuple[str, tuple[str, ...], str | None, tuple[Any, ...], str] | None:
    """``(lock path, generator command, glue lock, glue builders, done file)`` of the
    task, or None for a task of another shape."""
    if not isinstance(task, functools.partial) or len(task.args) != 2 or task.keywords:
        return None
    lock_path, jobs = task.args
    if not isinstance(lock_path, str) or not isinstance(jobs, (list, tuple)):
        return None
    generate: tuple[str, ...] | None = None
    glue_lock: str | None = None
    glue: tuple[Any, ...] = ()
    done: str | None = None
    for job in jobs:
        if not isinstance(job, functools.partial) or job.keywords:
            return None
        func_name = getattr(job.func, "__name__", "")
        if job.func is subprocess.check_call and len(job.args) == 1 and isinstance(job.args[0], (list, tuple)):
            generate = tuple(str(arg) for arg in job.args[0])
        elif func_name == "_worker_compile_cpp":
            glue_lock, glue = _cpp_parts(job)
            if glue_lock is None or not glue:
                return None
        elif func_name == "touch" and len(job.args) == 1 and isinstance(job.args[0], str):
            done = job.args[0]
        else:
            return None
    if generate is None or done is None:
        return None
    return lock_path, generate, glue_lock, glue, done


def _request(backend: str, name: str, key: str | None, target: str, fn: Callable[..., Any],
             args: tuple[Any, ...]) -> Request:
    def finish(answer: Mapping[str, Any]) -> InductorBuild:
        return InductorBuild(name, key, tuple(answer["outputs"]), int(answer["size"]), bool(answer["cached"]))

    return Request(
        backend=backend,
        key=key,
        name=name,
        target=target,
        fn=fn,
        args=args,
        finish=finish,
        encode=None,  # the files are Inductor's, in its own cache directory
        size=lambda result: sum(len(path) for path in result.outputs),  # the library is on disk, not here
        details=_details,
    )


def _details(answer: Mapping[str, Any]) -> dict[str, Any]:
    return {"stages": (("build", float(answer["seconds"])),), "compiler_cache_hit": bool(answer["cached"])}
