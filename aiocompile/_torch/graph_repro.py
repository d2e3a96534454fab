"""Repro bundles for an Inductor error of ``torch.compile`` under ``aiocompile.torch.install()``.

A kernel that does not compile in the pool gets its bundle where its error comes back
(``bundles.kernel_failure``). Inductor can also fail in this process, before any kernel
reaches the pool: a lowering it lacks, a C++ compiler that does not work, a kernel of
another kind. Those errors pass through ``wrap_compiler_debug`` of
``torch._inductor.compile_fx``, the debug wrapper PyTorch puts around every graph Inductor
compiles (its minifier hooks there). While installed, that name is wrapped once more: a
graph whose compile raises gets a ``graph`` bundle, with the post-AOTAutograd FX graph as it
was handed to Inductor (``graph.py``), its inputs' shapes, dtypes and strides
(``inputs.txt``), and ``repro.py`` written by PyTorch's own ``save_graph_repro`` (the
graph, its inputs and every Inductor setting that differs from the default, compiled
again alone). The exception keeps its type; it carries the directory as ``repro`` and as
a note in its traceback.

``patch()`` returns what ``unpatch()`` needs to put back exactly what was there.
"""

from __future__ import annotations

import copy
import functools
import io
from typing import Any, Callable

from aiocompile._observe.repro import ReproRoot

_MARK = "_aiocompile_original"


def patch(root: Callable[[], ReproRoot | None]) -> Any:
    """Wrap ``torch._inductor.compile_fx.wrap_compiler_debug``; ``root()`` says, at each
    failure, where bundles go (None: nowhere). Returns the original, for ``unpatch``."""
    from torch._inductor import compile_fx

    original = compile_fx.wrap_compiler_debug
    compile_fx.wrap_compiler_debug = _wrapped(original, root)
    return original


def unpatch(original: Any) -> bool:
    """Put ``original`` back, unless someone else replaced the wrapper meanwhile (then
    it is left, and False returned)."""
    from torch._inductor import compile_fx

    if id(getattr(compile_fx.wrap_compiler_debug, _MARK, None)) != id(original):
        return False
    compile_fx.wrap_compiler_debug = original
    return True


def _wrapped(original: Any, root: Callable[[], ReproRoot | None]) -> Any:
    def wrap_compiler_debug(unconfigured_compiler_fn: Any, compiler_name: str) -> Any:
        inner = original(unconfigured_compiler_fn, compiler_name)

        @functools.wraps(inner)
        def compile_graph(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
            # The compile rewrites the graph in place: keep it as it came, for the bundle.
            graph = copy.deepcopy(gm.graph)
            try:
                return inner(gm, example_inputs, *args, **kwargs)
            except Exception as exc:
                _bundle(root(), exc, gm, graph, example_inputs, compiler_name)
                raise

        return compile_graph

    setattr(wrap_compiler_debug, _MARK, original)
    return wrap_compiler_debug


def _already_bundled(exc: BaseException) -> bool:
    """Whether the error, or one it was raised from, names a bundle already (a kernel's)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 16:
        if getattr(current, "repro", None):
            return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False


def _bundle(root: ReproRoot | None, exc: Exception, gm: Any, graph: Any, example_inputs: Any,
            compiler_name: str) -> None:
    if root is None or _already_bundled(exc):
        return
    import torch
    from torch._dynamo.repro.after_aot import save_graph_repro

    from aiocompile._torch.bundles import describe_inputs, error_text

    try:
        original = torch.fx.GraphModule(gm, graph)
        files: dict[str, bytes | str] = {"error.txt": error_text(exc)}
        try:
            files["graph.py"] = original.print_readable(print_output=False, include_stride=True, include_device=True)
        except Exception as error:  # noqa: BLE001 - a bundle says what it could not hold
            files["graph.py"] = f"# the graph could not be printed: {error}\n"
        try:
            files["inputs.txt"] = describe_inputs(tuple(example_inputs))
        except Exception as error:  # noqa: BLE001
            files["inputs.txt"] = f"the inputs could not be described: {error}\n"
        script = io.StringIO()
        try:
            save_graph_repro(script, original, list(example_inputs), compiler_name, command="run")
            files["repro.py"] = script.getvalue()
        except Exception as error:  # noqa: BLE001
            files["repro.py"] = f"raise SystemExit('PyTorch could not write a repro script here: {error!r}')\n"
        path = root.write("graph", f"{compiler_name}-{type(exc).__name__}", files, {
            "stage": "inductor", "error_type": type(exc).__name__, "error": str(exc), "compiler": compiler_name,
        })
    except Exception as error:  # noqa: BLE001 - the compile's error is the one to raise
        _note(exc, f"aiocompile could not write a repro bundle: {error}")
        return
    try:
        exc.repro = path  # type: ignore[attr-defined]
    except AttributeError:
        pass
    _note(exc, f"aiocompile repro bundle: {path} (python {path}/repro.py)")


def _note(exc: BaseException, text: str) -> None:
    """A note in the exception's traceback (Python 3.11 and later)."""
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(text)
