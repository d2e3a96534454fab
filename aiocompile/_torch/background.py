"""Compiling a model in the background while it serves eagerly.

``compile_in_background(model)`` returns a :class:`BackgroundCompiled`: a callable that
answers every call at once, eagerly until a compiled version for the call's signature
(shapes, strides, dtypes, devices, plain values, ``training``) is ready, compiled from then
on. The switch is an assignment between calls, so no call fails or waits for it; a call
that would record autograd history is always answered eagerly.

The compile never runs here: tracing and lowering hold the interpreter lock for seconds,
and ``torch.export`` beside eager calls trips over the fake-tensor mode's state. Here, in a
lane's thread, the model is packed (``parcel``); in a worker, ``export.build_package``
exports, compiles (``graph`` for the Python form, or a package) and tries it; here again,
in a thread, the result is loaded and bound to this process's own weights, without a copy
(``loading``).

Each signature's life is a small state machine (``states.TRANSITIONS``): ``compiling``,
then ``compiled`` or ``failed``; ``compiled`` becomes ``failed`` if the compiled version
ever raises. Inputs that cannot be keyed are ``eager``. docs/torch.md tells users the rest.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

# checks with this module (the program's line), not by a constructor in the caller's loop.
from aiocompile._base import aside, bridge, checks, collector, threads
from aiocompile._torch import ahead, choices, loading, warming
from aiocompile._torch.eager_threads import EagerThreads
from aiocompile._torch.eager_threads import check as check_eager_threads
from aiocompile._torch.packed import PackedModel
from aiocompile._torch.states import TRANSITIONS, BackgroundStatus, ShapeStatus, _Entry, describe
from aiocompile.errors import CompileError, JobTimeout, SchedulerClosed, WorkerCrashed

if TYPE_CHECKING:
    # Imported where they are needed: ``aiocompile.torch.compile_in_background`` is looked
    # up in a server's event loop, where what the constructor needs is imported; the
    # scheduler's stack is for the thread that makes one, what a compile's submission and
    # load need for the lane's threads that do them.
    from aiocompile._core.scheduler import Scheduler
    from aiocompile._torch.job import ExportJob

__all__ = ["TRANSITIONS", "BackgroundCompiled", "BackgroundStatus", "ShapeStatus", "compile_in_background"]

# Packing the model and loading packages: a lane of its own, so that a large model being
# pickled never delays a kernel load.
_LANE = threads.Lane("aiocompile-background", 2)


class BackgroundCompiled:
    """A model that answers every call at once: eagerly, or compiled where a compiled
    version for the call's inputs is ready. Made by :func:`compile_in_background`.

    Calling it is thread-safe. ``ready(*inputs)`` compiles ahead of traffic;
    ``status()`` says where every signature stands; ``close()`` (or ``aclose()``) closes
    the scheduler it made for itself, if it did.
    """

    def __init__(self, model: Any, *, mode: str | None, options: Mapping[str, Any],
                 scheduler: cf.Future[Scheduler], owns_scheduler: bool, strict: bool, timeout: float | None,
                 disabled: bool, max_signatures: int = 8, artifact: str = "auto",
                 prepared: str | None = None, eager_threads: int | str | None = "auto") -> None:
        import torch

        self._model = model
        self._torch = torch
        self._tensor = torch.Tensor
        self._mode = mode
        self._options = dict(options)
        self._configs: dict[str, Any] | None = None  # the mode's settings, made by the first compile
        self._scheduler = scheduler
        self._owns_scheduler = owns_scheduler
        self._strict = strict
        self._timeout = timeout
        self._disabled = disabled
        self._max_signatures = max_signatures
        self._artifact = artifact
        self._prepared = prepared  # the form whose load is made ahead since construction
        self._name = type(model).__qualname__
        self._lock = threading.Lock()
        self._entries: dict[Any, _Entry] = {}
        self._unkeyed_calls = 0
        self._needs_grad: bool | None = None
        self._packed = PackedModel(model)
        self._closing: cf.Future[None] | None = None
        device = choices.model_device(model)
        self._gpu = device == "cuda"
        self._eager = EagerThreads(torch, eager_threads, device)

    @property
    def model(self) -> Any:
        """The eager model."""
        return self._model

    @property
    def scheduler(self) -> Scheduler:
        """Where the compiles run. One this object makes for itself is made in a thread
        from the constructor on: this waits for it (a fraction of a second at most, once)."""
        return self._scheduler.result()

    # -- calls -----------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # aiocompile's own threads in this process (the load's imports, the packing, the
        # load) stand aside while the call runs (``aside.serve_begin``), and on a GPU until
        # its kernels are done: the caller's wait for them then takes the interpreter lock
        # back at once, not from one of those threads.
        aside.serve_begin()
        until = None
        try:
            out = self._answer(args, kwargs)
            if self._gpu and aside.busy():
                until = self._kernels_done()
            return out
        finally:
            aside.serve_end(until)

    def _kernels_done(self) -> Any:
        """A CUDA event recorded after the call's kernels, on the calling thread's current
        stream; waiting for it sleeps rather than spins (``blocking``). None where it
        cannot be made."""
        try:
            event = self._torch.cuda.Event(blocking=True)
            event.record()
        except Exception:  # noqa: BLE001 - the call's end is then not put off
            return None
        return event

    def _answer(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = self._key(args, kwargs)
        if key is None:
            self._unkeyed_calls += 1
            return self._eager.call(self._model, args, kwargs)
        entry = self._entries.get(key)
        if entry is None:
            # A signature met for the first time: this call is answered first, and only
            # then is its compile started (whose packing would compete with the call).
            starts = not self._disabled and len(self._entries) < self._max_signatures
            out = self._eager.call(self._model, args, kwargs, starts=starts)
            entry = self._begin(key, args, kwargs)
            if entry is None:
                self._unkeyed_calls += 1
            else:
                entry.eager_calls += 1
            return out
        runner = entry.runner
        if runner is not None and entry.primes:
            # What the compiled version's first call would make in this thread, one piece
            # per call, this call answered eagerly (``thread_plans``).
            out = self._eager.call(self._model, args, kwargs)
            entry.eager_calls += 1
            entry.primes.make_one()
            return out
        if runner is not None and not self._records_grad(args, kwargs):
            try:
                out = runner(*args, **kwargs)
            except Exception as exc:
                # The compiled version is broken for good; this call, and every later
                # one, is answered eagerly.
                self._broken(entry, exc)
            else:
                entry.compiled_calls += 1
                return out
        entry.eager_calls += 1
        return self._eager.call(self._model, args, kwargs)

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """The call's signature as a dict key, or None when an input is neither a plain
        tensor nor a plain value (such calls are answered eagerly, uncompiled)."""
        parts: list[Any] = [self._model.training]
        for value in args:
            part = self._leaf(value)
            if part is None:
                return None
            parts.append(part)
        for name in sorted(kwargs):
            part = self._leaf(kwargs[name])
            if part is None:
                return None
            parts.append((name, part))
        return tuple(parts)

    def _leaf(self, value: Any) -> Any:
        if type(value) is self._tensor:
            return (tuple(value.shape), value.stride(), value.dtype, value.device)
        if value is None or type(value) in (bool, int, float, str):
            return (type(value), value)
        if type(value) in (tuple, list):
            parts = [self._leaf(item) for item in value]
            return None if any(part is None for part in parts) else (type(value), tuple(parts))
        if type(value) is dict and all(type(name) is str for name in value):
            parts = [(name, self._leaf(value[name])) for name in sorted(value)]
            return None if any(part is None for _, part in parts) else (dict, tuple(parts))
        return None

    def _records_grad(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        torch = self._torch
        if not torch.is_grad_enabled():
            return False
        if self._needs_grad is None:
            self._needs_grad = any(p.requires_grad for p in self._model.parameters())
        if self._needs_grad:
            return True
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves)

    # -- compiles ---------------------------------------------------------------------------------

    def _begin(self, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Entry | None:
        """The entry of a signature met for the first time, its compile started; None
        once ``max_signatures`` signatures have been met (served eagerly, never
        compiled: a model called with ever new shapes must not start a compile a call)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry
            if len(self._entries) >= self._max_signatures:
                return None
            entry = _Entry(describe(args, kwargs))
            self._entries[key] = entry
        if self._disabled:
            entry.state = "eager"
            entry.error = RuntimeError("disable=True: compiling is switched off")
            entry.done.set_result(None)
            return entry
        self._eager.began(entry.done)
        # Packing copies every weight: in a thread, never in the caller's.
        _LANE.submit(lambda: self._submit(entry, args, kwargs))
        return entry

    def _submit(self, entry: _Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Pack the model and the inputs and hand the compile to the scheduler (in a
        lane's thread). Begun right after a call, beside the calls that follow: all of it,
        not only the packing, hands the interpreter lock over often and stands aside
        while a call is served (``threads.handing_over``). At the interpreter's own switch
        interval, each operator of a call made meanwhile could wait 5 ms for the lock."""
        with threads.handing_over():
            self._hand_over(entry, args, kwargs)

    def _hand_over(self, entry: _Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        from aiocompile._observe import repro as _repro
        from aiocompile._torch import export
        from aiocompile._torch.job import ENV_PREFIXES, ExportJob
        from aiocompile.backends import Request

        torch = self._torch
        try:
            scheduler = self._scheduler.result()
        except BaseException as exc:
            self._fail(entry, exc)
            return
        try:
            parcel = self._packed.take()
        except Exception as exc:
            error = CompileError(f"the model cannot be compiled in a worker: {exc}", kernel_name=self._name)
            error.__cause__ = exc
            self._fail(entry, error)
            return
        try:
            inputs = io.BytesIO()
            torch.save((tuple(args), dict(kwargs)), inputs)
            device_index = _device_index(torch, args, kwargs)
            form = choices.form_for(self._artifact)
            job = ExportJob(
                name=self._name, signature=entry.text, parcel=parcel, inputs=inputs.getvalue(),
                inductor_configs=self._inductor_configs(), device_index=device_index,
                env={name: value for name, value in os.environ.items() if name.startswith(ENV_PREFIXES)},
                repro=_repro.root_of(scheduler.config), form=form,
            )
            request = Request(
                backend="aoti", key=None, name=f"{self._name}({entry.text})",
                target="cpu" if device_index < 0 else f"cuda:{device_index}",
                fn=export.build_package, args=(job,), finish=_identity, details=_details,
            )
            answer = scheduler.port.execute_sync(request, self._timeout)
        except BaseException as exc:
            self._packed.release()
            self._fail(entry, exc)
            return
        answer.add_done_callback(lambda done: _LANE.submit(lambda: self._finish(entry, job, done)))
        if form != self._prepared:
            # Inputs on another device than the model's: what this form's load needs,
            # made while the worker compiles.
            ahead.start(form, "cpu" if device_index < 0 else "cuda")

    def _inductor_configs(self) -> dict[str, Any]:
        """Inductor's settings for the compiles (in a lane's thread: a mode's settings are
        Inductor's to say, and importing Inductor takes seconds)."""
        if self._configs is None:
            with collector.imports_settled(), threads.imports_yielding():
                self._configs = choices.inductor_configs(self._torch, self._mode, self._options)
        return dict(self._configs)

    def _finish(self, entry: _Entry, job: ExportJob, done: cf.Future[Any]) -> None:
        """Load what the worker built and switch the signature to it (in a lane's
        thread), or record why there is none. Whatever goes wrong here fails the
        signature: nothing is left compiling for ever."""
        self._packed.release()
        try:
            self._settle(entry, job, done)
        except BaseException as exc:
            self._fail(entry, exc)
            raise

    def _settle(self, entry: _Entry, job: ExportJob, done: cf.Future[Any]) -> None:
        exc = done.exception()
        if exc is not None:
            if isinstance(exc, (WorkerCrashed, JobTimeout)) and exc.repro is None \
                    and job.repro is not None:
                # The worker could not write a bundle: it was gone.
                from aiocompile._torch import bundles

                try:
                    exc.repro = bundles.background_crash(job, exc)
                except Exception as bundle_error:  # noqa: BLE001 - the compile's error is the one to keep
                    exc.output = f"{exc.output}\nthe repro bundle could not be written: {bundle_error}".strip()
            self._fail(entry, exc)
            return
        answer = done.result()
        entry.stages = tuple(answer["stages"].items())
        entry.difference = answer["max_abs_difference"]
        entry.compiler = answer.get("compiler")
        entry.form = answer["form"]
        entry.form_reason = answer.get("form_reason")
        try:
            primes: list[Any] = []
            with collector.imports_settled(), threads.imports_yielding():
                runner, constants = loading.load(self._model, answer, job.device_index, self._timeout)
                if answer.get("harmless_call"):
                    primes = loading.first_call(runner, job.inputs)
        except Exception as load_error:
            self._fail(entry, self._load_failure(job, load_error))
            return
        with self._lock:
            entry.primes.extend(primes)
            entry.runner, entry.constants = runner, constants
            entry.move("compiled")

    def _load_failure(self, job: ExportJob, exc: Exception) -> CompileError:
        error = CompileError(f"loading the compiled package here failed: {type(exc).__name__}: {exc}",
                             kernel_name=self._name)
        error.__cause__ = exc
        if job.repro is not None:
            from aiocompile._torch import bundles

            try:
                error.repro = bundles.background_failure(job, "load here", exc)
            except Exception:  # noqa: BLE001
                pass
        return error

    def _fail(self, entry: _Entry, exc: BaseException) -> None:
        with self._lock:
            entry.move("failed", exc)

    def _broken(self, entry: _Entry, exc: BaseException) -> None:
        error = CompileError(f"the compiled version raised at a call, and is no longer used: "
                             f"{type(exc).__name__}: {exc}", kernel_name=self._name)
        with self._lock:
            if entry.move("failed", error):
                entry.runner = None

    # -- the public side --------------------------------------------------------------------------

    async def ready(self, *args: Any, **kwargs: Any) -> ShapeStatus:
        """Compile for these example inputs, if not done or under way, and wait until the
        compiled version is in use (or the compile failed). Returns the signature's status.

        A compile that fails, crashes its worker or times out leaves the signature
        eager; with ``strict=True`` this raises its error instead (a ``JobError``:
        ``CompileError``, ``JobTimeout`` or ``WorkerCrashed``; its ``repro`` names its
        bundle). Inputs that cannot be keyed (not plain
        tensors or plain values) are served eagerly: ``strict`` raises ``CompileError``.

        Cancelling the await does not stop the compile: calls with these inputs switch to
        the compiled version when it is ready, as they would have.
        """
        key = self._key(args, kwargs)
        entry = None if key is None else self._entries.get(key) or self._begin(key, args, kwargs)
        if entry is None:
            if key is None:
                status = ShapeStatus(signature="(inputs that are not plain tensors or values)", state="eager",
                                     error="the inputs cannot be keyed: a tensor subclass or an unsupported type")
            else:
                status = ShapeStatus(signature=describe(args, kwargs), state="eager",
                                     error=f"max_signatures={self._max_signatures} signatures are compiled or "
                                           "compiling already: these inputs are served eagerly")
            if self._strict:
                raise CompileError(status.error or "", kernel_name=self._name)
            return status
        await bridge.wait(entry.done)
        if entry.state == "failed" and self._strict and entry.error is not None:
            raise entry.error
        return entry.snapshot()

    def state(self, *args: Any, **kwargs: Any) -> str | None:
        """The state of these inputs' signature (``compiling``, ``compiled``, ``failed``,
        ``eager``), or None when no call has met it yet; ``eager`` for inputs that cannot
        be keyed, or met beyond ``max_signatures``. Starts nothing."""
        key = self._key(args, kwargs)
        if key is None:
            return "eager"
        entry = self._entries.get(key)
        if entry is None:
            return "eager" if len(self._entries) >= self._max_signatures else None
        return entry.state

    def status(self) -> BackgroundStatus:
        """Where every signature met so far stands (a frozen snapshot)."""
        with self._lock:
            shapes = tuple(entry.snapshot() for entry in self._entries.values())
        return BackgroundStatus(model=self._name, shapes=shapes, eager_calls=self._unkeyed_calls)

    def close(self) -> None:
        """Close the scheduler this object made for itself (none when one was given).
        Calls still work afterwards, eagerly for signatures not compiled yet. Called in
        an event loop's thread, it returns at once: the workers' exits are waited for in
        a thread of the background lane (``aclose()`` waits for them), not by the loop.
        That thread is one already started: starting one made the loop wait for it to
        start (12 ms on 2 busy CPUs)."""
        if not self._owns_scheduler:
            return
        try:
            bridge.current_library()
        except RuntimeError:  # no event loop here: wait for the exits
            self._close_scheduler()
            return
        # The lane's threads are not daemons: the interpreter's exit waits for the
        # workers to be gone.
        with self._lock:
            if self._closing is None:
                self._closing = _LANE.submit(self._close_scheduler)

    def _close_scheduler(self) -> None:
        try:
            scheduler = self._scheduler.result()
        except BaseException:  # noqa: BLE001 - none was made: nothing to close
            return
        scheduler.close()

    async def aclose(self) -> None:
        if self._owns_scheduler:
            try:
                scheduler = await bridge.wait(self._scheduler)
            except Exception:  # noqa: BLE001 - none was made: nothing to close
                return
            await scheduler.aclose()
            closing = self._closing
            if closing is not None:
                await bridge.wait(closing)

    def __repr__(self) -> str:
        status = self.status()
        return (f"<BackgroundCompiled {self._name}: {len(status.compiled)} compiled, "
                f"{len(status.compiling)} compiling, {len(status.failed)} failed>")


def _identity(answer: Any) -> Any:
    return answer


def _details(answer: Mapping[str, Any]) -> dict[str, Any]:
    return {"stages": tuple((str(stage), float(seconds)) for stage, seconds in answer.get("stages", {}).items()),
            "compiler_cache_hit": None}


def _device_index(torch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    devices = {leaf.device for leaf in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(leaf, torch.Tensor)}
    cuda = [device for device in devices if device.type == "cuda"]
    if not cuda:
        return -1
    if len(devices) > 1:
        raise ValueError(f"the inputs are on several devices ({', '.join(sorted(map(str, devices)))})")
    return cuda[0].index if cuda[0].index is not None else torch.cuda.current_device()


# -- the entry point -------------------------------------------------------------------------------


def compile_in_background(
    model: Any,
    *,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    backend: str = "inductor",
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
    disable: bool = False,
    scheduler: Scheduler | None = None,
    strict: bool = False,
    timeout: float | None = None,
    max_signatures: int = 8,
    artifact: str = "auto",
    eager_threads: int | str | None = "auto",
) -> BackgroundCompiled:
    """``model`` (a ``torch.nn.Module``), answering every call at once: eagerly until a
    compiled version for the call's inputs (their shapes, strides, dtypes, devices) is
    ready, compiled from then on, switched between calls so that no call fails or waits.

    The keyword arguments before ``scheduler`` are ``torch.compile``'s: ``mode`` (None,
    ``"default"``, ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``), ``options``
    (Inductor settings, checked against those Inductor has), ``backend``
    (``"inductor"``), ``fullgraph`` (the compile always takes the whole graph),
    ``dynamic`` (None or False: each signature has its own compile), ``disable``
    (every call eager). Any other keyword raises ``TypeError`` at once, a value that
    cannot be honoured ``ValueError``. Then aiocompile's own:

    - ``scheduler``: where compiles run (default: ``aiocompile.torch.install()``'s
      scheduler if installed, else the one ``aiocompile.torch.warm()`` made, else a new
      one from the environment, at most 4 workers, started at once with torch and the
      compile's modules imported, which ``close()`` closes);
    - ``timeout``: seconds one compile may take in its worker (None: the scheduler's);
    - ``strict``: ``ready()`` raises the error of a compile that failed (a ``JobError``)
      rather than returning the failed status;
    - ``max_signatures``: how many input signatures are compiled at most (8, as
      ``torch.compile`` recompiles at most 8 times); calls with further signatures are
      answered eagerly, and start nothing;
    - ``artifact``: what the worker builds. ``"package"``: an AOTInductor package (a C++
      wrapper, loaded with a ``dlopen``); ``"python"``: Inductor's Python wrapper and
      kernels, as ``torch.compile`` runs them (a program it cannot run gets a package
      all the same, ``ShapeStatus.form_reason`` says why); ``"auto"`` (default): the
      Python form, on a GPU (where a package's C++ build costs several times the whole
      compile) and on the CPU (where it costs the compile about three times), its load's
      imports made in a thread that stands aside for the calls (``docs/torch.md``);
    - ``eager_threads``: torch's intra-op threads an eager call gets while one of the
      model's compiles runs (the calling thread's count is put back after each call).
      ``"auto"`` (default): for a model on the CPU whose calling thread would run as many
      threads as the process has CPUs, one fewer (at least one): between calls those
      threads spin, and would leave the compile, which runs behind them, no CPU. A number:
      at most that many. None: torch's count, always.

    The whole compile (``torch.export``, Inductor's lowering and compile, a trial
    run) happens in a worker process; this process only packs the model, loads the
    compiled version and binds it to its own weights, in threads. A model that cannot be exported
    or compiled, a worker that crashes, a compile that times out: the signature stays
    eager, its error (and its repro bundle's directory) in ``status()``.
    """
    torch = _torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("fullgraph", fullgraph), ("disable", disable), ("strict", strict)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"dynamic must be True, False or None, got {dynamic!r} ({type(dynamic).__name__})")
    if dynamic:
        raise ValueError("dynamic=True is not supported: each input signature is compiled for its own shapes")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be 'inductor', got {backend!r} ({type(backend).__name__})")
    if backend != "inductor":
        raise ValueError(f"backend must be 'inductor' (the compile is Inductor's), got {backend!r}")
    if mode is not None and not isinstance(mode, str):
        raise TypeError(f"mode must be a str or None, got {mode!r} ({type(mode).__name__})")
    if mode not in choices.MODES:
        shown = ", ".join(repr(m) for m in choices.MODES)
        raise ValueError(f"mode must be one of {shown}, got {mode!r}" + (
            " (CUDA graphs are not applied to the compiled version)" if mode == "reduce-overhead" else ""))
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict of Inductor settings or None, got {type(options).__name__}")
    if options and mode not in (None, "default"):
        raise ValueError("give mode or options, not both (as torch.compile)")
    if scheduler is not None:
        from aiocompile._core.scheduler import Scheduler  # imported already by whoever made one

    if scheduler is not None and not isinstance(scheduler, Scheduler):
        raise TypeError(f"scheduler must be an aiocompile.Scheduler or None, got {type(scheduler).__name__}")
    if scheduler is not None and scheduler.closed:
        raise SchedulerClosed("the scheduler is closed: pass an open one, or None for one of aiocompile's")
    checks.CALL_TIMEOUT.check("timeout", timeout)
    checks.Number(integer=True, at_least=1).check("max_signatures", max_signatures)
    if not isinstance(artifact, str):
        raise TypeError(f"artifact must be a str, got {artifact!r} ({type(artifact).__name__})")
    if artifact not in choices.ARTIFACTS:
        raise ValueError(f"artifact must be one of {', '.join(map(repr, choices.ARTIFACTS))}, got {artifact!r}")
    check_eager_threads(eager_threads)
    if options:
        choices.check_options(options)
    owned = False
    device = choices.model_device(model)
    form = choices.form_for(artifact)
    # What loading the compiled version will need here is made ahead (a server wraps its
    # model at start-up), not beside the first compile's eager calls: the Python form's
    # imports hold the interpreter lock for seconds. For a scheduler of its own, once it is
    # made (the imports, competing for the lock, made its making a second slower) and, but
    # for a CPU model whose installation has their bytecode, a worker has imported the same
    # modules (``warming.scheduler_for``).
    if scheduler is None:
        # Its thread starts the lane's first thread before it makes the scheduler (which
        # imports the pool's modules): a first call made meanwhile hands its packing to that
        # thread rather than starting one and waiting for it (7.5 ms on 2 busy CPUs).
        chosen, owned = warming.scheduler_for(device, form, prepare_load=not disable, first=_LANE.prestart)
    else:
        chosen = cf.Future()
        chosen.set_result(scheduler)
        if not disable:
            ahead.start(form, device)
    return BackgroundCompiled(model, mode=mode, options=dict(options or {}), scheduler=chosen, owns_scheduler=owned,
                              strict=strict, timeout=timeout, disabled=disable, max_signatures=max_signatures,
                              artifact=artifact, prepared=None if disable else form, eager_threads=eager_threads)


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ImportError(f"compile_in_background needs PyTorch (pip install 'aiocompile[torch]'): {exc}") from exc
    return torch
