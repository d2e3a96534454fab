"""The exceptions aiocompile raises, all under one root, each saying whose fault it is.

::

    AiocompileError                 anything aiocompile raises on its own account
     ├── JobError                   a job did not give its result
     │    ├── CompileError          the compiler said no (the kernel's fault), with its message
     │    │    ├── AutotuneError    no configuration of an autotuned kernel could be used
     │    │    └── CompilerNotFound the compiler is not installed (the machine's fault);
     │    │                         also a FileNotFoundError
     │    ├── JobTimeout            it ran past its timeout and its worker was killed;
     │    │                         also a TimeoutError
     │    └── WorkerCrashed         it killed its worker max_crashes times
     └── SchedulerClosed            the scheduler was used after aclose() (the program's fault)

A timeout or a crash is not a compile error: code that catches ``CompileError`` to show a
user the compiler's message does not catch a job that hung or a worker that died. Catch
``JobError`` for "this job gave no result, whatever the reason".

Bad input (a malformed signature, an unknown target, a wrong option type) is not in this
tree: it raises ``ValueError`` or ``TypeError`` in the caller, at once, before any worker
is involved. A job run with ``Scheduler.run`` that raises re-raises its own exception in
the caller, with the worker's traceback attached as ``__cause__``.

Every class pickles, so an error raised in one process can be re-raised in another.
``CompileTimeout`` and ``WorkerCrashedError`` are the old names of ``JobTimeout`` and
``WorkerCrashed``; they still work, with a ``DeprecationWarning``, for one release.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = [
    "AiocompileError",
    "AutotuneError",
    "CompileError",
    "CompilerNotFound",
    "JobError",
    "JobTimeout",
    "RemoteTraceback",
    "SchedulerClosed",
    "WorkerCrashed",
]


class AiocompileError(Exception):
    """Root of every error aiocompile raises on its own account; each subclass says
    whose fault it is (the kernel's, the program's, the machine's), so callers can tell
    "your kernel failed" from "aiocompile could not do its job"."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle as ``cls(*self.args)``, which loses keyword-only fields; rebuild
        # from the instance dict instead so that every field survives the trip between
        # processes.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class JobError(AiocompileError):
    """A job did not give its result: the compiler refused it (``CompileError``), it ran
    too long (``JobTimeout``), or it killed its workers (``WorkerCrashed``). Whose fault:
    the job's; no other job was touched.

    ``message`` says what happened, ``kernel_name`` and ``key`` which job, ``target`` which
    architecture (where it compiled for one), ``output`` the tail of what the job printed.
    ``repro`` is the directory of the repro bundle written for this failure (see
    ``SchedulerConfig.repro_dir``), or None. ``subject`` says what ``kernel_name`` names in
    the message: a ``"kernel"``, or the ``"function"`` of a ``run()``.
    """

    repro: str | None = None
    subject: str = "kernel"

    def __init__(
        self,
        message: str,
        *,
        kernel_name: str | None = None,
        key: str | None = None,
        target: str | None = None,
        output: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kernel_name = kernel_name
        self.key = key
        self.target = target
        self.output = output

    def __str__(self) -> str:
        where = []
        if self.kernel_name:
            where.append(f"{self.subject} {self.kernel_name!r}")
        if self.target:
            where.append(f"target {self.target}")
        head = f"{', '.join(where)}: " if where else ""
        tail = f" (repro bundle: {self.repro})" if self.repro else ""
        return f"{head}{self.message}{tail}"


class CompileError(JobError):
    """The kernel did not compile. Whose fault: the kernel's (or the compiler's).

    ``message`` is the compiler's own message. ``command`` is the command line that
    failed, where the compile ran a compiler program (C++, CUDA); None otherwise.
    """

    def __init__(self, message: str, *, command: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.command = command


class JobTimeout(JobError, TimeoutError):
    """The job did not finish within its timeout (``timeout`` seconds of worker time).
    Whose fault: the job's, or a timeout too short for it. The worker that ran it was
    killed, with every process it started, and replaced; no other job was touched.
    """

    def __init__(self, message: str, *, timeout: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.timeout = timeout


class WorkerCrashed(JobError):
    """The job killed its worker process ``attempts`` times (a segfault in the compiler,
    an OOM kill, ``os._exit``), each time on a fresh worker. Whose fault: the job's; the
    jobs that ran beside it were not affected.

    ``exitcode`` is the worker's exit status (negative for a signal, as in
    ``subprocess``), ``signal_name`` the signal's name where there was one, and
    ``output`` the tail of what the worker printed before it died.
    """

    def __init__(self, message: str, *, exitcode: int | None = None, attempts: int = 0, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.exitcode = exitcode
        self.attempts = attempts

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        import signal

        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return None


class AutotuneError(CompileError):
    """No configuration of an autotuned kernel could be used: each one failed to compile,
    or failed, faulted, crashed or hung when it was timed. Whose fault: the kernel's (or
    its configurations'); the benchmark processes that timed them were replaced as need
    be, and nothing else was touched.

    ``failures`` holds ``(configuration, reason)`` for each, and the message lists them.
    """

    def __init__(self, message: str, *, failures: tuple[tuple[str, str], ...] = (), **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.failures = tuple(failures)


class CompilerNotFound(CompileError, FileNotFoundError):
    """The compiler a request needs (g++, nvcc, hipcc) is not where it was looked for, or
    does not run. Whose fault: the machine's set-up (install it, put it on PATH, set
    ``CUDA_HOME``) or the ``compiler=`` argument's. Raised in the caller before any worker
    is involved; the message says where it looked.
    """


class SchedulerClosed(AiocompileError, RuntimeError):
    """The scheduler was closed (``aclose()``, interpreter exit, or it belongs to the
    parent of a forked process) before or while this request was served. Whose fault:
    the program's.
    """


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of a re-raised error."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\nTraceback in the worker process:\n{self.tb}"


# The names of an earlier release, kept for one more.
_RENAMED = {"CompileTimeout": "JobTimeout", "WorkerCrashedError": "WorkerCrashed"}


def renamed(name: str) -> Any:
    """The class an old name stands for, with a ``DeprecationWarning``; ``AttributeError``
    for a name that never was one."""
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module 'aiocompile.errors' has no attribute {name!r}")
    warnings.warn(f"aiocompile.{name} is now aiocompile.{new}; the old name goes in the next release",
                  DeprecationWarning, stacklevel=3)
    return globals()[new]


def __getattr__(name: str) -> Any:
    return renamed(name)
