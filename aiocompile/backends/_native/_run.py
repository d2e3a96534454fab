"""Running a compiler program inside a worker: a scratch directory, the command, what it
printed, how long it took, and its failure as a ``CompileError``; and the dependency pass
a key may need (``dependencies``).

The compiler runs as a child of the worker, in the worker's process group (see
``aiocompile._pool.child.lead_own_group``): when the job is killed (its timeout, or
``cancel_running="kill"``), the group is, and the compiler driver dies with every program
it started (cc1plus, as, ld; cicc, ptxas, fatbinary).

Each compile runs in a directory of its own, ``<tmp>/aiocompile-native-<uid>/<pid>-*``
(0700), with the source under a fixed name (``source.cpp``), so that its command line and
its diagnostics read the same every time (``source.cpp:3:5: error: ...``). The compiler's
own temporary files go there too (``TMPDIR``). A killed worker cannot clean up after
itself, so each compile first removes what workers that no longer run left behind, and
so does a scheduler once its workers have exited (``sweep``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from aiocompile.backends._native._compiler import DROPPED, Environment
from aiocompile.backends._native._headers import make_dependencies
from aiocompile.errors import CompileError

__all__ = ["DependencyPass", "Ran", "dependencies", "failure", "output", "run", "scratch", "sweep"]

# What a CompileError's message shows of the diagnostics; ``output`` keeps more.
_MESSAGE_LINES = 60
_OUTPUT_CHARS = 256 * 1024


def _scratch_root() -> str | None:
    """``<tmp>/aiocompile-native-<uid>``, made private; None where it exists and is not
    this user's alone (then each compile takes a fresh directory of its own)."""
    root = os.path.join(tempfile.gettempdir(), f"aiocompile-native-{os.getuid()}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(root)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        return None
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(root: str) -> None:
    """Remove the directories of workers that no longer run."""
    try:
        entries = os.listdir(root)
    except OSError:
        return
    for entry in entries:
        pid = entry.split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def sweep() -> None:
    """Remove what workers that no longer run left behind: a scheduler sweeps once its
    workers have exited, so that the directory of one killed for a timeout goes too."""
    root = _scratch_root()
    if root is not None:
        _sweep(root)


@contextlib.contextmanager
def scratch() -> Iterator[str]:
    """A private directory for one compile, removed afterwards."""
    root = _scratch_root()
    if root is not None:
        _sweep(root)
    prefix = f"{os.getpid()}-" if root is not None else f"aiocompile-native-{os.getpid()}-"
    path = tempfile.mkdtemp(prefix=prefix, dir=root)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class Ran:
    argv: tuple[str, ...]
    returncode: int
    output: str
    """What it printed, stdout and stderr interleaved as they came."""
    seconds: float

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


def compiler_env(cwd: str, environment: Environment) -> dict[str, str]:
    """The environment a compiler runs with in ``cwd``: this process's, with
    ``environment`` applied and what must not pass on dropped."""
    env = dict(os.environ)
    for name in DROPPED:
        env.pop(name, None)
    for name, value in environment:
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    # C locale: plain quotes and English words in diagnostics, whatever the worker's
    # locale, so that they read (and match) the same everywhere.
    env.update(TMPDIR=cwd, LC_ALL="C")
    return env


def run(argv: Sequence[str], cwd: str, environment: Environment = ()) -> Ran:
    """Run a compiler command in ``cwd`` and wait for it."""
    started = time.perf_counter()
    proc = subprocess.run(list(argv), cwd=cwd, env=compiler_env(cwd, environment), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    return Ran(tuple(argv), proc.returncode, proc.stdout.decode("utf-8", errors="replace"), seconds)


def failure(ran: Ran, *, name: str, key: str | None, target: str | None, how: str | None = None,
            tool: str | None = None) -> CompileError:
    """The ``CompileError`` for a compiler command that failed: its diagnostics (the first
    lines in the message, more in ``output``) and its command line. ``how`` says what went
    wrong where its exit status does not (it exited 0 without writing its output);
    ``tool`` names the compiler where its file name alone does not (hipcc, with the HIP and
    Clang versions under it)."""
    tool = tool or os.path.basename(ran.argv[0])
    how = how or _ending(ran.returncode)
    diagnostics = ran.output.strip()
    lines = diagnostics.splitlines()
    shown = "\n".join(line if len(line) <= 1000 else line[:1000] + " ..." for line in lines[:_MESSAGE_LINES])
    if len(lines) > _MESSAGE_LINES:
        shown += f"\n... ({len(lines) - _MESSAGE_LINES} more lines in the error's output)"
    message = f"{tool} {how}:\n{shown}\ncommand: {ran.command}" if shown else f"{tool} {how}\ncommand: {ran.command}"
    return CompileError(message, kernel_name=name, key=key, target=target, output=diagnostics[:_OUTPUT_CHARS],
                        command=ran.command)


def _ending(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def output(ran: Ran, path: str, *, name: str, key: str | None, target: str | None) -> bytes:
    """What a compiler command that succeeded wrote at ``path``. One that exited 0 and
    wrote nothing there (it was asked for its ``--help``, or flags sent its output
    elsewhere: ``-Wl,-o,other``) did not compile: a ``CompileError`` with what it printed,
    rather than an error about a file in a scratch directory the caller never saw."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        pass
    wanted = os.path.basename(path)
    printed = "" if ran.output.strip() else ", and printed nothing"
    raise failure(ran, name=name, key=key, target=target,
                  how=f"exited with status {ran.returncode} without writing {wanted}{printed} (do the flags ask for "
                      "something else, or send the output elsewhere?)")


@dataclass(frozen=True)
class DependencyPass:
    """The compiler asked which headers a source reads (``-MM``), for its key."""

    argv: tuple[str, ...]
    """The compiler and the options that decide what it includes, as the compile has them."""
    source: str
    suffix: str
    """The source file's suffix, which tells the compiler its language: ``.cpp``, ``.cu``."""
    environment: Environment


def dependencies(asked: DependencyPass) -> list[str] | None:
    """The headers the compiler says ``asked.source`` reads (``-MM``: not the system's);
    None where it could not say (a source that does not preprocess: its compile will say
    why). Run in a worker, like a compile, for the same reasons: the pass preprocesses the
    caller's source, which may take as long as it likes (an include of a FIFO blocks), so it
    runs under the request's timeout, is killed with its worker when the caller goes, and
    dies with the parent."""
    with scratch() as work:
        path = os.path.join(work, f"source{asked.suffix}")
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(asked.source)
        deps = os.path.join(work, "source.d")
        try:
            ran = run((*asked.argv, "-MM", "-MF", deps, path), work, asked.environment)
        except OSError:  # the compiler went since it was asked what it is: the compile will say so
            return None
        if ran.returncode != 0:
            return None
        try:
            with open(deps, encoding="utf-8", errors="surrogateescape") as f:
                named = make_dependencies(f.read())
        except OSError:
            return None
    return [p for p in named if os.path.normpath(p) != os.path.normpath(path)]
