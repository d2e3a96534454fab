"""The repro bundles of PyTorch compiles (see ``aiocompile._observe.repro`` for the directory itself).

Two kinds:

- ``background``: a compile of ``aiocompile.torch.compile_in_background`` that failed.
  Written by the worker when a stage raised (it holds the model, the exported program and
  the generated sources), or by the parent when the worker died or ran out of time (it
  holds the model and the inputs). The bundle carries the model (``model.pkl``; classes of
  the program's ``__main__`` in it by value, never its script; its storages' bytes, the
  pickle's out-of-band buffers, in ``weights.bin``), the inputs
  (``inputs.pt``, described in ``inputs.txt``), the exported FX graph's code
  (``graph.py``) when export got that far, the sources Inductor generated meanwhile
  (``kernels/``), the Inductor settings, and ``repro.py``, which exports, compiles, loads
  and runs the model as the worker did, every step in its own process;
- ``kernel``: a Triton kernel of ``torch.compile`` under ``aiocompile.torch.install()``
  that did not compile, or killed its workers. The bundle carries the kernel's source
  (``kernel.py``), the FX graph being compiled when Inductor asked for the kernel
  (``graph.py``) and its inputs, and ``repro.py``, which compiles that one kernel as
  Inductor's compile worker does.

Every bundle has ``error.txt`` (the error and the traceback) and ``bundle.json`` (what,
when, versions, environment). The scripts need torch (and Triton for kernels), not
aiocompile.
"""

from __future__ import annotations

import ast
import os
import sys
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiocompile._observe.repro import ReproRoot

if TYPE_CHECKING:
    from aiocompile._torch.job import ExportJob

# Generated sources collected from Inductor's cache directory, at most.
_SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".hpp", ".cu", ".ttir", ".ttgir", ".llir", ".ptx", ".json")
_SOURCE_FILES = 64
_SOURCE_BYTES = 8 * 1024 * 1024


def error_text(exc: BaseException) -> str:
    """The error with its whole chain of tracebacks (a worker's included, as cause)."""
    return "".join(traceback.format_exception(exc))


def describe_inputs(args: Any, kwargs: Any = None) -> str:
    """One line per input leaf: where it sits, shape, dtype, strides, device."""
    import torch
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_flatten_with_path((tuple(args), dict(kwargs or {})))[0]
    lines = []
    for path, leaf in leaves:
        where = pytree.keystr(path)
        if isinstance(leaf, torch.Tensor):
            lines.append(f"{where}: {describe_tensor(leaf)}")
        else:
            lines.append(f"{where}: {type(leaf).__name__} {leaf!r}")
    return "\n".join(lines) + "\n"


def describe_tensor(tensor: Any) -> str:
    shape = ", ".join(str(s) for s in tensor.shape)
    try:
        stride = ", ".join(str(s) for s in tensor.stride())
    except (RuntimeError, NotImplementedError):  # sparse and other layouts have none
        stride = "?"
    extra = " requires_grad" if getattr(tensor, "requires_grad", False) else ""
    return f"{str(tensor.dtype).replace('torch.', '')}[{shape}] stride ({stride}) {tensor.device}{extra}"


def configs_literal(configs: Mapping[str, Any]) -> str:
    """The settings as a Python literal for a script; a value that is no literal is left
    out, with a comment saying so."""
    kept, dropped = {}, []
    for name, value in configs.items():
        try:
            ast.literal_eval(repr(value))
        except (ValueError, SyntaxError):
            dropped.append(name)
            continue
        kept[name] = value
    text = repr(kept)
    if dropped:
        text += f"  # not reproducible as literals, left out: {', '.join(dropped)}"
    return text


def generated_sources(since: float) -> dict[str, bytes]:
    """The sources Inductor wrote into its cache directory since ``since`` (a
    ``time.time()``), at most ``_SOURCE_FILES`` files and ``_SOURCE_BYTES`` bytes, newest
    first, under their path in that directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = cache_dir()
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            if not name.endswith(_SOURCE_SUFFIXES):
                continue
            path = os.path.join(directory, name)
            try:
                modified = os.stat(path).st_mtime
            except OSError:
                continue
            if modified >= since - 1:
                found.append((modified, path))
    found.sort(reverse=True)
    files: dict[str, bytes] = {}
    total = 0
    for _, path in found[:_SOURCE_FILES]:
        try:
            with open(path, "rb") as f:
                data = f.read(_SOURCE_BYTES - total + 1)
        except OSError:
            continue
        if total + len(data) > _SOURCE_BYTES:
            break
        total += len(data)
        files[os.path.join("kernels", os.path.relpath(path, root))] = data
    return files


# -- background compiles ---------------------------------------------------------------------------


def background_failure(job: ExportJob, stage: str, exc: BaseException, *, model: Any = None, program: Any = None,
                       since: float | None = None) -> str:
    """Write the bundle of a failed background compile; returns its directory."""
    import torch

    assert job.repro is not None
    files: dict[str, bytes | str] = {
        "error.txt": error_text(exc),
        "model.pkl": job.parcel.data,
        "weights.bin": b"".join(job.parcel.weights),
        "inputs.pt": job.inputs,
        "repro.py": background_script(job, stage, type(exc).__name__),
    }
    try:
        import io

        args, kwargs = torch.load(io.BytesIO(job.inputs), weights_only=False)
        files["inputs.txt"] = describe_inputs(args, kwargs)
    except Exception as error:  # noqa: BLE001 - a bundle says what it could not hold
        files["inputs.txt"] = f"the inputs could not be read back: {error}\n"
    if model is not None:
        files["model.txt"] = f"{type(model).__module__}.{type(model).__qualname__}\n\n{model!r}\n"
    if program is not None:
        try:
            files["graph.py"] = program.graph_module.print_readable(print_output=False, include_stride=True,
                                                                    include_device=True)
        except Exception as error:  # noqa: BLE001
            files["graph.py"] = f"# the graph could not be printed: {error}\n"
        files["program.txt"] = str(program)
    if since is not None and stage in ("compile", "trial"):
        try:
            files.update(generated_sources(since))
        except Exception:  # noqa: BLE001 - no sources is still a bundle
            pass
    info = {"stage": stage, "error_type": type(exc).__name__, "error": str(exc), "signature": job.signature,
            "inductor_configs": {k: repr(v) for k, v in job.inductor_configs.items()},
            "parcel": job.parcel.how}
    return job.repro.write("background", job.name, files, info)


def background_script(job: ExportJob, stage: str, error_type: str) -> str:
    return _BACKGROUND_SCRIPT.format(
        name=job.name, signature=job.signature, stage=stage, error_type=error_type,
        configs=configs_literal(job.inductor_configs), package_configs=repr(_package_configs()),
        device_index=job.device_index, sys_path=repr([p for p in sys.path if p]),
        form=repr(job.form), weight_sizes=repr([memoryview(weight).nbytes for weight in job.parcel.weights]),
    )


def _package_configs() -> dict[str, Any]:
    from aiocompile._torch.job import PACKAGE_CONFIGS

    return dict(PACKAGE_CONFIGS)


_BACKGROUND_SCRIPT = '''\
"""Reproduces a failed background compile of {name} for {signature}.

It failed at {stage} with {error_type} (error.txt has the whole story). This script does
what the compile worker did, each step in this process: load the model and the inputs
kept here, torch.export, Inductor's compile in the worker's form (FORM: AOTInductor's
package, or Inductor's Python wrapper through standalone_compile), and the compiled
version run beside the model. Run it with the torch the failure happened with
(bundle.json says which):

    python repro.py
"""

import os
import pickle
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# Where the compile found the model's modules: the serving program's import path.
sys.path.extend(path for path in {sys_path} if path not in sys.path)
INDUCTOR_CONFIGS = {configs}
PACKAGE_CONFIGS = {package_configs}
DEVICE_INDEX = {device_index}
FORM = {form}
# The sizes of the model's storages in weights.bin, one after another.
WEIGHT_SIZES = {weight_sizes}


def load_model():
    with open(os.path.join(HERE, "model.pkl"), "rb") as f:
        data = f.read()
    with open(os.path.join(HERE, "weights.bin"), "rb") as f:
        weights = memoryview(f.read())
    buffers, start = [], 0
    for size in WEIGHT_SIZES:
        buffers.append(weights[start:start + size])
        start += size
    # Classes of the program's __main__ came by value (cloudpickle): its script is not run.
    return pickle.loads(data, buffers=buffers)


def main():
    model = load_model()
    args, kwargs = torch.load(os.path.join(HERE, "inputs.pt"), weights_only=False)
    print("export", flush=True)
    kwargs = dict(sorted(kwargs.items()))
    program = torch.export.export(model, tuple(args), kwargs)
    print("compile", flush=True)
    if FORM == "python":
        got = python_form(program, args, kwargs)
    else:
        got = package(program, model, args, kwargs)
    with torch.no_grad():
        expected = model(*args, **kwargs)
    print("compiled output equals eager:", all(
        torch.allclose(a, b, rtol=1e-3, atol=1e-3) for a, b in zip(
            torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected))))
    print("no failure: this torch compiles the model")


def python_form(program, args, kwargs):
    """The graph, weights lifted as inputs, through Inductor's precompilation path."""
    from torch.export.graph_signature import InputKind

    state = {{**dict(program.state_dict), **dict(program.constants)}}
    leaves = iter(torch.utils._pytree.tree_leaves((tuple(args), kwargs)))
    flat = [next(leaves) if spec.kind == InputKind.USER_INPUT else state[spec.target]
            for spec in program.graph_signature.input_specs]
    with torch._inductor.config.patch(INDUCTOR_CONFIGS), torch.no_grad():
        compiled = torch._inductor.standalone_compile(program.graph_module, flat,
                                                      dynamic_shapes="from_example_inputs", aot=True)
        compiled.save(path=os.path.join(tempfile.mkdtemp(prefix="repro-"), "artifact.bin"), format="binary")
        print("trial", flush=True)
        return torch.utils._pytree.tree_unflatten(list(compiled(*flat)), program.call_spec.out_spec)


def package(program, model, args, kwargs):
    path = os.path.join(tempfile.mkdtemp(prefix="repro-"), "model.pt2")
    torch._inductor.aoti_compile_and_package(
        program, package_path=path, inductor_configs={{**INDUCTOR_CONFIGS, **PACKAGE_CONFIGS}})
    print("trial", flush=True)
    runner = torch._inductor.aoti_load_package(path, device_index=DEVICE_INDEX)
    tensors = {{**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False)),
               **dict(program.state_dict), **dict(program.constants)}}
    runner.load_constants({{name: tensors[name] for name in runner.get_constant_fqns()}}, check_full_update=True)
    with torch.no_grad():
        return runner(*args, **kwargs)


if __name__ == "__main__":
    main()
'''


def background_crash(job: ExportJob, exc: BaseException) -> str:
    """Write the bundle of a background compile whose worker died or ran out of time
    (written by the parent: the worker could not)."""
    return background_failure(job, "unknown (the worker " + ("timed out" if isinstance(exc, TimeoutError)
                                                             else "died") + ")", exc)


# -- kernels under install() -----------------------------------------------------------------------


def graph_context(async_compile_module: Any) -> tuple[Any, Any] | None:
    """What Inductor is compiling right now, as cheap references: the post-grad FX graph
    and its example inputs (None outside a graph's lowering)."""
    try:
        graph = async_compile_module.V.graph
        module = getattr(graph, "module", None)
        inputs = getattr(graph, "example_inputs", None)
    except Exception:  # noqa: BLE001 - no graph handler set: nothing to say
        return None
    if module is None:
        return None
    return module, inputs


def kernel_failure(root: ReproRoot, exc: BaseException, kernel_name: str, source_code: str,
                   context: tuple[Any, Any] | None) -> str:
    """Write the bundle of an Inductor kernel that did not compile; returns its directory."""
    from aiocompile._pool.procs import job_env
    from aiocompile.backends.inductor._backend import WORKER_ENV_NAMES

    # What the worker compiled under: the job's own variables and Inductor's.
    env = {**job_env(), **{name: os.environ[name] for name in WORKER_ENV_NAMES if name in os.environ}}
    files: dict[str, bytes | str] = {
        "error.txt": error_text(exc),
        "kernel.py": source_code,
        "repro.py": _KERNEL_SCRIPT.format(kernel_name=kernel_name, error_type=type(exc).__name__,
                                          env=repr(dict(env))),
    }
    if context is not None:
        module, inputs = context
        try:
            files["graph.py"] = module.print_readable(print_output=False, include_stride=True, include_device=True)
        except Exception as error:  # noqa: BLE001
            files["graph.py"] = f"# the graph could not be printed: {error}\n"
        if inputs is not None:
            try:
                files["inputs.txt"] = describe_inputs(tuple(inputs))
            except Exception as error:  # noqa: BLE001
                files["inputs.txt"] = f"the inputs could not be described: {error}\n"
    info = {"stage": "kernel compile", "error_type": type(exc).__name__, "error": str(exc),
            "kernel_name": kernel_name, "key": getattr(exc, "key", None), "target": getattr(exc, "target", None),
            "exitcode": getattr(exc, "exitcode", None), "attempts": getattr(exc, "attempts", None)}
    return root.write("kernel", kernel_name, files, info)


_KERNEL_SCRIPT = '''\
"""Reproduces the failed compile of the Inductor kernel {kernel_name} ({error_type}).

It compiles that one kernel, from kernel.py kept here, as Inductor's compile worker does:
load the module, then precompile every autotuning configuration through Triton. Run it
with the torch and Triton the failure happened with (bundle.json says which):

    python repro.py
"""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.update({env})  # the environment the worker compiled in

from torch._inductor.codecache import PyCodeCache  # noqa: E402

with open(os.path.join(HERE, "kernel.py")) as f:
    source = f.read()
kernel = getattr(PyCodeCache.load(source), "{kernel_name}")
kernel.precompile(warm_cache_only=True)
print("no failure: this torch and Triton compile the kernel")
'''
