"""The PyTorch Inductor backend: the kernels ``torch.compile`` generates, compiled in the pool.

Inductor's output code calls ``async_compile.triton(kernel_name, source_code,
device_str=...)`` once per kernel. ``source_code`` is a whole module: a
``@triton_heuristics.<kind>(size_hints=..., triton_meta=..., inductor_meta=...)``
decorator over a ``@triton.jit`` function. Loading it yields a ``CachingAutotuner``, which
compiles one binary per autotuning configuration.

A request goes the way Inductor's own compile workers go, so that the kernel that comes
back is the very object ``async_compile.triton(...)`` would have produced:

1. here, in the parent: the source is checked (:func:`parse_source`) and keyed as Inductor
   keys it, ``code_hash(source, extra=torch_key())``, with the cache-invalidating
   environment and the Inductor settings the worker gets folded in;
2. in a worker: Inductor's own worker function loads the module (``PyCodeCache``), calls
   ``precompile(warm_cache_only=True)`` (every configuration through Triton, filling
   Triton's disk cache) and ``prepare_for_pickle()``; the autotuner comes back pickled
   (see ``_worker``);
3. back in the parent, once per compiled kernel however many callers share it
   (:meth:`InductorArtifact.ready`): ``restore_after_unpickle()`` and
   ``precompile()``, which builds the launchers from Triton's now warm cache.

Step 3 may initialise the GPU and loads binaries, so it never runs in the pool's
supervisor thread: the async path runs it in a thread, the synchronous path (Inductor's
own ``wait()``) in the thread that asks for the kernel, as Inductor does.

torch is imported only inside functions: importing this module costs nothing.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiocompile.backends import BackendContext, Request, source_features
from aiocompile.backends.inductor import _worker as _inductor_worker
from aiocompile.backends.triton._backend import KEY_ENV_NAMES

__all__ = [
    "InductorArtifact",
    "InductorSource",
    "build_request",
    "parse_source",
    "prepare",
]

# Environment variables Inductor hands its compile workers with each kernel (what
# ``AsyncCompile.triton`` sends along): where the source and Triton's cache go, and the
# libdevice to link. A name unset in the parent is unset in the worker too.
WORKER_ENV_NAMES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_LIBDEVICE_PATH")


# -- the source -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """A call written in the source, such as ``DeviceProperties(type='cuda', cc=90)``,
    kept as data: the called name and its literal arguments."""

    func: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Name:
    """A bare name in the source where a literal was expected (``__file__``)."""

    id: str


@dataclass(frozen=True)
class InductorSource:
    """What an Inductor kernel's source says about the kernel, read without executing it.

    ``heuristic`` is the ``triton_heuristics`` decorator (``pointwise``, ``reduction``,
    ``persistent_reduction``, ``template``, ...) or None for a plain ``@triton.jit``
    module. ``signature`` maps each argument to its Triton type (``"*fp32"``, ``"i32"``,
    ``"constexpr"``); ``specialization`` maps arguments to the attributes the kernel is
    specialised on (``(("tt.divisibility", 16),)``: the pointer or size is a multiple of
    16). ``device_type``, ``cc`` (compute capability, or the AMD architecture) and
    ``warp_size`` come from the ``DeviceProperties`` in ``triton_meta``.
    """

    kernel_name: str
    heuristic: str | None
    arg_names: tuple[str, ...]
    signature: Mapping[str, str]
    constants: Mapping[str, Any]
    specialization: Mapping[str, tuple[tuple[str, Any], ...]]
    size_hints: Mapping[str, Any]
    device_type: str | None
    device_index: int | None
    cc: int | str | None
    warp_size: int | None
    triton_meta: Mapping[str, Any]
    inductor_meta: Mapping[str, Any]

    @property
    def constexprs(self) -> tuple[str, ...]:
        """The arguments given at compile time rather than at launch."""
        return tuple(name for name, kind in self.signature.items() if kind == "constexpr")

    @property
    def target(self) -> str | None:
        """``"cuda:90"``, ``"hip:gfx942"``: the architecture the source was generated for."""
        if self.device_type is None:
            return None
        if self.cc is None:
            return self.device_type
        arch = str(self.cc).split(":")[0]
        return f"{self.device_type}:{arch}"


def parse_source(kernel_name: str, source_code: str) -> InductorSource:
    """Read an Inductor kernel's source; raises ``TypeError``/``ValueError`` for input
    that cannot be one: not strings, a name that is not an identifier, text that does not
    parse, or a module that does not define ``kernel_name`` at its top level."""
    if not isinstance(kernel_name, str):
        raise TypeError(f"kernel_name must be a str, got {type(kernel_name).__name__}")
    if not isinstance(source_code, str):
        raise TypeError(f"source_code must be a str (the kernel's module source), got {type(source_code).__name__}")
    if not kernel_name.isidentifier():
        raise ValueError(f"kernel_name must be a Python identifier, got {kernel_name!r}")
    try:
        tree = ast.parse(source_code)
    except SyntaxError as exc:
        raise ValueError(f"the source of Inductor kernel {kernel_name!r} does not parse: {exc}") from None
    bound = _top_level_names(tree.body)
    node = bound.get(kernel_name)
    if node is None:
        defined = sorted(name for name, n in bound.items() if isinstance(n, ast.FunctionDef))
        raise ValueError(
            f"the source defines no kernel named {kernel_name!r} at its top level"
            + (f"; it defines {', '.join(defined)}" if defined else "")
        )
    arg_names: tuple[str, ...] = ()
    heuristic = None
    options: dict[str, Any] = {}
    if isinstance(node, ast.FunctionDef):
        args = node.args
        arg_names = tuple(a.arg for a in args.posonlyargs + args.args)
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and _dotted(decorator.func).startswith("triton_heuristics."):
                heuristic = _dotted(decorator.func).rpartition(".")[2]
                options = {kw.arg: _literal(kw.value) for kw in decorator.keywords if kw.arg is not None}
                break
    triton_meta = options.get("triton_meta")
    triton_meta = triton_meta if isinstance(triton_meta, dict) else {}
    inductor_meta = options.get("inductor_meta")
    inductor_meta = inductor_meta if isinstance(inductor_meta, dict) else {}
    signature = triton_meta.get("signature")
    signature = {str(k): str(v) for k, v in signature.items()} if isinstance(signature, dict) else {}
    device = triton_meta.get("device")
    device_kwargs: Mapping[str, Any] = device.kwargs if isinstance(device, Call) else {}
    size_hints = options.get("size_hints")
    constants = triton_meta.get("constants")
    return InductorSource(
        kernel_name=kernel_name,
        heuristic=heuristic,
        arg_names=arg_names,
        signature=signature,
        constants=constants if isinstance(constants, dict) else {},
        specialization=_specialization(triton_meta.get("configs"), list(signature) or list(arg_names)),
        size_hints=size_hints if isinstance(size_hints, dict) else {},
        device_type=_str_or_none(device_kwargs.get("type")),
        device_index=_int_or_none(device_kwargs.get("index")),
        cc=device_kwargs.get("cc") if isinstance(device_kwargs.get("cc"), (int, str)) else None,
        warp_size=_int_or_none(device_kwargs.get("warp_size")),
        triton_meta=triton_meta,
        inductor_meta=inductor_meta,
    )


def _top_level_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module binds when it runs, looking into top-level ``if``/``try`` blocks."""
    bound: dict[str, ast.AST] = {}
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[stmt.name] = stmt
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                for node in ast.walk(target):
                    if isinstance(node, ast.Name):
                        bound[node.id] = stmt
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                bound[(alias.asname or alias.name).split(".")[0]] = stmt
        elif isinstance(stmt, ast.If):
            bound.update(_top_level_names(stmt.body))
            bound.update(_top_level_names(stmt.orelse))
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody, *[h.body for h in stmt.handlers]):
                bound.update(_top_level_names(block))
    return bound


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _literal(node: ast.AST) -> Any:
    """A literal as a value; a call as :class:`Call`; a bare name as :class:`Name`;
    anything else as None. Never executes anything."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Dict):
        return {_hashable(_literal(k)) if k is not None else None: _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_hashable(_literal(e)) for e in node.elts)
    if isinstance(node, ast.Set):
        return {_hashable(_literal(e)) for e in node.elts}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _literal(node.operand)
        return -value if isinstance(value, (int, float)) else None
    if isinstance(node, ast.Call):
        func = _dotted(node.func)
        if func == "set" and not node.args and not node.keywords:
            return set()
        return Call(func, tuple(_literal(a) for a in node.args),
                    {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None})
    if isinstance(node, (ast.Name, ast.Attribute)):
        return Name(_dotted(node))
    return None


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, (dict, set, Call)):
        return repr(value)
    return value


def _specialization(configs: Any, arg_names: list[str]) -> dict[str, tuple[tuple[str, Any], ...]]:
    """``triton_meta["configs"]`` -> argument name -> its attributes.

    Inductor writes one dict per configuration, mapping a tuple of argument indices to a
    list of ``[attribute, value]`` pairs: ``{(0,): [['tt.divisibility', 16]]}``.
    """
    found: dict[str, list[tuple[str, Any]]] = {}
    for config in configs if isinstance(configs, list) else []:
        if not isinstance(config, dict):
            continue
        for path, attrs in config.items():
            if not isinstance(path, tuple) or len(path) != 1 or not isinstance(path[0], int):
                continue
            index = path[0]
            if not 0 <= index < len(arg_names) or not isinstance(attrs, (list, tuple)):
                continue
            for attr in attrs:
                if isinstance(attr, (list, tuple)) and len(attr) == 2 and isinstance(attr[0], str):
                    pair = (attr[0], attr[1])
                    slot = found.setdefault(arg_names[index], [])
                    if pair not in slot:
                        slot.append(pair)
    return {name: tuple(found[name]) for name in arg_names if name in found}


def _unread(kernel_name: str) -> InductorSource:
    return InductorSource(kernel_name, None, (), {}, {}, {}, {}, None, None, None, None, {}, {})


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# -- keys -------------------------------------------------------------------------------------


def inductor_key(source_code: str) -> str:
    """Inductor's own key for a kernel source (``CompiledTritonKernels.key``): the source
    hashed with ``torch_key()``, the hash of torch's own sources."""
    from torch._inductor.codecache import code_hash, torch_key

    return str(code_hash(source_code, extra=torch_key()))


def worker_settings() -> tuple[dict[str, str], tuple[str, ...], dict[str, Any]]:
    """What a worker needs besides the source, as Inductor gathers it for its own workers:
    the environment to set, the names to unset, and the Inductor settings to patch."""
    from torch._inductor import config

    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_libdevice_path
    except ImportError:  # torch versions without a libdevice override
        pass
    else:
        _set_triton_libdevice_path()  # may set TRITON_LIBDEVICE_PATH for the workers
    env = {name: os.environ[name] for name in WORKER_ENV_NAMES if name in os.environ}
    unset = tuple(name for name in WORKER_ENV_NAMES if name not in os.environ)
    extra_config: dict[str, Any] = {}
    if hasattr(config, "use_static_triton_launcher"):
        extra_config["use_static_triton_launcher"] = config.use_static_triton_launcher
    return env, unset, extra_config


def _lookup_table_entry(source_code: str) -> dict[str, Any]:
    """The entry of ``config.autotune_lookup_table`` for this kernel, if the table has
    one; Inductor sends it to the worker with the kernel."""
    from torch._inductor import config

    table = getattr(config, "autotune_lookup_table", None)
    if not table or "@triton.jit\n" not in source_code:
        return {}
    try:
        import re

        from torch._inductor.runtime.triton_heuristics import generate_lookup_hash_from_source_code
    except ImportError:
        return {}
    match = re.search(r"size_hints=(\{.*?\})", source_code)
    size_hints = match.group(1) if match else str(None)
    fn_hash = generate_lookup_hash_from_source_code(size_hints, source_code.split("@triton.jit\n")[1])
    if fn_hash in table:
        return {"autotune_lookup_table": {fn_hash: table[fn_hash]}}
    return {}


def request_key(base: str, extra_config: Mapping[str, Any]) -> str:
    """Our cache key: Inductor's key, the environment variables that change what Triton
    builds, and the Inductor settings the worker compiles under."""
    env = tuple((name, os.environ.get(name)) for name in KEY_ENV_NAMES)
    text = repr((base, env, sorted((k, repr(v)) for k, v in extra_config.items())))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- the request ------------------------------------------------------------------------------


class InductorArtifact:
    """One compiled Inductor kernel, as the cache holds it: the ``CachingAutotuner`` that
    came back from a worker, made ready for launching in this process once.

    ``kernel`` is the autotuner itself; ``ready()`` returns it after the parent-side step
    (``restore_after_unpickle`` and ``precompile``, which builds the launchers). Callers
    sharing the artifact share that step: the first does it, under a lock, the others
    wait for it; if it raises, the next caller tries again.
    """

    def __init__(
        self,
        kernel: Any,
        *,
        name: str,
        key: str,
        inductor_key: str,
        source_code: str,
        elapsed_us: int | None,
    ) -> None:
        self.kernel = kernel
        self.name = name
        self.key = key
        self.inductor_key = inductor_key
        self.source_code = source_code
        self.elapsed_us = elapsed_us
        self.size = len(source_code.encode("utf-8")) + _binary_size(kernel)
        self._lock = threading.Lock()
        self._ready = False

    @property
    def is_ready(self) -> bool:
        return self._ready

    def ready(self, compile_info: tuple[Any, bool] | None = None) -> Any:
        """The autotuner, launchers built (blocking: call it off the event loop).

        ``compile_info`` is ``(compile_id, is_backward)`` of the graph that asked first,
        recorded on the kernel the first time, as Inductor does."""
        if self._ready:
            return self.kernel
        with self._lock:
            if self._ready:
                return self.kernel
            kernel = self.kernel
            if compile_info is not None and hasattr(kernel, "set_compile_info"):
                kernel.set_compile_info(*compile_info)
            kernel.restore_after_unpickle(old_values=None)
            _call_supported(
                kernel.precompile,
                warm_cache_only=False,
                reload_kernel=functools.partial(_load_in_parent, self.name, self.source_code),
                static_triton_bundle_key=self.inductor_key,
            )
            self._ready = True
        return self.kernel

    def __repr__(self) -> str:
        state = "ready" if self._ready else "not loaded"
        return f"<InductorArtifact {self.name} {self.key[:12]} ({state})>"


def _load_in_parent(kernel_name: str, source_code: str) -> Any:
    """Load the kernel's module in this process: what Inductor does when an autotuner
    needs its Triton function back (coordinate descent tuning, rblock scaling)."""
    from torch._inductor.codecache import PyCodeCache

    return getattr(PyCodeCache.load(source_code), kernel_name)


def _binary_size(kernel: Any) -> int:
    """Bytes of the binaries and IR the autotuner holds (for the memory cache's bound)."""
    total = 0
    for result in getattr(kernel, "compile_results", None) or ():
        compiled = getattr(result, "kernel", None)
        asm = getattr(compiled, "asm", None)
        if isinstance(asm, Mapping):
            total += sum(len(v) for v in asm.values() if isinstance(v, (str, bytes)))
        for attr in ("cubin_raw", "cubin"):
            raw = getattr(compiled, attr, None)
            if isinstance(raw, bytes):
                total += len(raw)
    return total


@functools.lru_cache(maxsize=64)
def _parameters(fn: Any) -> frozenset[str] | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


def _call_supported(method: Any, **kwargs: Any) -> Any:
    """Call ``method`` with those of ``kwargs`` it accepts: the keywords of Inductor's
    ``precompile`` grew over torch versions."""
    accepted = _parameters(getattr(method, "__func__", method))
    if accepted is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return method(**kwargs)


def build_request(
    kernel_name: str, source_code: str, *, parsed: InductorSource | None = None, strict: bool = True
) -> Request:
    """The compile request for one kernel (blocking: imports torch the first time and
    hashes the source; call it off the event loop). ``parse_source`` checks the input;
    with ``strict=False`` a source it cannot read is still sent (for Inductor's own calls:
    the worker then fails exactly where Inductor's own worker would)."""
    if parsed is None:
        try:
            parsed = parse_source(kernel_name, source_code)
        except ValueError:
            if strict:
                raise
            parsed = _unread(kernel_name)
    base = inductor_key(source_code)
    env, unset, extra_config = worker_settings()
    extra_config.update(_lookup_table_entry(source_code))
    key = request_key(base, extra_config)
    target = parsed.target

    def finish(answer: Mapping[str, Any]) -> InductorArtifact:
        return InductorArtifact(answer["kernel"], name=kernel_name, key=key, inductor_key=base,
                                source_code=source_code, elapsed_us=answer.get("elapsed_us"))

    return Request(
        backend="inductor",
        key=key,
        name=kernel_name,
        target=target,
        fn=_inductor_worker.compile_triton,
        args=(kernel_name, source_code, env, unset, extra_config, key, target),
        finish=finish,
        encode=None,  # an autotuner is a live object: it is not kept on disk
        size=lambda artifact: artifact.size,
        details=_details,
        features=source_features(source_code),
    )


def _details(answer: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "stages": tuple((str(stage), float(seconds)) for stage, seconds in answer.get("stages", ())),
        "compiler_cache_hit": answer.get("cache_hit"),
    }


def check_device(parsed: InductorSource, device_str: str) -> None:
    if not isinstance(device_str, str) or not device_str:
        raise TypeError(f"device_str must be a device type such as 'cuda', got {device_str!r}")
    if parsed.device_type is not None and parsed.device_type != device_str:
        raise ValueError(
            f"device_str={device_str!r}, but the source of {parsed.kernel_name!r} was generated for "
            f"{parsed.device_type!r}"
        )


async def prepare(ctx: BackendContext, kernel_name: str, source_code: str, device_str: str = "cuda") -> Request:
    """Check the arguments and build the request. Wrong types raise ``TypeError`` at
    once; the source is parsed and hashed in a thread (a large template kernel takes
    milliseconds), and a source that is no kernel raises ``ValueError`` from there."""
    if not isinstance(kernel_name, str):
        raise TypeError(f"kernel_name must be a str, got {type(kernel_name).__name__}")
    if not isinstance(source_code, str):
        raise TypeError(f"source_code must be a str (the kernel's module source), got {type(source_code).__name__}")
    if not isinstance(device_str, str) or not device_str:
        raise TypeError(f"device_str must be a device type such as 'cuda', got {device_str!r}")

    def build() -> Request:
        parsed = parse_source(kernel_name, source_code)
        check_device(parsed, device_str)
        return build_request(kernel_name, source_code, parsed=parsed)

    request: Request = await ctx.to_thread(build)
    return request
