"""Sending a ``@triton.jit`` function to a worker process, and getting it back there.

A ``JITFunction`` does not pickle (it holds a lock, and the module attribute is the
wrapper, not the function). So a kernel travels as one of:

- :class:`ModuleRef`: module and qualified name, when the worker can import it;
- :class:`SourceBundle`: the source of the kernel and of every ``@jit`` function it calls
  that is not importable, plus the globals they read, when the kernel was defined in
  ``__main__``, a notebook cell, or anywhere else a worker cannot import from;
- :class:`SourceModule`: a whole module's text, for :class:`aiocompile.TritonSource`.

A bundled function is rebuilt so that Triton sees the very same function: same source,
same file name and same line numbers (they are part of Triton's cache key and of the
binary's line info), same ``@jit`` options. So the key Triton computes in the worker
equals the one it computes in the parent, and its disk cache is shared by both.

Nothing here imports Triton at module level; the parent side runs only with a
``JITFunction`` in hand, which means Triton is imported already.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import linecache
import pickle
import re
import sys
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any, Union

_KEEP = "__aiocompile_keep__"
_DEF_LINE = re.compile(r"^(\s*)def\s+\w+\s*\(")


@dataclass(frozen=True)
class ModuleRef:
    module: str
    qualname: str


@dataclass(frozen=True)
class SourceModule:
    """A module's whole text (``TritonSource``), executed in the worker under ``filename``."""

    text: str
    name: str
    filename: str


@dataclass(frozen=True)
class Unit:
    """The functions that share one ``__globals__`` dict (one module), and what they read."""

    module_name: str
    files: tuple[tuple[str, str], ...]  # (filename, text with each function at its own lines)
    # (name, the JIT class's module, its qualified name, the @jit keyword arguments)
    functions: tuple[tuple[str, str, str, tuple[tuple[str, Any], ...]], ...]
    globals: tuple[tuple[str, tuple[Any, ...]], ...]


@dataclass(frozen=True)
class SourceBundle:
    units: tuple[Unit, ...]
    entry_unit: int
    entry: str
    sources: tuple[tuple[str, str], ...] = ()
    """What ``linecache`` must hold: each file with every function placed in it, whatever
    unit it belongs to (``inspect`` finds a function by its file's lines)."""
    digest: str = field(default="", compare=False)


KernelRef = Union[ModuleRef, SourceBundle, SourceModule]


def unwrap_jit(obj: Any) -> Any:
    """The ``JITFunction`` under ``@triton.autotune`` / ``@triton.heuristics`` wrappers."""
    from triton.runtime.jit import JITFunction

    seen = 0
    while not isinstance(obj, JITFunction):
        inner = getattr(obj, "fn", None)
        if inner is None or seen > 16:
            raise TypeError(
                f"kernel must be a @triton.jit function or aiocompile.TritonSource, got {type(obj).__name__}"
            )
        obj = inner
        seen += 1
    return obj


# -- the parent's side --------------------------------------------------------------------


def _importable(module_name: str, qualname: str, obj: object) -> bool:
    """Whether a worker importing ``module_name`` finds ``obj`` at ``qualname``."""
    if module_name in ("__main__", "__mp_main__") or "<locals>" in qualname:
        return False
    module = sys.modules.get(module_name)
    if module is None or getattr(module, "__spec__", None) is None:
        return False
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if target is not obj:
        return False
    # A module loaded from a path under a made-up name is in sys.modules here, but a
    # worker importing that name would not find it (or would find a different file).
    spec = _find_spec_on_path(module_name)
    return spec is not None and getattr(spec, "origin", None) == getattr(module.__spec__, "origin", None)


def _find_spec_on_path(name: str) -> Any:
    """What a fresh interpreter's import system would find for ``name``: the meta path
    finders asked directly (``importlib.util.find_spec`` answers from ``sys.modules``)."""
    parent, _, _ = name.rpartition(".")
    path = None
    if parent:
        path = getattr(sys.modules.get(parent), "__path__", None)
        if path is None:
            return None
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, path)
        except Exception:  # noqa: BLE001 - a finder that breaks just does not find it
            continue
        if spec is not None:
            return spec
    return None


def ship(fn: Any) -> KernelRef:
    """How to send ``fn`` (a ``JITFunction``) to a worker. Raises ``ValueError`` when a
    global it reads cannot be sent."""
    if _importable(fn.__module__, fn.fn.__qualname__, _module_attr_target(fn)):
        return ModuleRef(fn.__module__, fn.fn.__qualname__)
    return _BundleBuilder().build(fn)


def _module_attr_target(fn: Any) -> Any:
    # The module attribute of an autotuned kernel is the Autotuner, not the JITFunction;
    # such a kernel is still importable: the worker unwraps it the same way.
    module = sys.modules.get(fn.__module__)
    target: Any = module
    for part in fn.fn.__qualname__.split("."):
        target = getattr(target, part, None)
    if target is not None and target is not fn:
        try:
            if unwrap_jit(target) is fn:
                return target
        except TypeError:
            pass
    return fn


def free_names(func_node: ast.FunctionDef) -> tuple[set[str], set[str]]:
    """(names the body reads that are not its own locals, names its defaults read)."""
    params = func_node.args
    local = {a.arg for a in params.posonlyargs + params.args + params.kwonlyargs}
    if params.vararg:
        local.add(params.vararg.arg)
    if params.kwarg:
        local.add(params.kwarg.arg)
    loads: set[str] = set()
    for stmt in func_node.body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name):
                if isinstance(node.ctx, ast.Load):
                    loads.add(node.id)
                else:
                    local.add(node.id)
    defaults: set[str] = set()
    for expr in [*params.defaults, *[d for d in params.kw_defaults if d is not None]]:
        defaults.update(n.id for n in ast.walk(expr) if isinstance(n, ast.Name))
    return loads - local, defaults


class _BundleBuilder:
    def __init__(self) -> None:
        self.units: dict[int, dict[str, Any]] = {}
        self.order: list[int] = []
        self.done: dict[int, tuple[int, str]] = {}

    def build(self, fn: Any) -> SourceBundle:
        unit_index, name = self.add(fn)
        placed: dict[str, list[tuple[int, list[str]]]] = {}
        units = tuple(self._freeze(self.units[gid], placed) for gid in self.order)
        sources = tuple((place, _layout(spans)) for place, spans in placed.items())
        digest = hashlib.sha256(pickle.dumps((units, unit_index, name, sources), protocol=4)).hexdigest()
        return SourceBundle(units, unit_index, name, sources, digest)

    def _unit(self, globals_dict: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        gid = id(globals_dict)
        if gid not in self.units:
            self.units[gid] = {
                "module_name": globals_dict.get("__name__", "__main__"),
                "files": {},
                "functions": [],
                "globals": {},
            }
            self.order.append(gid)
        return self.order.index(gid), self.units[gid]

    def add(self, fn: Any) -> tuple[int, str]:
        if id(fn) in self.done:
            return self.done[id(fn)]
        pyfn = fn.fn
        unit_index, unit = self._unit(fn.__globals__)
        name = pyfn.__name__
        self.done[id(fn)] = (unit_index, name)
        lines, start = list(fn.raw_src), fn.starting_line_number
        filename = pyfn.__code__.co_filename
        lines = _prepare_lines(lines, name)
        unit["files"].setdefault(filename, []).append((start, lines))
        cls = type(fn)
        unit["functions"].append((name, cls.__module__, cls.__qualname__, _jit_kwargs(fn)))

        tree = ast.parse(textwrap.dedent("".join(fn.raw_src)))
        func_node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
        body_names, default_names = free_names(func_node)
        closure = inspect.getclosurevars(pyfn).nonlocals if pyfn.__closure__ else {}
        for ref_name in sorted(body_names | default_names):
            if ref_name in unit["globals"] or ref_name == name:
                continue
            if ref_name in closure:
                value = closure[ref_name]
            elif ref_name in fn.__globals__:
                value = fn.__globals__[ref_name]
            else:
                continue  # a builtin, or undefined: Triton says which when it compiles
            unit["globals"][ref_name] = self._describe(name, ref_name, value)
        return unit_index, name

    def _describe(self, kernel: str, ref_name: str, value: Any) -> tuple[Any, ...]:
        from triton.language.core import constexpr
        from triton.runtime.jit import JITFunction

        if isinstance(value, types.ModuleType):
            if value.__name__ in ("__main__", "__mp_main__"):
                raise ValueError(
                    f"kernel {kernel!r} reads {ref_name!r}, the __main__ module, which workers cannot import"
                )
            return ("module", value.__name__)
        if isinstance(value, JITFunction):
            if _importable(value.__module__, value.fn.__qualname__, value):
                return ("object", value.__module__, value.fn.__qualname__)
            unit_index, name = self.add(value)
            return ("jit", unit_index, name)
        if isinstance(value, constexpr):
            return ("constexpr", self._picklable(kernel, ref_name, value.value))
        module_name = getattr(value, "__module__", None)
        qualname = getattr(value, "__qualname__", None)
        if isinstance(module_name, str) and isinstance(qualname, str) and _importable(module_name, qualname, value):
            return ("object", module_name, qualname)
        return ("value", self._picklable(kernel, ref_name, value))

    @staticmethod
    def _picklable(kernel: str, ref_name: str, value: Any) -> Any:
        try:
            pickle.loads(pickle.dumps(value))
        except Exception:
            raise ValueError(
                f"kernel {kernel!r} reads the global {ref_name!r} ({type(value).__name__}), which cannot be sent "
                "to a worker process; make it a tl.constexpr of a plain value, or move the kernel into an "
                "importable module"
            ) from None
        return value

    @staticmethod
    def _freeze(unit: dict[str, Any], placed: dict[str, list[tuple[int, list[str]]]]) -> Unit:
        """Freeze a unit, placing each of its functions in a file at its own lines. Two
        versions of one notebook cell (a helper redefined by running the cell again) may
        want the same lines of the same file: the later one then goes to a file of a
        derived name, which changes the line info's file name, not Triton's key."""
        own: dict[str, list[tuple[int, list[str]]]] = {}
        for filename, spans in unit["files"].items():
            for start, lines in spans:
                place, n = filename, 1
                while any(start < s + len(ls) and s < start + len(lines) for s, ls in placed.get(place, ())):
                    n += 1
                    place = f"{filename}#{n}"
                placed.setdefault(place, []).append((start, lines))
                own.setdefault(place, []).append((start, lines))
        files = [(place, _layout(spans)) for place, spans in own.items()]
        return Unit(
            module_name=unit["module_name"],
            files=tuple(files),
            functions=tuple(unit["functions"]),
            globals=tuple(sorted(unit["globals"].items())),
        )


def _layout(spans: list[tuple[int, list[str]]]) -> str:
    """A file's text with each span of lines at its line number (1-based)."""
    text: list[str] = []
    for start, lines in sorted(spans, key=lambda span: span[0]):
        text.extend("\n" for _ in range(start - 1 - len(text)))
        text.extend(lines)
    return "".join(text)


def _prepare_lines(lines: list[str], name: str) -> list[str]:
    """The function's lines with its decorators replaced by a no-op one at the same place
    (the first decorator's line is where Triton's line numbers start) and dedented."""
    lines = [line if line.endswith("\n") else line + "\n" for line in lines]
    def_index = next((i for i, line in enumerate(lines) if _DEF_LINE.match(line)), None)
    if def_index is None:
        raise ValueError(f"cannot find the definition of kernel {name!r} in its source")
    indent = _DEF_LINE.match(lines[def_index]).group(1)  # type: ignore[union-attr]
    body = [line[len(indent):] if line.startswith(indent) else line.lstrip(" \t") for line in lines[def_index:]]
    if def_index == 0:
        return body
    return [f"@{_KEEP}\n"] + ["\n"] * (def_index - 1) + body


def _jit_kwargs(fn: Any) -> tuple[tuple[str, Any], ...]:
    kwargs = []
    for attr in ("do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline"):
        if hasattr(fn, attr):
            value = getattr(fn, attr)
            if isinstance(value, list):
                value = tuple(value)
            kwargs.append((attr, value))
    return tuple(kwargs)


# -- the worker's side --------------------------------------------------------------------


class Resolver:
    """Turns a :data:`KernelRef` back into a ``JITFunction``, once per distinct ref."""

    def __init__(self) -> None:
        self._cache: dict[Any, Any] = {}

    def resolve(self, ref: KernelRef) -> Any:
        cache_key = ref.digest if isinstance(ref, SourceBundle) else ref
        fn = self._cache.get(cache_key)
        if fn is None:
            fn = unwrap_jit(self._resolve(ref))
            self._cache[cache_key] = fn
        return fn

    def _resolve(self, ref: KernelRef) -> Any:
        if isinstance(ref, ModuleRef):
            target: Any = importlib.import_module(ref.module)
            for part in ref.qualname.split("."):
                target = getattr(target, part)
            return target
        if isinstance(ref, SourceModule):
            return exec_source_module(ref)
        return _rebuild_bundle(ref)


def _register_source(filename: str, text: str) -> None:
    # inspect.getsourcelines(), which Triton calls on every @jit function, reads here.
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)


def exec_source_module(ref: SourceModule) -> Any:
    """Execute a ``TritonSource``'s text as a module (once per text) and return the named object."""
    module_name = "aiocompile_source_" + hashlib.sha256(ref.text.encode()).hexdigest()[:16]
    module = sys.modules.get(module_name)
    if module is None:
        _register_source(ref.filename, ref.text)
        module = types.ModuleType(module_name)
        module.__file__ = ref.filename
        sys.modules[module_name] = module
        try:
            exec(compile(ref.text, ref.filename, "exec"), module.__dict__)
        except BaseException:
            del sys.modules[module_name]
            raise
    try:
        return getattr(module, ref.name)
    except AttributeError:
        raise NameError(f"the TritonSource defines no {ref.name!r}") from None


def _rebuild_bundle(bundle: SourceBundle) -> Any:
    import triton.language as tl

    namespaces = [{"__name__": unit.module_name, "__builtins__": __builtins__, _KEEP: lambda f: f}
                  for unit in bundle.units]
    for filename, text in bundle.sources:
        _register_source(filename, text)
    for unit, ns in zip(bundle.units, namespaces):
        for filename, text in unit.files:
            exec(compile(text, filename, "exec"), ns)
    for unit, ns in zip(bundle.units, namespaces):
        for name, cls_module, cls_qualname, kwargs in unit.functions:
            cls: Any = importlib.import_module(cls_module)
            for part in cls_qualname.split("."):
                cls = getattr(cls, part)
            accepted = inspect.signature(cls.__init__).parameters
            ns[name] = cls(ns[name], **{k: (list(v) if isinstance(v, tuple) else v)
                                        for k, v in kwargs if k in accepted})
    for unit, ns in zip(bundle.units, namespaces):
        for ref_name, desc in unit.globals:
            kind = desc[0]
            if kind == "module":
                ns[ref_name] = importlib.import_module(desc[1])
            elif kind == "object":
                target: Any = importlib.import_module(desc[1])
                for part in desc[2].split("."):
                    target = getattr(target, part)
                ns[ref_name] = target
            elif kind == "jit":
                ns[ref_name] = namespaces[desc[1]][desc[2]]
            elif kind == "constexpr":
                ns[ref_name] = tl.constexpr(desc[1])
            else:
                ns[ref_name] = desc[1]
    return namespaces[bundle.entry_unit][bundle.entry]
