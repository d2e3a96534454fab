"""The Python-wrapper form of a background compile: what ``torch.compile`` runs on a GPU,
built in a worker and run in the serving process.

A GPU model's AOTInductor package has a C++ wrapper, and building it is most of what a
package costs there: more than stock ``torch.compile``'s whole first call. Stock
``torch.compile`` writes its wrapper in Python, and so does this form:

- **in the worker** (:func:`build`): the exported program's graph, its weights lifted as
  inputs, goes through Inductor's precompilation path (``standalone_compile(aot=True)``:
  AOTAutograd and Inductor, its Triton kernels compiled in Inductor's pool), and comes
  back as bytes: the wrapper's code, its kernels' binaries and their tuned launch
  settings. A :class:`Plan` says what each of the graph's inputs is: a weight of the model
  by name, a constant made during tracing, or a leaf of the call's arguments;
- **here** (:func:`load`): the bytes are loaded (the wrapper's code imported, the
  kernels' binaries loaded) into a :class:`GraphRunner` that, at each call, puts the
  serving model's own weights (no copy: weights changed in place are used as they are)
  beside the call's argument leaves, and gives the outputs back in the model's
  structure. :func:`prepare` imports what the load needs beforehand, while the worker
  compiles: the imports are most of the load's CPU, and made by the load they would hold
  the interpreter lock in pieces long enough to show in the eager calls' latency.

An update in place (a buffer's ``add_``) stays in the exported graph, and AOTAutograd
applies it to the tensor bound there: the serving model's own buffer. A program that
returns a buffer's or an input's new value instead (a functionalised one), or takes
inputs other than weights, constants and argument leaves, has no plan (:func:`plan_of`
answers None), and a worker
whose environment turns Inductor's caches off cannot save the artifact
(:func:`unavailable` says why): the worker builds a package instead, and says why.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The serving process's side of a load, imported ahead (prepare()).
LOAD_MODULES = (
    "torch._inductor.standalone_compile", "torch._inductor.codecache", "torch._inductor.output_code",
    "torch._inductor.async_compile", "torch._inductor.compile_fx", "torch._inductor.runtime.triton_heuristics",
    "torch._functorch._aot_autograd.aot_autograd_result", "torch._dynamo.aot_compile_types", "triton",
)


@dataclass(frozen=True)
class Plan:
    """Where each input of the compiled graph comes from, in the graph's order: ``("weight",
    name)`` a parameter or buffer of the model, ``("constant", name)`` a tensor made during
    tracing (its value comes with the artifact), ``("input", i)`` the i-th leaf of the
    call's ``(args, kwargs)``, keywords in name order."""

    inputs: tuple[tuple[str, Any], ...]
    out_spec: str
    """The outputs' structure (``torch.utils._pytree.treespec_dumps``)."""

    @property
    def constants(self) -> tuple[str, ...]:
        return tuple(name for kind, name in self.inputs if kind == "constant")


def plan_of(program: Any) -> Plan | None:
    """The plan of an exported program, or None when its graph is not one this form runs
    (it returns a buffer's or an input's new value, or takes an input of another kind)."""
    from torch.export.graph_signature import InputKind, OutputKind
    from torch.utils import _pytree as pytree

    signature = program.graph_signature
    if any(spec.kind != OutputKind.USER_OUTPUT for spec in signature.output_specs):
        return None
    inputs: list[tuple[str, Any]] = []
    leaf = 0
    for spec in signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            inputs.append(("weight", spec.target))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            inputs.append(("constant", spec.target))
        elif spec.kind == InputKind.USER_INPUT:
            inputs.append(("input", leaf))
            leaf += 1
        else:
            return None
    return Plan(inputs=tuple(inputs), out_spec=pytree.treespec_dumps(program.call_spec.out_spec))


def unavailable() -> str | None:
    """Why this process cannot make the Python form's artifact, or None when it can: the
    artifact is made of Inductor's and AOTAutograd's cache entries, and the environment
    variables that turn those caches off are read once, when torch is imported, and win
    over any setting made later."""
    import inspect

    import torch

    standalone = getattr(torch._inductor, "standalone_compile", None)
    if standalone is None or "aot" not in inspect.signature(standalone).parameters:
        return f"this torch ({torch.__version__}) has no standalone_compile(aot=True), which makes the Python form"
    if torch.compiler.config.force_disable_caches:
        return ("the Python form is made of Inductor's cache entries, and TORCHINDUCTOR_FORCE_DISABLE_CACHES "
                "turns them off")
    if not torch._inductor.config.fx_graph_cache:
        return ("the Python form is made of Inductor's FX graph cache entries, and TORCHINDUCTOR_FX_GRAPH_CACHE=0 "
                "turns that cache off")
    if not torch._functorch.config.enable_autograd_cache:
        return ("the Python form is made of AOTAutograd's cache entries, and TORCHINDUCTOR_AUTOGRAD_CACHE=0 "
                "turns that cache off")
    if torch._inductor.config.freezing:
        return "the Python form cannot be made with Inductor's freezing on"
    return None


def build(program: Any, plan: Plan, args: tuple[Any, ...], kwargs: dict[str, Any],
          configs: dict[str, Any]) -> tuple[bytes, Any, dict[str, Any]]:
    """Compile the program's graph with Inductor (in a worker); returns the artifact's
    bytes, the compiled function (for the trial) and the constants it needs."""
    import torch
    from torch._inductor import config

    state = {**dict(program.state_dict), **dict(program.constants)}
    constants = {name: state[name] for name in plan.constants}
    example = flat_inputs(plan, lambda kind, name: state[name], args, kwargs)
    with config.patch(configs), torch.no_grad():
        compiled = torch._inductor.standalone_compile(program.graph_module, example,
                                                      dynamic_shapes="from_example_inputs", aot=True)
    fd, path = tempfile.mkstemp(prefix="aiocompile-graph-")
    os.close(fd)
    try:
        compiled.save(path=path, format="binary")
        with open(path, "rb") as f:
            artifact = f.read()
    finally:
        os.unlink(path)
    return artifact, compiled, constants


def flat_inputs(plan: Plan, tensor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The graph's inputs for one call: ``tensor(kind, name)`` for weights and constants,
    the call's leaves (keywords in name order) for the rest."""
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_leaves((tuple(args), dict(sorted(kwargs.items()))))
    return [leaves[where] if kind == "input" else tensor(kind, where) for kind, where in plan.inputs]


class GraphRunner:
    """The compiled graph with the serving model's weights bound: called as the model is."""

    def __init__(self, fn: Any, plan: Plan, tensors: dict[str, Any]) -> None:
        from torch.utils import _pytree as pytree

        self._fn = fn
        self._pytree = pytree
        self._out_spec = pytree.treespec_loads(plan.out_spec)
        # Each input slot: a bound tensor, or the index of the call's leaf.
        self._slots = [(None, where) if kind == "input" else (tensors[where], -1) for kind, where in plan.inputs]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            kwargs = dict(sorted(kwargs.items()))
        leaves = self._pytree.tree_leaves((args, kwargs))
        outputs = self._fn(*[tensor if where < 0 else leaves[where] for tensor, where in self._slots])
        return self._pytree.tree_unflatten(list(outputs), self._out_spec)


def load(artifact: bytes, plan: Plan, tensors: dict[str, Any],
         codes: Mapping[bytes, bytes] | None = None) -> GraphRunner:
    """The artifact loaded here (its kernels' binaries too), bound to ``tensors``: every
    weight and constant the plan names. ``codes``: its modules' code, compiled in the
    worker (:mod:`.graph_code`), run rather than compiling their source here."""
    from torch._inductor import config
    from torch._inductor.standalone_compile import AOTCompiledArtifact

    from aiocompile._torch import graph_code

    fd, path = tempfile.mkstemp(prefix="aiocompile-graph-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(artifact)
        # The wrapper's code hands each kernel to Inductor's compiler, which finds its
        # binary; with more than one compile thread it would first start Inductor's
        # process pool here (a subprocess, and its workers) for binaries already built.
        with config.patch(compile_threads=1), graph_code.used(codes or {}):
            compiled = AOTCompiledArtifact.load(path=path, format="binary")  # checks the torch build it was made by
    finally:
        os.unlink(path)
    return GraphRunner(compiled, plan, tensors)


def prepare(isa_check: Callable[[], Any] | None = None, before_rest: Callable[[], bool] | None = None) -> None:
    """Import what a load needs and make Triton's backend hash (building its driver's
    launcher module), so that the load itself has little left to do here.

    With ``isa_check`` (for a model on the CPU, whose kernels' cache keys hold the answer of
    Inductor's vector-ISA check): it starts the check (an :class:`.isa.Check`) as soon as
    what the check imports is imported, so that its test programs are built while the
    rest is imported, and the check is made before this returns; ``before_rest`` is called
    (and may wait) between the check's start and the rest of the imports, which are made
    only if it returns True.

    The code Inductor's modules generate as they are imported (kernel templates,
    dataclasses' methods, its operators' handlers) is read as a worker compiled it
    (:mod:`aiocompile._base.generated`): each compile here would hold the lock throughout."""
    from aiocompile._base import generated

    generated.install()
    with generated.reading():
        rest = _import_for_load(isa_check, before_rest)
    generated.flush()
    if not rest:
        return
    from torch.utils._triton import has_triton

    if has_triton():
        from torch.utils._triton import triton_hash_with_backend

        triton_hash_with_backend()
    from torch._inductor.codecache import torch_key

    torch_key()


def _import_for_load(isa_check: Callable[[], Any] | None, before_rest: Callable[[], bool] | None) -> bool:
    import importlib

    from aiocompile._torch import cia

    check = None
    try:
        if isa_check is not None:
            # One of them walks torch's CompositeImplicitAutograd operators once per
            # namespace of torch.ops, each walk milliseconds of C calls that cannot stand
            # aside (``cia``).
            with cia.in_pieces():
                importlib.import_module("torch._inductor.codecache")  # what the check's own code imports
            try:
                check = isa_check()
            except Exception:  # noqa: BLE001 - the load makes the check itself, as without this
                check = None
            if before_rest is not None and not before_rest():
                return False
        with cia.in_pieces():
            for name in LOAD_MODULES:
                importlib.import_module(name)
        return True
    finally:
        if check is not None:
            check.finish()
