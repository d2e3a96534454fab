"""The Triton backend: ``compile_triton`` arguments -> a worker compile -> a ``TritonKernel``.

The parent checks everything it can before a worker is involved (argument names and types,
the target, option names and types), decides how the kernel travels (see
``_ship``), and computes the kernel's key.

The key is Triton's own cache key, computed with Triton's own functions: ``triton_key()``
(the Triton build: its version, its sources and its shared library), the kernel's
``ASTSource.hash()`` (its source and that of every ``@jit`` function it calls, the global
constexprs they read, the line it starts on, the signature, constexprs and attributes),
the backend's hash (the target, and ptxas's version for CUDA), the parsed options' hash
(defaults filled in, so ``num_warps=4`` and no ``num_warps`` are one kernel), and the
cache-invalidating environment variables. The worker's Triton computes the same hash for
the binary it builds, and the parent checks that it did.

Computing a key from scratch takes milliseconds (the first one in a process longer: it
pays ``triton_key()``, Triton hashing itself), so it happens off the event loop, once per kernel and
arguments: the answer is memoised per kernel object, and a request seen before costs a few
dictionary look-ups.
"""

from __future__ import annotations

import ast
import hashlib
import math
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiocompile._base.target import Target, parse_target
from aiocompile.backends import BackendContext, Request
from aiocompile.backends.triton import _worker as _triton_worker
from aiocompile.backends.triton._check import check_options, constexpr_defaults, fill_defaults, normalize
from aiocompile.backends.triton._kernel import TritonKernel
from aiocompile.backends.triton._ship import KernelRef, SourceBundle, SourceModule, exec_source_module, ship, unwrap_jit
from aiocompile.backends.triton._targets import check_target
from aiocompile.errors import CompileError

__all__ = ["TritonBackend", "TritonKernel", "TritonSource", "TritonSpec"]

# Environment variables that change what Triton builds: the union, over the Triton
# versions we support, of what ``get_cache_invalidating_env_vars()`` reads. Only used to
# notice quickly that the environment changed; the key itself takes Triton's own answer.
KEY_ENV_NAMES = (
    "ALLOW_LHS_TMEM_LAYOUT_CONVERSION", "AMDGCN_ENABLE_DUMP", "AMDGCN_USE_BUFFER_ATOMICS", "AMDGCN_USE_BUFFER_OPS",
    "DISABLE_LLVM_OPT", "DISABLE_MMA_V3", "DISABLE_MMA_V5", "DISABLE_PTXAS_OPT", "LLVM_ENABLE_TIMING",
    "LLVM_EXTRACT_DI_LOCAL_VARIABLES", "LLVM_IR_ENABLE_DUMP", "LLVM_PASS_PLUGIN_PATH", "MLIR_DISABLE_MULTITHREADING",
    "MLIR_DUMP_PATH", "MLIR_ENABLE_DIAGNOSTICS", "MLIR_ENABLE_DUMP", "MLIR_ENABLE_TIMING", "NVPTX_ENABLE_DUMP",
    "TRITON_CONSAN_INIT_ALLOCATIONS", "TRITON_DEFAULT_FP_FUSION", "TRITON_DISABLE_LINE_INFO", "TRITON_DUMP_MIR",
    "TRITON_ENABLE_ASAN", "TRITON_ENABLE_EXPERIMENTAL_CONSAN", "TRITON_ENABLE_LLVM_DEBUG", "TRITON_F32_DEFAULT",
    "TRITON_FORCE_DISABLE_FP_FUSION", "TRITON_HIP_USE_ASYNC_COPY", "TRITON_HIP_USE_BLOCK_PINGPONG",
    "TRITON_HIP_USE_COEXEC_SCHEDULER", "TRITON_HIP_USE_EXPERT_SCHEDULING", "TRITON_HIP_USE_IN_THREAD_TRANSPOSE",
    "TRITON_LLVM_DEBUG_ONLY", "TRITON_OVERRIDE_ARCH", "TRITON_PARTITION_SCHEDULING_DUMP_DATA_ONLY",
    "TRITON_PARTITION_SCHEDULING_DUMP_LOOP_ONLY", "TRITON_PARTITION_SCHEDULING_ENABLE_DUMP_DOT", "TRITON_PLUGIN_PATHS",
    "TRITON_PLUGIN_VERSION_CHECK", "USE_IR_LOC", "PTXAS_OPTIONS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
)
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS = tuple(os.environ.encodekey(n) for n in KEY_ENV_NAMES) if _ENV_DATA is not None else KEY_ENV_NAMES


def _env_fingerprint() -> tuple[Any, ...]:
    # A few microseconds: the raw dict behind os.environ, with pre-encoded names. The
    # length catches a variable added anywhere.
    data = _ENV_DATA if _ENV_DATA is not None else os.environ
    return (len(data), *map(data.get, _ENV_KEYS))


# -- TritonSource -------------------------------------------------------------------------


class TritonSource:
    """A Triton kernel given as the text of a module: ``TritonSource(text, "kernel_name")``.

    The text is a whole module (with its own imports); ``name`` is the ``@triton.jit``
    function in it to compile. It is checked here, at once: it must parse, define
    ``name`` at module level, and import nothing relatively (it belongs to no package).
    To compute the kernel's key, the module is also executed in this process (off the
    event loop), as importing it would.
    """

    __slots__ = ("source", "name", "filename", "arg_names", "defaulted", "digest", "__weakref__")

    def __init__(self, source: str, name: str, *, filename: str | None = None) -> None:
        if not isinstance(source, str):
            raise TypeError(f"TritonSource source must be a str, got {type(source).__name__}")
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"TritonSource name must be an identifier, got {name!r}")
        try:
            tree = ast.parse(source)
        except SyntaxError as exc:
            raise ValueError(f"TritonSource for {name!r} does not parse: {exc}") from None
        func = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if func is None:
            raise ValueError(f"TritonSource defines no top-level function {name!r}")
        relative = next((n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level), None)
        if relative is not None:
            # Executed here and in workers as a module of its own, in no package, it has
            # nothing to be relative to: Python's own error would name no fix.
            raise ValueError(
                f"TritonSource for {name!r} has a relative import on line {relative.lineno} "
                f"({ast.unparse(relative)!r}): a TritonSource is executed as a standalone module, not part of a "
                "package; import installed modules by their absolute names, or put the helper in the text"
            )
        args = func.args
        self.source = source
        self.name = name
        self.digest = hashlib.sha256(source.encode()).hexdigest()
        self.filename = filename or f"<aiocompile-source-{name}-{self.digest[:12]}>"
        positional = args.posonlyargs + args.args
        self.arg_names = tuple(a.arg for a in positional)
        # Read from the text, as Triton reads annotations (the word "constexpr" in them),
        # so that checking a request need not execute the module; the values come from
        # the executed kernel (``fill_defaults``).
        with_default = positional[len(positional) - len(args.defaults):]
        self.defaulted = tuple(a.arg for a in with_default
                               if a.annotation is not None and "constexpr" in ast.unparse(a.annotation))

    def __repr__(self) -> str:
        return f"TritonSource(name={self.name!r}, {len(self.source)} characters)"


# -- the spec a worker compiles ---------------------------------------------------------------


@dataclass(frozen=True)
class TritonSpec:
    """Everything a worker needs to compile one kernel, and the key it must come out with."""

    kernel: KernelRef
    name: str
    arg_names: tuple[str, ...]
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    attrs: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
    options: tuple[tuple[str, Any], ...]
    target: Target
    key: str

    def triton_attrs(self) -> dict[tuple[int, ...], list[list[Any]]]:
        """``attrs`` the way ``ASTSource`` takes them, in argument order as the JIT gives
        them: ``ASTSource.hash`` hashes their text, so the order is part of the key."""
        by_index = sorted((self.arg_names.index(name), values) for name, values in self.attrs)
        return {(index,): [list(a) for a in values] for index, values in by_index}

    def ast_source(self, fn: Any) -> Any:
        from triton.compiler import ASTSource

        return ASTSource(fn, dict(self.signature), dict(self.constexprs), self.triton_attrs())


def finish(spec: TritonSpec, artifact: Mapping[str, Any]) -> TritonKernel:
    """The parent's last step: the worker's answer -> a ``TritonKernel``."""
    if artifact["hash"] != spec.key:
        # The worker built something else than this process asked for: a module edited on
        # disk after it was imported here, say. Its binary is not the kernel asked for.
        raise CompileError(
            "the worker compiled a different version of this kernel than the one loaded in this process "
            "(was its source file changed after it was imported?); restart to pick up the change",
            kernel_name=spec.name, key=spec.key, target=str(spec.target),
        )
    return TritonKernel(
        name=artifact["name"],
        key=spec.key,
        target=str(spec.target),
        asm=artifact["asm"],
        metadata_json=artifact["metadata_json"],
        compile_time=artifact["compile_time"],
        arg_names=spec.arg_names,
        signature=dict(spec.signature),
        constexprs=dict(spec.constexprs),
        triton_version=artifact["triton_version"],
        triton_hash=artifact["hash"],
    )


def _details(artifact: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "stages": tuple((str(stage), float(seconds)) for stage, seconds in artifact.get("stages", ())),
        "compiler_cache_hit": artifact.get("cache_hit"),
    }


def encode(kernel: TritonKernel) -> bytes:
    return kernel.to_bytes()


def size(kernel: TritonKernel) -> int:
    return kernel.size


# -- how kernels travel, and what they depend on ----------------------------------------------


@dataclass(eq=False)
class _Kernel:
    """What is known of one kernel object: how it ships, the parent-side ``JITFunction``
    its key is computed from, the globals whose change makes all this stale, and the specs
    already worked out for it."""

    ref: KernelRef
    fn: Any
    guards: tuple[tuple[dict[str, Any], str, Any], ...] = ()
    jit_functions: tuple[Any, ...] = ()
    requests: dict[Any, Request] = field(default_factory=dict)
    shape: tuple[float, float] | None = None
    """log2 of its source's bytes (with its callees'), and 1.0 if it calls ``dot``: worked
    out once, for predicting its compiles' cost (``_features``)."""

    def fresh(self) -> bool:
        return all(d.get(name, _MISSING) is value for d, name, value in self.guards)


_MISSING = object()
# A call of tl.dot or tl.dot_scaled (or of dot imported by name): the kernel multiplies
# matrices, and its compile grows with its tile.
_DOT = re.compile(r"\bdot(?:_scaled)?\s*\(")


class _ByIdentity:
    """What is known of each kernel object, by identity, held weakly.

    Not a ``WeakKeyDictionary``: that hashes its keys, and a ``JITFunction``'s hash is its
    ``cache_key``, which walks the kernel's source and its callees the first time
    (milliseconds, in the event loop's thread, where requests are looked up) and changes
    when a global it reads is redefined (so the entry would be lost under its old hash).
    """

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref[Any], _Kernel]] = {}

    def get(self, obj: Any) -> _Kernel | None:
        item = self._items.get(id(obj))
        if item is None or item[0]() is not obj:
            return None
        return item[1]

    def __setitem__(self, obj: Any, value: _Kernel) -> None:
        key, items = id(obj), self._items

        def forget(ref: weakref.ref[Any]) -> None:
            current = items.get(key)
            if current is not None and current[0] is ref:
                del items[key]

        items[key] = (weakref.ref(obj, forget), value)

    def __len__(self) -> int:
        return len(self._items)


def _global_names(jit: Any) -> set[str]:
    from aiocompile.backends.triton._ship import free_names

    func = next(n for n in ast.walk(ast.parse(jit.src)) if isinstance(n, ast.FunctionDef))
    body, defaults = free_names(func)
    return body | defaults


def _called_jit_functions(fn: Any) -> list[Any]:
    from triton.runtime.jit import JITFunction

    found: list[Any] = []
    stack = [fn]
    while stack:
        current = stack.pop()
        for name in _global_names(current):
            value = current.__globals__.get(name)
            if isinstance(value, JITFunction) and value is not fn and value not in found:
                found.append(value)
                stack.append(value)
    return found


def _memo_key(signature: Any, constexprs: Any, target: Any, attrs: Any, options: Mapping[str, Any]) -> Any:
    """A hashable summary of one request's arguments, or None if they do not hash."""
    try:
        key = (
            tuple(signature.items()),
            tuple(constexprs.items()) if constexprs else (),
            target,
            tuple((k, tuple(map(tuple, v))) for k, v in attrs.items()) if attrs else (),
            tuple(sorted(options.items())),
            _env_fingerprint(),
        )
        hash(key)
    except (TypeError, AttributeError):
        return None
    return key


@dataclass
class _Checked:
    """One request's arguments, checked and in canonical form (``TritonBackend._check``)."""

    kernel: Any
    name: str
    arg_names: tuple[str, ...]
    signature: Any
    constexprs: Any
    attrs: Any
    options: tuple[tuple[str, Any], ...]
    target: Target | None
    given_options: Mapping[str, Any]
    memo: Any
    """``_memo_key`` of the arguments as given (None if they do not hash)."""

    def resolve(self, target: Target) -> None:
        """The current device's target, for a request that names none."""
        check_options(self.given_options, target)
        self.target = target


class TritonBackend:
    """The Triton backend's state in one scheduler: what it knows of the kernels it has
    seen. Thread-safe: requests come from any event loop, keys are computed in threads."""

    name = "triton"
    needs: tuple[str, ...] = ("kernel", "signature")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # Keys are computed one at a time: the work holds the GIL, so threads computing
        # them side by side gain nothing and only crowd the event loop's thread out.
        self._keys_lock = threading.Lock()
        self._kernels = _ByIdentity()
        self._backends: dict[Any, Any] = {}
        self._options: dict[Any, Any] = {}
        self._current_targets: dict[Any, Target] = {}

    async def prepare(
        self,
        ctx: BackendContext,
        kernel: Any,
        *,
        signature: Mapping[str, Any],
        constexprs: Mapping[str, Any] | None = None,
        target: Any = None,
        attrs: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Request:
        """Check the arguments and build the compile request. Raises ``ValueError`` or
        ``TypeError`` for bad input before any worker is involved."""
        found = self._recall_or_check(kernel, signature, constexprs, target, attrs, options or {})
        if isinstance(found, Request):
            return found
        if found.target is None:
            found.resolve(await self.current_target(ctx))
        built: Request = await ctx.to_thread(lambda: self._build(found))
        return built

    def label(self, spec: Mapping[str, Any]) -> str:
        kernel = spec["kernel"]
        return str(getattr(kernel, "__name__", None) or getattr(kernel, "name", "?"))

    async def prepare_specs(self, ctx: BackendContext, specs: list[dict[str, Any]],
                            timeouts: Sequence[float | None] | None = None) -> list[Request | Exception]:
        """``prepare_many`` for ``compile_many``'s specs: ``compile_triton``'s keyword
        arguments, the kernel under ``"kernel"``; what is not an argument is an option.
        (A Triton key needs no worker, so ``timeouts`` have nothing to bound here.)"""
        items = [{"kernel": spec.pop("kernel"), "signature": spec.pop("signature"),
                  "constexprs": spec.pop("constexprs", None), "target": spec.pop("target", None),
                  "attrs": spec.pop("attrs", None), "options": spec} for spec in specs]
        return await self.prepare_many(ctx, items)

    async def prepare_many(self, ctx: BackendContext, items: list[dict[str, Any]]) -> list[Request | Exception]:
        """``prepare`` for many requests at once (``compile_many``): each item holds
        ``prepare``'s keyword arguments and the kernel under ``"kernel"``. All of them are
        checked and keyed in one trip to the keys thread, which releases the interpreter
        lock after each, so the event loop does no per-request work and wakes once. A
        request that fails its checks gets its exception in its place in the list."""
        current: Target | Exception | None = None
        if any(item.get("target") is None for item in items):
            try:
                current = await self.current_target(ctx)
            except Exception as exc:  # only the requests without a target fail for it
                current = exc

        def prepare_all() -> list[Request | Exception]:
            out: list[Request | Exception] = []
            for item in items:
                try:
                    out.append(self.prepare_now(item, current))
                except Exception as exc:
                    out.append(exc)
                time.sleep(0)  # the interpreter lock released: a waiting event loop may take it now
            return out

        prepared: list[Request | Exception] = await ctx.to_thread(prepare_all)
        return prepared

    def prepare_now(self, item: dict[str, Any], current: Target | Exception | None) -> Request:
        """``prepare`` of one item in one go, in the calling thread, ``current`` standing
        for the current device's target."""
        found = self._recall_or_check(item["kernel"], item["signature"], item.get("constexprs"),
                                      item.get("target"), item.get("attrs"), item.get("options") or {})
        if isinstance(found, Request):
            return found
        if found.target is None:
            if isinstance(current, Exception):
                raise current
            assert current is not None
            found.resolve(current)
        return self._build(found)

    def _recall_or_check(
        self, kernel: Any, signature: Mapping[str, Any], constexprs: Mapping[str, Any] | None, target: Any,
        attrs: Mapping[str, Any] | None, options: Mapping[str, Any],
    ) -> Request | _Checked:
        """The request built before for these very arguments (``_memo_key``), or the
        arguments checked for a new one."""
        memo = _memo_key(signature, constexprs, target, attrs, options)
        known = self._known(kernel)
        if known is not None and memo is not None:
            request: Request | None = known.requests.get(memo)
            if request is not None:
                return request
        return self._check(kernel, signature, constexprs, target, attrs, options, memo)

    def _check(self, kernel: Any, signature: Mapping[str, Any], constexprs: Mapping[str, Any] | None, target: Any,
               attrs: Mapping[str, Any] | None, options: Mapping[str, Any], memo: Any) -> _Checked:
        """The arguments checked and put in their canonical form; ``target`` None when the
        request names none."""
        parsed_target = parse_target(target)
        check_options(options, parsed_target)
        if isinstance(kernel, TritonSource):
            name, arg_names, defaulted = kernel.name, kernel.arg_names, kernel.defaulted
        else:
            if "triton" not in sys.modules:
                raise TypeError(
                    f"kernel must be a @triton.jit function or aiocompile.TritonSource, got {type(kernel).__name__}"
                )
            fn = unwrap_jit(kernel)
            name, arg_names, defaulted = fn.__name__, tuple(fn.arg_names), constexpr_defaults(fn)
        full_signature, ordered_constexprs, norm_attrs = normalize(name, arg_names, signature, constexprs, attrs,
                                                                   defaulted)
        norm_options = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))
        return _Checked(kernel, name, arg_names, full_signature, ordered_constexprs, norm_attrs, norm_options,
                        parsed_target, options, memo)

    def _build(self, checked: _Checked) -> Request:
        """The request, with its key (Triton's hash: blocking, one at a time)."""
        assert checked.target is not None
        with self._keys_lock:
            known = self._kernel(checked.kernel)
            constexprs = fill_defaults(checked.name, known.fn, checked.signature, checked.constexprs)
            spec = TritonSpec(known.ref, checked.name, checked.arg_names, checked.signature, constexprs,
                              checked.attrs, checked.options, checked.target, key="")
            request = self._request(TritonSpec(**{**spec.__dict__, "key": self._key(known.fn, spec)}),
                                    self._features(known, spec))
            if checked.memo is not None:
                known.requests[checked.memo] = request
            return request

    def _features(self, known: _Kernel, spec: TritonSpec) -> tuple[tuple[str, float], ...]:
        """What predicts this compile's cost (see ``_core.costs``): the kernel's source size and
        whether it calls ``dot``, the tile (the product of the BLOCK/TILE constexprs),
        ``num_warps`` and ``num_stages`` (Triton's defaults where not given)."""
        if known.shape is None:
            try:
                jits = [known.fn, *_called_jit_functions(known.fn)]
            except Exception:  # a source that does not parse here, say: the kernel alone
                jits = [known.fn]
            sources = [str(getattr(jit, "src", "") or "") for jit in jits]
            size = sum(len(source.encode()) for source in sources)
            known.shape = (math.log2(max(size, 1)), 1.0 if any(_DOT.search(source) for source in sources) else 0.0)
        tile = 1
        for name, value in spec.constexprs:
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and \
                    ("BLOCK" in name.upper() or "TILE" in name.upper()):
                tile *= value
        options = self._parsed_options(spec.target, spec.options)
        warps = getattr(options, "num_warps", 4) or 4
        stages = getattr(options, "num_stages", 3) or 0
        source, dot = known.shape
        return (("source", source), ("tile", math.log2(tile)), ("warps", math.log2(warps)), ("dot", dot),
                ("stages", float(stages)))

    def _request(self, spec: TritonSpec, features: tuple[tuple[str, float], ...] = ()) -> Request:
        return Request(
            backend="triton",
            key=spec.key,
            name=spec.name,
            target=str(spec.target),
            fn=_triton_worker.compile_kernel,
            args=(spec,),
            finish=lambda artifact: finish(spec, artifact),
            encode=encode,
            decode=TritonKernel.from_bytes,
            size=size,
            details=_details,
            features=features,
        )

    # -- kernels ----------------------------------------------------------------------------

    def _known(self, kernel: Any) -> _Kernel | None:
        known = self._kernels.get(kernel)
        if known is not None and known.fresh():
            return known
        return None

    def _kernel(self, kernel: Any) -> _Kernel:
        """What is known of ``kernel``, worked out now if need be (in a thread: it reads
        and walks sources, and may execute a TritonSource)."""
        with self._lock:
            known = self._kernels.get(kernel)
            if known is not None and known.fresh():
                return known
            if known is not None:
                # A helper or a global constexpr was redefined (a notebook cell run again):
                # Triton memoises a hash on each function; clear them all.
                for jit in known.jit_functions:
                    jit.hash = None
            ref: KernelRef
            if isinstance(kernel, TritonSource):
                ref = SourceModule(kernel.source, kernel.name, kernel.filename)
                known = _Kernel(ref, unwrap_jit(exec_source_module(ref)))
            else:
                fn = unwrap_jit(kernel)
                ref = ship(fn)
                guards: list[tuple[dict[str, Any], str, Any]] = []
                jits = [fn, *_called_jit_functions(fn)] if isinstance(ref, SourceBundle) else [fn]
                if isinstance(ref, SourceBundle):
                    for jit in jits:
                        for global_name in _global_names(jit):
                            if global_name in jit.__globals__:
                                guards.append((jit.__globals__, global_name, jit.__globals__[global_name]))
                known = _Kernel(ref, fn, tuple(guards), tuple(jits))
            self._kernels[kernel] = known
            return known

    # -- keys --------------------------------------------------------------------------------

    def _key(self, fn: Any, spec: TritonSpec) -> str:
        """Triton's own cache key for this compile (what ``triton.compile`` would hash)."""
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.runtime.cache import get_cache_key, triton_key

        with self._lock:
            # Memoised by Triton but not locked: many threads asking at once for the first
            # time would each hash half a gigabyte. Likewise ptxas runs once per target.
            triton_key()
            backend = self._backend(spec.target)
            options = self._parsed_options(spec.target, spec.options)
        text = get_cache_key(spec.ast_source(fn), backend, options, get_cache_invalidating_env_vars())
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def warm_triton_key(self) -> None:
        """Pay, now, the part of a first key that does not depend on the target: hashing
        Triton itself (blocking)."""
        from triton.runtime.cache import triton_key

        with self._lock:
            triton_key()

    def warm_keys(self, target: Target) -> None:
        """Pay, now, the parent's one-time cost of a first key for ``target``: hashing
        Triton itself and asking ptxas its version (blocking)."""
        from triton.runtime.cache import triton_key

        with self._lock:
            triton_key()
            self._backend(target)

    def _backend(self, target: Target) -> Any:
        backend = self._backends.get(target)
        if backend is None:
            from triton.compiler.compiler import make_backend

            check_target(target)  # before Triton is asked: it takes what it cannot compile
            backend = self._backends[target] = make_backend(target.to_gpu_target())
            backend.hash()
        return backend

    def _parsed_options(self, target: Target, options: tuple[tuple[str, Any], ...]) -> Any:
        cache_key = (target, options, _env_fingerprint())
        parsed = self._options.get(cache_key)
        if parsed is None:
            parsed = self._options[cache_key] = self._backend(target).parse_options(dict(options))
        return parsed

    async def current_target(self, ctx: BackendContext) -> Target:
        """The current GPU's target (``target=None``); ``ValueError`` where there is none."""
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            # This process holds a device already: ask it (no new driver initialisation),
            # each time, since the current device may change.
            if getattr(torch.version, "hip", None):
                arch = torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName.split(":")[0]
                target = parse_target(f"hip:{arch}")
            else:
                major, minor = torch.cuda.get_device_capability()
                target = parse_target(f"cuda:{major * 10 + minor}")
            assert target is not None
            return target
        # Otherwise a worker asks the driver (once per visible-devices setting), so that
        # this process does not initialise it on our account.
        fingerprint = _env_fingerprint()
        target = self._current_targets.get(fingerprint)
        if target is None:
            try:
                backend, arch, warp_size = await ctx.run_in_worker(_triton_worker.detect_target)
            except Exception as exc:
                raise ValueError(
                    f"target=None means the current GPU, and none was found ({exc}); pass an explicit "
                    "target such as 'cuda:90' or 'hip:gfx942'"
                ) from None
            target = self._current_targets[fingerprint] = Target(backend, arch, warp_size)
        return target
