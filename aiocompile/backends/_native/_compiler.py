"""Finding a compiler program, and what it is.

A compiler is found in the parent, before any worker is involved: the one given
(``compiler=``: a path, or a name looked up on ``PATH``), or the first found of

==========  ==========================================================================
C++         ``c++``, ``g++``, ``clang++`` on ``PATH``
CUDA        ``nvcc`` in ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, on ``PATH``, in
            ``/usr/local/cuda/bin``
ROCm        ``hipcc`` in ``$ROCM_PATH/bin``, ``$HIP_PATH/bin``, on ``PATH``, in
            ``/opt/rocm/bin``
==========  ==========================================================================

Where none is, ``CompilerNotFound`` says where it looked. These environment variables are
read here and nowhere else, as are those that change what a compiler reads or writes
(``ENVIRONMENT``: ``CPATH`` and its kin, ``LIBRARY_PATH``, ``NVCC_APPEND_FLAGS``...), which
go into every key and travel with every compile (see ``environment``).

Its identity (what ``--version`` prints, and for GCC and Clang the machine they build for)
goes into every key: another compiler, or another version of the same, builds another
binary. Asking costs a process or two, so it is asked once per process,
compiler file (its path, inode, size and modification time: a compiler upgraded in place
is asked again) and environment it runs with, in the calling thread, which is a backend's
key thread, never an event loop's. hipcc is a driver over another compiler, chosen by its
environment (``HIP_PLATFORM``: AMD's Clang, or nvcc): it is asked with the environment it
compiles with, so that its identity names the compiler underneath (HIP's version, then
Clang's). The AMD processors that compiler knows (``amd_processors``) are asked the same
way, once, so that an architecture it does not know is refused before any worker.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, TypeVar, cast

from aiocompile.errors import CompilerNotFound

__all__ = ["ENVIRONMENT", "Compiler", "Environment", "amd_processors", "environment", "find", "host_compiler",
           "identify"]

Environment = tuple[tuple[str, str | None], ...]
"""``(name, value)`` pairs a compiler runs with; None: unset (see ``environment``)."""

# What each kind of compile looks for when no compiler is given: names on PATH, and the
# environment variables (then fixed directories) whose bin/ may hold it.
_SEARCH: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "cpp": (("c++", "g++", "clang++"), (), ()),
    "cuda": (("nvcc",), ("CUDA_HOME", "CUDA_PATH"), ("/usr/local/cuda",)),
    "hip": (("hipcc",), ("ROCM_PATH", "HIP_PATH"), ("/opt/rocm",)),
}
_WHAT = {"cpp": "C++ compiler", "cuda": "CUDA compiler", "hip": "ROCm (HIP) compiler"}

ENVIRONMENT = (
    # GCC and Clang: where headers, libraries and the compiler's own programs are looked
    # for, what goes into the binary (a date, a run path), Clang's rewriting of its options.
    "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "OBJC_INCLUDE_PATH", "LIBRARY_PATH", "COMPILER_PATH",
    "GCC_EXEC_PREFIX", "GCC_COMPARE_DEBUG", "SOURCE_DATE_EPOCH", "LD_RUN_PATH", "CCC_OVERRIDE_OPTIONS",
    # nvcc: flags it adds to every command line, and the host compiler.
    "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN",
    # hipcc: the platform, where its clang and device libraries are, flags it adds.
    "HIP_PLATFORM", "HIP_COMPILER", "HIP_RUNTIME", "HIP_CLANG_PATH", "HIP_PATH", "ROCM_PATH", "HIP_DEVICE_LIB_PATH",
    "DEVICE_LIB_PATH", "HIPCC_COMPILE_FLAGS_APPEND", "HIPCC_LINK_FLAGS_APPEND",
)
"""The environment variables that change what a compiler run reads or builds. Their values
(or their absence) go into the key, and every compile, and every dependency pass, runs with
exactly these values, whatever the worker's own environment: a variable set or changed
after the workers started reaches the compile as it reached the key."""

_PATH_LISTS = frozenset({"CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "OBJC_INCLUDE_PATH", "LIBRARY_PATH",
                         "COMPILER_PATH"})

DROPPED = ("DEPENDENCIES_OUTPUT", "SUNPRO_DEPENDENCIES")
"""Variables that make GCC write a dependency file of its own beside the compile: never
passed on (the compile writes its own, in its scratch directory)."""


def environment(cwd: str, environ: Mapping[str, str] = os.environ) -> Environment:
    """``(name, value)`` for each of ``ENVIRONMENT``, None where unset. A relative
    directory in a path list (an empty entry of ``CPATH`` means the current directory) is
    made absolute against ``cwd``, the caller's current directory, as relative paths in
    flags are: the compile runs in a scratch directory, where it would mean another one."""
    found: list[tuple[str, str | None]] = []
    for name in ENVIRONMENT:
        value = environ.get(name)
        if value is not None and name in _PATH_LISTS:
            value = os.pathsep.join(os.path.normpath(os.path.join(cwd, entry)) for entry in value.split(os.pathsep))
        found.append((name, value))
    return tuple(found)


@dataclass(frozen=True)
class Compiler:
    """A compiler program and what it said about itself."""

    path: str
    """Absolute path, as found (``/usr/bin/g++``, not what the link points to)."""
    family: str
    """``"gcc"``, ``"clang"``, ``"nvcc"``, ``"hipcc"``, or ``"unknown"``."""
    version: str
    """``"12.2.0"``, ``"13.0.88"``; empty where it could not be read."""
    identity: str
    """What ``--version`` printed, with the machine it builds for (GCC, Clang)."""
    realpath: str
    machine: str = ""
    """The machine GCC or Clang builds for (``x86_64-linux-gnu``); empty for others."""

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def summary(self) -> str:
        """The compiler as a message names it: ``hipcc (HIP 5.2.21153-0, clang 15.0.6)``,
        ``nvcc (13.0.88)``; the Clang under hipcc where its identity names one."""
        under = re.search(r"clang version (\d+(?:\.\d+)*)", self.identity) if self.family == "hipcc" else None
        parts = [f"HIP {self.version}" if self.family == "hipcc" and self.version else self.version,
                 f"clang {under.group(1)}" if under else ""]
        shown = ", ".join(part for part in parts if part)
        return f"{self.name} ({shown})" if shown else self.name


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find(kind: str, given: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The absolute path of the compiler to run for ``kind`` ("cpp", "cuda" or "hip");
    ``CompilerNotFound`` if there is none."""
    what = _WHAT[kind]
    path_var = environ.get("PATH", os.defpath)
    if given is not None:
        if os.sep in given:
            path = os.path.abspath(given)
            if _executable(path):
                return path
            raise CompilerNotFound(f"compiler={given!r}: no executable file there (the {what} to run)")
        found = shutil.which(given, path=path_var)
        if found is None:
            raise CompilerNotFound(f"compiler={given!r} is not on PATH ({path_var}); give its path, or install it")
        return os.path.abspath(found)
    names, variables, fixed = _SEARCH[kind]
    looked: list[str] = []
    for variable in variables:
        root = environ.get(variable)
        if root:
            for name in names:
                candidate = os.path.join(root, "bin", name)
                looked.append(f"{candidate} (${variable})")
                if _executable(candidate):
                    return os.path.abspath(candidate)
    for name in names:
        found = shutil.which(name, path=path_var)
        if found is not None:
            return os.path.abspath(found)
    looked.append(f"{', '.join(names)} on PATH ({path_var})")
    for root in fixed:
        for name in names:
            candidate = os.path.join(root, "bin", name)
            looked.append(candidate)
            if _executable(candidate):
                return candidate
    hint = {"cpp": "install g++ or clang++", "cuda": "install the CUDA toolkit, or set CUDA_HOME",
            "hip": "install ROCm, or set ROCM_PATH"}[kind]
    raise CompilerNotFound(f"no {what} found: looked for {'; '.join(looked)}; {hint}, or pass compiler=")


def host_compiler(environ: Mapping[str, str] = os.environ) -> str | None:
    """The C++ compiler nvcc would use for host code when not told (``g++`` on PATH), so
    that it can be told explicitly and keyed; None where there is none."""
    found = shutil.which("g++", path=environ.get("PATH", os.defpath))
    return os.path.abspath(found) if found else None


_T = TypeVar("_T")


class _Identities:
    """What each compiler file said about itself, and the AMD processors it knows, asked
    once per process, file and environment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[tuple[object, ...], object] = {}
        self._pid = os.getpid()

    def get(self, what: str, path: str, environment: Environment, ask: Callable[[str, str], _T]) -> _T:
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except OSError as exc:
            raise CompilerNotFound(f"the compiler {path} cannot be read: {exc.strerror or exc}") from None
        stamp = (what, path, real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, environment)
        with self._lock:
            if self._pid != os.getpid():  # a forked child asks for itself
                self._known, self._pid = {}, os.getpid()
            if stamp in self._known:
                return cast(_T, self._known[stamp])
        # Asked outside the lock: two threads asking at once for a new compiler each pay
        # for a process once, rather than one waiting for the other's.
        found = ask(path, real)
        with self._lock:
            return cast(_T, self._known.setdefault(stamp, found))


_IDENTITIES = _Identities()


def identify(path: str, environment: Environment = ()) -> Compiler:
    """What the compiler at ``path`` is, run with ``environment`` applied to this
    process's (asked once per process, compiler file and environment)."""
    return _IDENTITIES.get("identity", path, environment, lambda p, real: _ask(p, real, environment))


def amd_processors(compiler: Compiler, environment: Environment = ()) -> frozenset[str] | None:
    """The AMD processors (``gfx90a``, ...) that ``compiler`` (hipcc over Clang, or Clang)
    builds for, as its Clang lists them (``-print-supported-cpus`` for the ``amdgcn``
    target: no source is compiled); None where it cannot say (another compiler, or one
    that does not answer that question): its compile then says what it knows."""
    if compiler.family not in ("hipcc", "clang"):
        return None
    return _IDENTITIES.get("amd-processors", compiler.path, environment,
                           lambda path, real: _processors(path, environment))


def _processors(path: str, environment: Environment) -> frozenset[str] | None:
    try:
        stdout, stderr = _run([path, "--target=amdgcn-amd-amdhsa", "-nogpulib", "-print-supported-cpus"],
                              environment)
    except CompilerNotFound:
        return None
    found = frozenset(re.findall(r"^\s*(gfx[0-9a-f]+)\s*$", stdout + "\n" + stderr, re.MULTILINE))
    return found or None


def _run(argv: list[str], environment: Environment = ()) -> tuple[str, str]:
    """What ``argv`` printed (stdout, stderr), run with ``environment`` applied."""
    env = {**os.environ, "LC_ALL": "C"}
    for name, value in environment:
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CompilerNotFound(f"{argv[0]} does not run ({' '.join(argv[1:])}): {exc}") from None
    stdout, stderr = proc.stdout.decode(errors="replace").strip(), proc.stderr.decode(errors="replace").strip()
    if proc.returncode != 0:
        text = f"{stdout}\n{stderr}".strip()
        raise CompilerNotFound(f"{argv[0]} is not a usable compiler: '{' '.join(argv)}' exited with status "
                               f"{proc.returncode}: {text[-500:]}")
    return stdout, stderr


_BOILERPLATE = re.compile(r"Copyright|This is free software|warranty;")
_VERSION_PATTERNS = {
    "nvcc": r"release [\d.]+, V(\d+\.\d+\.\d+)",
    "hipcc": r"HIP version: (\S+)",
    "clang": r"clang version (\d+\.\d+\.\d+)",
    "gcc": r"\) (\d+\.\d+(?:\.\d+)?)",
}


def _ask(path: str, real: str, environment: Environment) -> Compiler:
    stdout, stderr = _run([path, "--version"], environment)
    text = f"{stdout}\n{stderr}".strip()
    lowered = text.lower()
    if "cuda compilation tools" in lowered:
        family = "nvcc"
    elif "hip version" in lowered:
        family = "hipcc"
    elif "clang version" in lowered:
        family = "clang"
    elif "free software foundation" in lowered:
        family = "gcc"
    else:
        family = "unknown"
    if family == "hipcc":
        # hipcc's helpers complain on stderr where there is no GPU (rocm_agent_enumerator):
        # what it is is on stdout, the same on a machine with a GPU and one without.
        text = stdout
    identity = "\n".join(line for line in text.splitlines() if line.strip() and not _BOILERPLATE.match(line))
    machine = ""
    if family in ("gcc", "clang"):
        # The version text does not say which machine a cross compiler builds for.
        lines = _run([path, "-dumpmachine"], environment)[0].splitlines()
        if not lines or not lines[-1].strip():
            raise CompilerNotFound(f"{path} is not a usable compiler: '{path} -dumpmachine' printed nothing, where "
                                   "a GCC or Clang driver prints the machine it builds for")
        machine = lines[-1].strip()
        identity += f"\nmachine: {machine}"
    found = re.search(_VERSION_PATTERNS.get(family, r"(\d+\.\d+(?:\.\d+)?)"), text)
    return Compiler(path=path, family=family, version=found.group(1) if found else "", identity=identity,
                    realpath=real, machine=machine)
