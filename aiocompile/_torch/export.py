"""What a worker does for a background compile: the whole of it, out of the serving process.

:func:`build_package` gets the model (a :class:`~._parcel.Parcel`) and the inputs of one
call, and goes through four stages, each timed:

1. ``load``: the model unpickled, the inputs read;
2. ``export``: ``torch.export.export`` traces the model for exactly these inputs;
3. ``compile``, in the job's ``form``:

   - ``"package"``: AOTInductor lowers and compiles the program into a ``.pt2`` package,
     without the weights (``aot_inductor.package_constants_in_so=False``): the serving
     process binds its own; with Inductor's default C++ compiler, unless that one has no
     shared C++ library (:mod:`._cxx`: its packages do not load beside torch);
   - ``"python"``: Inductor compiles the program's graph, weights lifted as inputs, into
     its Python wrapper and kernels (:mod:`._graph`), as ``torch.compile`` does; a program
     that form cannot run gets a package instead (``form_reason`` says why);

4. ``trial``: the package is loaded here (or the compiled graph called), given this copy's
   weights, and run once on the inputs beside the model itself; what comes back says how
   far apart they were. A package that cannot load or run fails here, in a worker, not
   in the server.

It returns the form built and its bytes, the constants made during tracing, the stage
times, the largest difference from eager and, for a package, the C++ compiler. A stage
that raises fails the job with a ``CompileError`` naming the stage, after writing a repro
bundle (its ``repro``); the original exception is its ``__cause__``.

Nothing here imports torch at module level (the parent names these functions for free).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Any

from aiocompile._torch import aoti, cxx, graph, graph_code, isa
from aiocompile._torch.job import ENV_PREFIXES, PACKAGE_CONFIGS, ExportJob
from aiocompile._torch.parcel import unpack
from aiocompile.errors import CompileError

_logger = logging.getLogger("aiocompile")

STAGES = ("load", "export", "compile", "trial")

# What a compile imports beyond what Inductor's own fork-server preload imports: seconds,
# paid once in the fork server (``prepare_fork_server``) rather than by each worker.
_MODULES = ("torch", "torch.export", "torch._export", "torch._inductor.compile_fx", "torch._inductor.package")

PRELOAD = "aiocompile._torch.export:prepare_fork_server"
"""The fork-server preload entry of the schedulers ``compile_in_background`` makes for
models on the CPU (after Inductor's own, ``aiocompile.torch.PRELOAD``; ``warming`` says why
not for a GPU)."""


PRELOAD_IMPORTS = "aiocompile._torch.export:import_in_fork_server"
"""The same, less the vector-ISA check: for a fork server whose serving process makes that
check from the start (``warming``), whose workers' compiles find its test programs built or
being built, and only load each. The check's builds take seconds (one ``cc1plus``), and a
fork server that waited for them held back the first compile, whose lowering and export
come before it needs the answer."""


def import_in_fork_server() -> None:
    """Preload hook: import what a background compile needs, once, in the fork server
    (:func:`prepare_fork_server` without the check); its workers' checks find the test
    programs the serving process loaded remembered (``isa.remember_loads``)."""
    _import_modules([])
    isa.remember_loads()


def prepare_fork_server() -> None:
    """Preload hook: import what a background compile needs, once, in the fork server, so
    that every worker forked from it starts with it (each worker importing it itself made
    the first compile wait for its worker's imports, two workers competing for the CPUs);
    and make Inductor's CPU vector-ISA check meanwhile (:class:`.isa.Check`: its test
    programs built while the rest is imported), so that no worker makes it.

    The fork server must be single-threaded when it forks: the check's threads are joined
    before this returns, and an import that starts a thread of its own stops the imports
    there, reported as a preload problem (workers import the rest in their warm-up)."""
    check: isa.Check | None = None
    if os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") is None:
        try:
            check = isa.Check()
        except Exception as exc:  # noqa: BLE001 - the compiles make the check themselves, as without this
            _logger.debug("Inductor's vector-ISA check could not be started ahead: %s: %s", type(exc).__name__, exc)
    try:
        _import_modules(check.threads if check is not None else [])
    finally:
        if check is not None:
            check.finish()


def _import_modules(ours: list[threading.Thread]) -> None:
    """Import ``_MODULES``; one that starts a thread (not one of ``ours``) stops them there."""
    import importlib
    import sys

    for name in _MODULES:
        if name in sys.modules:
            continue
        before = _threads(ours)
        importlib.import_module(name)
        after = _threads(ours)
        if before is not None and after is not None and after > before:
            raise RuntimeError(f"importing {name} started {after - before} thread(s) in the fork server; "
                               "workers import the rest themselves")


def _threads(ours: list[threading.Thread]) -> int | None:
    """This process's threads but ``ours`` (the check's, which come and go meanwhile)."""
    try:
        tasks = set(os.listdir("/proc/self/task"))
    except OSError:
        return None
    return len(tasks - {str(thread.native_id) for thread in ours})


def warm_up(device: str = "cpu", form: str = "package", ahead: bool = False,
            libraries: tuple[str, ...] = ()) -> float:
    """Import what a background compile needs in this worker (nothing, when the fork
    server preloaded it: ``prepare_fork_server``). Returns the seconds it took (about 0
    when done before).

    With ``ahead`` (``warm()``: a server paying its start-up before it takes traffic), the
    rest of a first compile's start-up too: for a GPU, Inductor's compile pool started and
    waited for, and a one-layer model compiled there in the Python form (Inductor's code
    generators imported, CUDA and Triton's driver ready); for the CPU, Inductor's
    vector-ISA check and a one-layer model's package generated, its sources only (what a
    first compile alone pays, about a second: Inductor's pattern passes set up, its code
    generators imported). Without it (a wrapper that made its own scheduler: its first
    compile is waiting), the compile makes them as it goes rather than queue behind them:
    a GPU compile's job starts the pool (``_start_inductor_pool``), and a worker forked
    from a fork server that made the CPU check (``prepare_fork_server``) has its answer
    already. ``form`` is kept for the callers.

    ``libraries``: modules of model classes the serving process has loaded from installed
    libraries (``warming.library_modules``), imported here as a model's unpacking would
    (transformers' GPT-2: 1.7 s of a first job on a GPU host). One that fails to import is
    left to the job that needs it, which reports the error."""
    import importlib
    import sys

    del form
    started = time.perf_counter()
    for name in _MODULES:
        if name not in sys.modules:
            importlib.import_module(name)
    for name in libraries:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the job that unpacks a model of it reports it
                pass
    if ahead and device == "cuda" and device not in _warmed:
        _start_inductor_pool()
        _warm_cuda()
        _warmed.add(device)
    if ahead and device == "cpu" and device not in _warmed:
        _warm_cpu()
        _warmed.add(device)
    return time.perf_counter() - started


_warmed: set[str] = set()


def _start_inductor_pool() -> None:
    """Start Inductor's compile pool in this worker, once. Inductor compiles a graph's
    Triton kernels in its process pool only once the pool is ready, and one by one in this
    process until then; torch.compile starts it when Dynamo hands a GPU graph over,
    standalone_compile and AOTInductor never do. Started by a GPU compile's job (or by
    ``warm()``'s warm-up), not by every worker's warm-up: a pool is as many processes as
    the machine has CPUs, and four of them starting at once, in workers that had no job
    yet, left the one compile that did a fraction of the CPUs."""
    if "cuda-pool" in _warmed:
        return
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.warm_pool()
    _warmed.add("cuda-pool")


def _warm_cuda() -> None:
    import torch
    from torch._inductor.async_compile import AsyncCompile

    if not torch.cuda.is_available():
        return
    AsyncCompile.wait_pool_ready(timeout=300)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).cuda().eval()
    example = torch.randn(4, 8, device="cuda")
    with torch.no_grad():
        program = torch.export.export(model, (example,))
    plan = graph.plan_of(program)
    if plan is not None:
        graph.build(program, plan, (example,), {}, {})


def _warm_cpu() -> None:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    with torch.no_grad():
        program = torch.export.export(model, (torch.randn(4, 8),))
    workdir = tempfile.mkdtemp(prefix="aiocompile-warm-")
    try:
        # Its sources only (no C++ build, 1 s rather than 5 s): what a first compile pays
        # once per process, the vector-ISA check's answer included, is all on the way there.
        _compile_package({"aot_inductor.package_cpp_only": True}, program, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _apply_env(env: dict[str, str]) -> None:
    for name in [name for name in os.environ if name.startswith(ENV_PREFIXES) and name not in env]:
        del os.environ[name]
    os.environ.update(env)


def build_package(job: ExportJob) -> dict[str, Any]:
    """Export, compile and try the model for one call's inputs (see the module docstring)."""
    _apply_env(job.env)
    import torch

    if job.device_index >= 0:
        # The model's GPU is this worker's current one for the whole job: what Inductor
        # does on "the current device" (its autotuning's timings, a synchronize, Triton's
        # driver) then happens there, and no other GPU gets a context of this worker's.
        torch.cuda.set_device(job.device_index)
        _start_inductor_pool()
    stage = STAGES[0]
    times: dict[str, float] = {}
    model: Any = None
    program: Any = None
    compiler: str | None = None
    form = job.form
    started = time.time()
    workdir = tempfile.mkdtemp(prefix="aiocompile-export-")
    try:
        clock = time.perf_counter()
        model = unpack(job.parcel)
        args, kwargs = torch.load(io.BytesIO(job.inputs), weights_only=False)
        kwargs = dict(sorted(kwargs.items()))  # as the Python form's runner orders them
        times[stage] = time.perf_counter() - clock

        stage, clock = "export", time.perf_counter()
        program = torch.export.export(model, tuple(args), kwargs)
        times[stage] = time.perf_counter() - clock

        stage, clock = "compile", time.perf_counter()
        plan, form_reason = None, None
        if form == "python":
            form_reason = graph.unavailable()
            if form_reason is None:
                plan = graph.plan_of(program)
                if plan is None:
                    form_reason = ("the program returns a buffer's or an input's new value, or takes an input "
                                   "the Python form does not bind")
        if plan is None:
            form = "package"
            compiler, path = _compile_package(job.inductor_configs, program, workdir)
        else:
            loaded_before = graph_code.mark()
            artifact, compiled, extra = graph.build(program, plan, tuple(args), kwargs, job.inductor_configs)
        times[stage] = time.perf_counter() - clock

        stage, clock = "trial", time.perf_counter()
        own = model_tensors(model)
        if plan is None:
            names, extra, got = _try_package(path, job.device_index, program, own, args, kwargs)
            with open(path, "rb") as f:
                built: dict[str, Any] = {"package": f.read(), "constants": names}
        else:
            # (A model in training mode is never called there: nothing to compare.)
            buffers = {} if model.training else {name: buffer.clone() for name, buffer in model.named_buffers()}
            versions = {name: parameter._version for name, parameter in model.named_parameters()}
            with torch.no_grad():  # called as the serving process will call it
                got = graph.GraphRunner(compiled, plan, {**own, **extra})(*args, **kwargs)
            # Whether a call leaves the model as it was: then the serving process may make
            # one before it switches (``loading.first_call``).
            harmless = not model.training \
                and all(torch.equal(buffers[name], buffer) for name, buffer in model.named_buffers()) \
                and all(versions[name] == parameter._version for name, parameter in model.named_parameters())
            # The code of the modules the compile and the call loaded (the wrapper's, the
            # kernels'), for the serving process's load to run rather than compile.
            built = {"artifact": artifact, "plan": plan, "harmless_call": harmless,
                     "codes": graph_code.collect(loaded_before)}
        with torch.no_grad():
            expected = model(*args, **kwargs)
        difference = max_abs_difference(got, expected)
        times[stage] = time.perf_counter() - clock
        constants = io.BytesIO()
        torch.save({name: value.detach().cpu() for name, value in extra.items()}, constants)
    except Exception as exc:
        message = f"{stage} failed: {type(exc).__name__}: {_first_lines(exc)}"
        if stage == "trial" and form == "package":
            message += f" (the package was built by the C++ compiler {compiler})"
        error = CompileError(message, kernel_name=job.name, target=_target(job))
        if job.repro is not None:
            from aiocompile._torch import bundles

            try:
                built_as = job if form == job.form else dataclasses.replace(job, form=form)
                error.repro = bundles.background_failure(built_as, stage, exc, model=model, program=program,
                                                          since=started)
            except Exception as bundle_error:  # noqa: BLE001 - the compile's error is the one to report
                error.output = f"the repro bundle could not be written: {bundle_error}"
        raise error from exc
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        **built,
        "form": form,
        "form_reason": form_reason,
        "extra_constants": constants.getvalue(),
        "stages": times,
        "max_abs_difference": difference,
        "compiler": compiler,
    }


def _compile_package(inductor_configs: dict[str, Any], program: Any, workdir: str) -> tuple[str, str]:
    """AOTInductor's package of the program, built with a C++ compiler whose library loads
    beside torch's (:mod:`._cxx`); returns the compiler, described, and the package's path."""
    import torch

    path = os.path.join(workdir, "model.pt2")
    configs = {**inductor_configs, **PACKAGE_CONFIGS}
    if "cpp.cxx" in configs:
        compiler = repr(configs["cpp.cxx"])
    else:  # Inductor's default, unless its C++ library cannot be loaded beside torch's
        choice = cxx.choose()
        compiler = choice.describe()
        if choice.replaced is not None:
            configs["cpp.cxx"] = (None, choice.cxx)
    torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=configs)
    return compiler, path


def _try_package(path: str, device_index: int, program: Any, own: dict[str, Any], args: Any,
                 kwargs: dict[str, Any]) -> tuple[list[str], dict[str, Any], Any]:
    """Load the package here, give it this copy's weights and run it once: the names of the
    constants it needs, the values of those the model does not hold, and its output."""
    import torch

    runner = aoti.load(path, device_index)  # as the serving process will load it
    names = runner.get_constant_fqns()
    found = {**dict(program.state_dict), **dict(program.constants)}
    extra = {}
    for name in names:
        if name not in own:
            if name not in found:
                raise RuntimeError(f"the package needs a constant {name!r} that neither the model nor the "
                                   "exported program holds")
            extra[name] = found[name]
    runner.load_constants({**{n: own[n] for n in names if n in own}, **extra}, check_full_update=True)
    with torch.no_grad():
        return names, extra, runner(*args, **kwargs)


def model_tensors(model: Any) -> dict[str, Any]:
    """Every parameter and buffer of a module by its qualified name, shared ones under
    each of their names (a package may ask for any of them)."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


def max_abs_difference(got: Any, expected: Any) -> float | None:
    """The largest absolute difference between two outputs' tensors, leaf by leaf; None
    when they do not have the same structure or hold no floating tensors."""
    import torch
    from torch.utils import _pytree as pytree

    got_leaves, got_spec = pytree.tree_flatten(got)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    if got_spec != expected_spec:
        return None
    worst: float | None = None
    for a, b in zip(got_leaves, expected_leaves):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            if a is not b and not (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)) and a != b:
                return None
            continue
        if a.numel() == 0:
            continue
        difference = (a.detach().double() - b.detach().double()).abs().max().item()
        worst = difference if worst is None else max(worst, difference)
    return worst


def _target(job: ExportJob) -> str:
    return "cpu" if job.device_index < 0 else f"cuda:{job.device_index}"


def _first_lines(exc: BaseException, limit: int = 2000) -> str:
    text = str(exc).strip()
    return text if len(text) <= limit else text[:limit] + " ..."
