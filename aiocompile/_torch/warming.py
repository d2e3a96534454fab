"""The scheduler ``compile_in_background`` compiles in, and ``warm()``, which pays its
start-up ahead.

Without a scheduler given, a background compile goes to ``install()``'s scheduler if
installed; else to the one ``warm()`` made, if any; else to a new one of its own (closed
by its ``close()``). Each starts its workers at once, forked from a fork server that has
torch and what a compile needs imported (``export.PRELOAD``). ``warm()`` makes (or finds)
that scheduler and waits, without holding the event loop, until its workers are ready
and this process has made what loading a compiled version needs (``ahead``).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiocompile._base import bridge, collector, threads
from aiocompile._torch import ahead, choices, isa
from aiocompile._torch.installation import STATE  # here, not by a constructor in the caller's loop

if TYPE_CHECKING:
    # Imported where a scheduler is made: ``aiocompile.torch.warm`` is looked up in a
    # server's event loop, and the scheduler's stack is imported in warm()'s thread.
    from aiocompile._core.scheduler import Scheduler

__all__ = ["MAX_OWN_WORKERS", "DEVICES", "library_modules", "scheduler_for", "warm"]

MAX_OWN_WORKERS = 4
"""Workers of a scheduler ``compile_in_background`` makes, at most: one compile per input
signature, each a heavy compile of its own (Inductor compiles a package's kernels in
parallel inside its worker)."""

DEVICES = ("cpu", "cuda")


class _Warmed:
    """The scheduler ``warm()`` made, shared by every later ``compile_in_background``
    without a scheduler of its own, and the process it belongs to (a forked child makes
    its own: the parent's pool is the parent's)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.scheduler: Scheduler | None = None
        self.pid = 0

    def current(self) -> Scheduler | None:
        scheduler = self.scheduler
        if scheduler is None or self.pid != os.getpid() or scheduler.closed:
            return None
        return scheduler


_WARMED = _Warmed()


def scheduler_for(device: str = "cpu", form: str = "package", *, prepare_load: bool = True,
                  first: Callable[[], object] | None = None) -> tuple[cf.Future[Scheduler], bool]:
    """The scheduler a background compile without one goes to, as a future, and whether
    the caller owns it (then its ``close()`` closes it): ``install()``'s if installed; the
    one ``warm()`` made; else a new one, made in a thread of its own (making one imports
    the pool's modules, which would hold the caller's event loop): the environment's
    configuration, at most ``MAX_OWN_WORKERS`` workers, torch and what a compile imports
    preloaded in its fork server, and its workers started at once, each importing what a
    compile needs (``export.warm_up``; for a model on the CPU, the fork server makes
    Inductor's vector-ISA check before it forks them: :mod:`.isa`).

    ``first``: called first by the thread that makes a new scheduler (the background lane's
    first thread started there, before the caller's first call could start it itself).

    With ``prepare_load``, what loading ``form`` here needs is made ahead (:mod:`.ahead`):
    at once where the scheduler exists; for a new one, once a worker's warm-up has ended.
    Its imports are mostly the workers' own, and those have written the bytecode of the
    modules installed without any (:mod:`aiocompile._base.bytecode`), which this process
    then reads rather than compiling each module's source, holding the interpreter lock
    (on a GPU host's first start, loop stalls of 119 to 143 ms). For a model on the CPU
    where the installation has that bytecode, there is nothing to wait for, and the
    imports begin once the scheduler is made, beside its fork server's start: after the
    warm-up they took CPU time from the compile the first compiled answer waits for (on 2
    CPUs it took 7.7 s beside them, 3.8 to 4.4 s after them); past what Inductor's ISA check
    needs, they wait for the first warm-up's end, leaving the fork server's imports the
    CPUs (``ahead.start``'s ``rest_after``). On a GPU host the compile has
    CPUs to spare, and imports begun that early ran beside the first call's submission
    (GPT-2's loop held 10.1 to 11.2 ms in four of five runs, against 9.0 and 10.0 ms)."""

    found: cf.Future[Scheduler] = cf.Future()
    installation = STATE.current
    if installation is not None:
        if device == "cpu":
            isa.start_builds()  # its workers make the check in their first compile, and find them built
        found.set_result(installation.current_scheduler())
        if prepare_load:
            ahead.start(form, device)
        return found, False
    shared = _WARMED.current()
    if shared is not None:
        from aiocompile._torch import export  # imported by warm()'s thread already

        shared.port.warm_workers(export.warm_up, (device, form))  # workers that are gone: started again
        found.set_result(shared)
        if prepare_load:
            ahead.start(form, device)
        return found, False

    def make() -> Scheduler:
        if first is not None:
            first()
        # A CPU model's Python-form load makes Inductor's vector-ISA check here, begun at
        # once where the installation has the load's bytecode: then its fork server leaves
        # the check to it (``export.PRELOAD_IMPORTS``).
        early = prepare_load and device == "cpu" and form == "python" and _load_bytecode_installed()
        with collector.imports_settled(), threads.imports_yielding():
            scheduler, warming = _new_scheduler(device, form, isa_here=early)
        if prepare_load:
            if warming and not early:
                for future in warming:  # the first to end starts it (a no-op after that)
                    future.add_done_callback(lambda _: ahead.start(form, device))
            else:
                ahead.start(form, device, rest_after=warming)
        return scheduler

    # Not a daemon: an interpreter that exits meanwhile waits for it (then closes it). A
    # scheduler that cannot be made fails the compiles that need it.
    return threads.start(make, "aiocompile-start"), True


def _load_bytecode_installed() -> bool:
    """Whether the installation has the bytecode of what a load imports beside its sources
    (Inductor's ``compile_fx`` standing for the rest), where Python looks for it (a
    ``sys.pycache_prefix`` included): then a CPU model's load imports need not wait for the
    workers' (``scheduler_for``)."""
    import importlib.util
    import sys

    torch = sys.modules.get("torch")
    where = getattr(torch, "__file__", None)
    if not where:
        return False
    try:
        beside = importlib.util.cache_from_source(os.path.join(os.path.dirname(where), "_inductor", "compile_fx.py"))
    except (NotImplementedError, ValueError):
        return False
    return os.path.exists(beside)


def _new_scheduler(device: str, form: str, pay_ahead: bool = False, libraries: tuple[str, ...] = (),
                   isa_here: bool = False) -> tuple[Scheduler, list[cf.Future[Any]]]:
    """A scheduler of aiocompile's for background compiles, and its workers' warm-ups
    (``export.warm_up``; with ``pay_ahead``, the rest of a first compile's start-up too,
    ``libraries`` imported). ``isa_here``: this process makes Inductor's vector-ISA check
    from now on, and the fork server leaves it to it."""
    from aiocompile._base import bytecode
    from aiocompile._base.config import SchedulerConfig
    from aiocompile._core.scheduler import Scheduler
    from aiocompile._torch import export
    from aiocompile.backends.inductor._worker import PRELOAD, PRELOAD_PACKAGES

    # Where the installation has no bytecode, the fork server's imports find most of it
    # compiled by processes started now.
    bytecode.prepare(PRELOAD_PACKAGES)
    # For a model on the CPU, the fork server makes Inductor's vector-ISA check itself
    # (``export.prepare_fork_server``) before it forks, unless this process makes it from
    # now on (``isa_here``): then its workers' compiles find the test programs built or
    # being built (waiting on the builds' file locks only when they need the answer, after
    # the export and part of the lowering), rather than the first compile waiting for
    # them in the fork server (on 2 CPUs, its start took 1.5 to 3 s longer for them).
    config = SchedulerConfig.from_env()
    # Modules beyond Inductor's own preload only for models on the CPU: on a machine with a
    # GPU, a fork server that preloaded them forked workers that could not use it ("Cannot
    # re-initialize CUDA in forked subprocess"): importing ``compile_fx`` asks
    # ``torch.cuda.is_available()``, whose CUDA-runtime count marks every later fork, CUDA
    # itself uninitialised. Workers for a GPU import them in their warm-up. (With
    # ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` the count is NVML's and the forks could use the GPU,
    # but the driver's thread is then left in the fork server, and its imports would only
    # move there: a first compile waits for the same imports, one after another.)
    ours = (PRELOAD, export.PRELOAD_IMPORTS if isa_here else export.PRELOAD) if device == "cpu" else (PRELOAD,)
    # Nobody waits on these compiles: for a model on the CPU, whose eager calls share the
    # CPUs with them, they take only the CPU time the serving process leaves (``SCHED_IDLE``),
    # unless the environment says otherwise. Not for a GPU: there the eager calls wait for
    # the GPU the worker shares, not for a CPU, and a worker that ends holds the GPU driver
    # for a moment (an eager call on a GPU host took 36 ms while the workers exited).
    idle = choices.worker_idle(device, config.worker_idle)
    scheduler = Scheduler(config=config.with_changes(preload=(*config.preload, *ours), worker_idle=idle,
                                                     workers=min(config.workers, MAX_OWN_WORKERS)))
    return scheduler, scheduler.port.warm_workers(export.warm_up, (device, form, pay_ahead, libraries))


def _shared(device: str, form: str, libraries: tuple[str, ...]) -> tuple[Scheduler, list[Any]]:
    """The scheduler background compiles will use, made if need be, and its workers'
    warm-ups (in a thread: making a scheduler imports the pool's modules)."""
    from aiocompile._torch import export

    installation = STATE.current
    if installation is not None:
        scheduler = installation.current_scheduler()
    else:
        with _WARMED.lock:
            found = _WARMED.current()
            if found is None:
                # A server pays the start-up ahead, the first compile's included.
                found, warming = _new_scheduler(device, form, pay_ahead=True, libraries=libraries)
                _WARMED.scheduler, _WARMED.pid = found, os.getpid()
                return found, warming
        scheduler = found
    return scheduler, scheduler.port.warm_workers(export.warm_up, (device, form, True, libraries))


def library_modules() -> tuple[str, ...]:
    """The modules that define the model classes (``torch.nn.Module``'s subclasses) this
    process has loaded from installed libraries, torch's own left out: what unpacking a
    model of theirs in a worker imports. The program's own files (under the working
    directory or ``__main__``'s, outside a ``site-packages``) are left out too: a worker
    imports those only for a model of theirs, as it would without ``warm()``."""
    import sys

    import torch

    own = [os.path.realpath(os.getcwd())]
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file:
        own.append(os.path.dirname(os.path.realpath(main_file)))
    classes: set[type] = set()
    pending: list[type] = [torch.nn.Module]
    while pending:
        subclasses: list[type] = type.__subclasses__(pending.pop())
        for sub in subclasses:
            if sub not in classes:
                classes.add(sub)
                pending.append(sub)
    found = []
    for name in sorted({cls.__module__ for cls in classes if isinstance(cls.__module__, str)}):
        if name == "__main__" or name.partition(".")[0] in ("torch", "aiocompile"):
            continue
        origin = getattr(sys.modules.get(name), "__file__", None)
        if origin and _library_file(os.path.realpath(origin), own):
            found.append(name)
    return tuple(found)


def _library_file(path: str, own: list[str]) -> bool:
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return True
    return not any(path.startswith(folder + os.sep) for folder in own)


async def warm(device: str = "cpu") -> Scheduler:
    """Pay a background compile's start-up ahead, for models on ``device`` (``"cpu"`` or
    ``"cuda"``); returns the scheduler later ``compile_in_background`` calls without a
    scheduler of their own will use (``install()``'s, if installed).

    It starts that scheduler, its fork server with torch and what a compile needs imported,
    and its workers (on a GPU, each compiles a small model there, its CUDA context made),
    and makes here what loading a compiled version needs (for the CPU, Inductor's vector-ISA
    check; for a GPU, the Python form's modules); the workers import the libraries of the
    model classes loaded here by then (``library_modules``: a server that has built its
    model before it warms up has them imported once, not by its first compile). It returns
    once all of that is done.
    Nothing of it holds the event loop: torch is imported and the scheduler made in a
    thread, the rest is awaited. Calling it again returns at once once done (idempotent);
    it works under asyncio and trio.

    The scheduler lives until the process exits (or ``aclose()`` on it); a
    ``BackgroundCompiled`` that uses it does not close it. Cancelling the await leaves the
    start-up going on. A worker that cannot start raises the error its warm-up met.
    """
    if not isinstance(device, str):
        raise TypeError(f"device must be 'cpu' or 'cuda', got {device!r} ({type(device).__name__})")
    if device not in DEVICES:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    form = "python"

    def start() -> tuple[Scheduler, list[Any]]:
        with collector.imports_settled(), threads.imports_yielding():
            import torch  # noqa: F401 - seconds of import, here in a thread rather than the loop

            ahead.start(form, device)
            return _shared(device, form, library_modules())

    # A thread of aiocompile's rather than anyio's: its first moment is without the GIL,
    # so the loop's thread is not kept waiting for it (threads.start).
    scheduler, warming = await bridge.wait(threads.start(start, "aiocompile-warm", daemon=True))
    for future in warming:
        await bridge.wait(future)
    # On its future: no thread waits, and a cancelled await leaves the work going on.
    made = ahead.finished(form)
    if made is not None:
        await bridge.wait(made)
    return scheduler
