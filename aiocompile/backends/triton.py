"""The Triton backend: ``compile_triton`` arguments -> a worker compile -> a ``TritonKernel``.

The parent checks everything it can before a worker is involved (argument names and types,
the target, option names and types), decides how the kernel travels (see
``_triton_ship``), and computes the kernel's key. Only then does a worker compile it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pickle
import re
import shutil
import struct
import sys
import tempfile
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from aiocompile._errors import CompileError
from aiocompile._target import Target, parse_target
from aiocompile._worker import job_env
from aiocompile.backends import BackendContext, Request, _triton_worker
from aiocompile.backends._triton_ship import KernelRef, SourceModule, ship, unwrap_jit

__all__ = ["TritonKernel", "TritonSource", "prepare"]

# Bumped whenever what goes into a key changes meaning.
_KEY_VERSION = "aiocompile-triton-1"

# Variables a job carries that cannot change what the compiler produces.
_ENV_NOT_IN_KEY = frozenset({
    "TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR", "TRITON_CACHE_MANAGER",
    "TRITON_REMOTE_CACHE_BACKEND", "TRITON_REDIS_HOST", "TRITON_REDIS_PORT", "TRITON_REDIS_KEY_FORMAT",
    "TRITON_ALWAYS_COMPILE", "TRITON_PRINT_AUTOTUNING", "TRITON_CACHE_AUTOTUNING", "TRITON_KERNEL_DUMP",
    "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
    "MLIR_ENABLE_TIMING", "LLVM_ENABLE_TIMING", "TRITON_LIBCUDA_PATH", "TRITON_LIBHIP_PATH",
})

_SCALARS = frozenset({
    "i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64", "B",
    "fp8e4nv", "fp8e4b8", "fp8e5", "fp8e5b16", "fp8e4b15", "fp16", "bf16", "fp32", "fp64",
})
_TENSORDESC = re.compile(r"^tensordesc(?:_im2col)?<\w+\[\s*\d+(?:\s*,\s*\d+)*\s*\].*>$")

# Compile options: name -> (accepted types, None allowed). The union over the Triton
# versions we support; options of the other vendor are refused rather than silently
# ignored, as Triton itself would do.
_COMMON_OPTIONS: dict[str, tuple[tuple[type, ...], bool]] = {
    "num_warps": ((int,), False),
    "num_stages": ((int,), False),
    "num_ctas": ((int,), False),
    "debug": ((bool,), False),
    "enable_fp_fusion": ((bool,), False),
    "launch_cooperative_grid": ((bool,), False),
    "sanitize_overflow": ((bool,), False),
    "default_dot_input_precision": ((str,), False),
    "allowed_dot_input_precisions": ((tuple, list), False),
    "max_num_imprecise_acc_default": ((int,), False),
    "extern_libs": ((dict, tuple), True),
    "instrumentation_mode": ((str,), False),
    "supported_fp8_dtypes": ((tuple, list), False),
    "deprecated_fp8_dot_operand_dtypes": ((tuple, list), False),
    "fpsan_homomorphic_casts": ((bool,), False),
}
_VENDOR_OPTIONS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "cuda": {
        "maxnreg": ((int,), True),
        "ptx_version": ((int,), True),
        "ptx_options": ((str,), True),
        "ir_override": ((str,), True),
        "enable_reflect_ftz": ((bool,), False),
        "launch_pdl": ((bool,), False),
        "sched4reg": ((bool,), False),
        "clc": ((bool,), False),
        "min_shared_mem": ((int,), True),
    },
    "hip": {
        "waves_per_eu": ((int,), False),
        "matrix_instr_nonkdim": ((int,), False),
        "kpack": ((int,), False),
        "allow_flush_denorm": ((bool,), False),
        "schedule_hint": ((str,), False),
        "llvm_fn_attrs": ((str, tuple), False),
        "wgp_cu_mode": ((str,), False),
        "ir_override": ((str,), True),
    },
}


# -- TritonSource -------------------------------------------------------------------------


class TritonSource:
    """A Triton kernel given as the text of a module: ``TritonSource(text, "kernel_name")``.

    The text is a whole module (with its own imports); ``name`` is the ``@triton.jit``
    function in it to compile. It is checked here, at once: it must parse and define
    ``name`` at module level.
    """

    __slots__ = ("source", "name", "filename", "arg_names", "digest")

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
        args = func.args
        self.source = source
        self.name = name
        self.digest = hashlib.sha256(source.encode()).hexdigest()
        self.filename = filename or f"<aiocompile-source-{name}-{self.digest[:12]}>"
        self.arg_names = tuple(a.arg for a in args.posonlyargs + args.args)

    def __repr__(self) -> str:
        return f"TritonSource(name={self.name!r}, {len(self.source)} characters)"


# -- the spec a worker compiles ---------------------------------------------------------------


@dataclass(frozen=True)
class TritonSpec:
    kernel: KernelRef
    name: str
    arg_names: tuple[str, ...]
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    attrs: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
    options: tuple[tuple[str, Any], ...]
    target: Target
    key: str
    kernel_hash: str


@dataclass
class _Shipped:
    """How one kernel object travels, and the globals whose change would make that stale."""

    ref: KernelRef
    kernel_hash: str
    guards: tuple[tuple[dict[str, Any], str, Any], ...]
    jit_functions: tuple[Any, ...]

    def fresh(self) -> bool:
        return all(d.get(name, _MISSING) is value for d, name, value in self.guards)


_MISSING = object()


class _ShipCache:
    """Per kernel object: how it ships and its hash. Computing those reads sources and
    walks them (milliseconds), so it is done once, off the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_fn: weakref.WeakKeyDictionary[Any, _Shipped] = weakref.WeakKeyDictionary()

    def lookup(self, fn: Any) -> _Shipped | None:
        shipped = self._by_fn.get(fn)
        if shipped is not None and shipped.fresh():
            return shipped
        return None

    def compute(self, fn: Any) -> _Shipped:
        from triton.runtime.jit import JITFunction

        with self._lock:
            stale = self._by_fn.get(fn)
            if stale is not None and not stale.fresh():
                # A helper or a global constexpr was redefined (a notebook cell run again):
                # Triton memoises hashes on each function, so clear them all.
                for jit in stale.jit_functions:
                    jit.hash = None
            ref = ship(fn)
            kernel_hash = fn.cache_key
            guards: list[tuple[dict[str, Any], str, Any]] = []
            jits = [fn]
            if not isinstance(ref, SourceModule) and hasattr(ref, "units"):
                for jit in _called_jit_functions(fn):
                    jits.append(jit)
                for jit in jits:
                    for name in _global_names(jit):
                        if name in jit.__globals__:
                            guards.append((jit.__globals__, name, jit.__globals__[name]))
            shipped = _Shipped(ref, kernel_hash, tuple(guards), tuple(j for j in jits if isinstance(j, JITFunction)))
            self._by_fn[fn] = shipped
            return shipped


def _global_names(jit: Any) -> set[str]:
    from aiocompile.backends._triton_ship import _free_names

    func = next(n for n in ast.walk(ast.parse(jit.src)) if isinstance(n, ast.FunctionDef))
    body, defaults = _free_names(func)
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


_ship_cache = _ShipCache()
_triton_version: list[str] = []


def _installed_triton_version() -> str:
    if not _triton_version:
        if "triton" in sys.modules:
            version = sys.modules["triton"].__version__
        else:
            from importlib.metadata import PackageNotFoundError
            from importlib.metadata import version as dist_version

            try:
                version = dist_version("triton")
            except PackageNotFoundError:
                version = "unknown"
        _triton_version.append(version)
    return _triton_version[0]


# -- validation ---------------------------------------------------------------------------


def _check_type(arg: str, ty: Any) -> None:
    if isinstance(ty, tuple):
        for item in ty:
            _check_type(arg, item)
        return
    if not isinstance(ty, str):
        raise TypeError(f"the type of argument {arg!r} must be a string such as '*fp32' or 'i32', got {ty!r}")
    text = ty.strip()
    base = text[1:] if text.startswith("*") else text
    if text.startswith("*") and base.startswith("k") and base[1:] in _SCALARS:
        base = base[1:]
    if base in _SCALARS or text == "constexpr" or text == "nvTmaDesc" or _TENSORDESC.match(text):
        return
    raise ValueError(
        f"unknown type {ty!r} for argument {arg!r}; expected a Triton type such as 'i32', 'fp16', "
        f"'*fp32' (pointer), '*kfp32' (const pointer) or 'constexpr'"
    )


def _check_options(options: Mapping[str, Any], target: Target | None) -> None:
    vendors = [target.backend] if target is not None and target.backend in _VENDOR_OPTIONS else list(_VENDOR_OPTIONS)
    allowed = dict(_COMMON_OPTIONS)
    for vendor in vendors:
        allowed.update(_VENDOR_OPTIONS[vendor])
    for name, value in options.items():
        if name not in allowed:
            where = f" for {target.backend}" if target is not None else ""
            raise TypeError(f"unknown compile option {name!r}{where}; known options: {', '.join(sorted(allowed))}")
        types_, nullable = allowed[name]
        if value is None and nullable:
            continue
        if not isinstance(value, types_) or (bool not in types_ and isinstance(value, bool)):
            expected = " or ".join(t.__name__ for t in types_)
            raise TypeError(f"compile option {name}={value!r} must be {expected}, not {type(value).__name__}")
    num_warps = options.get("num_warps")
    if num_warps is not None and (num_warps < 1 or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps must be a positive power of two, got {num_warps}")
    for name in ("num_stages", "num_ctas"):
        value = options.get(name)
        if value is not None and value < (0 if name == "num_stages" else 1):
            raise ValueError(f"{name} must be {'non-negative' if name == 'num_stages' else 'at least 1'}, got {value}")


_Signature = tuple[tuple[str, str], ...]
_Constexprs = tuple[tuple[str, Any], ...]
_Attrs = tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]


def _normalize(
    name: str,
    arg_names: tuple[str, ...],
    signature: Any,
    constexprs: Any,
    attrs: Any,
) -> tuple[_Signature, _Constexprs, _Attrs]:
    if not isinstance(signature, Mapping):
        raise TypeError(f"signature must be a mapping of argument name to type, got {type(signature).__name__}")
    if constexprs is not None and not isinstance(constexprs, Mapping):
        raise TypeError(f"constexprs must be a mapping of argument name to value, got {type(constexprs).__name__}")
    constexprs = dict(constexprs or {})
    known = set(arg_names)
    for where, mapping in (("signature", signature), ("constexprs", constexprs)):
        for arg in mapping:
            if not isinstance(arg, str):
                raise TypeError(f"{where} keys must be argument names (str), got {arg!r}")
            if arg not in known:
                raise ValueError(f"{where} names {arg!r}, which is not an argument of {name}({', '.join(arg_names)})")
    full_signature = []
    for arg in arg_names:
        if arg in constexprs:
            declared = signature.get(arg)
            if declared is not None and declared != "constexpr":
                raise ValueError(f"argument {arg!r} is given as a constexpr but typed {declared!r} in the signature")
            full_signature.append((arg, "constexpr"))
            continue
        if arg not in signature:
            raise ValueError(f"missing type for argument {arg!r} of {name}: add it to signature= (or constexprs=)")
        ty = signature[arg]
        _check_type(arg, ty)
        if ty == "constexpr":
            raise ValueError(f"argument {arg!r} is typed 'constexpr' but has no value in constexprs=")
        full_signature.append((arg, ty))
    for arg, value in constexprs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise TypeError(f"the value of constexpr {arg!r} cannot be sent to a worker: {exc}") from None
    norm_attrs = []
    if attrs is not None:
        if not isinstance(attrs, Mapping):
            raise TypeError("attrs must map argument names to lists of (attribute, value) pairs")
        for arg, values in attrs.items():
            if arg not in known:
                raise ValueError(f"attrs names {arg!r}, which is not an argument of {name}")
            pairs = []
            for pair in values:
                if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
                    raise TypeError(
                        f"attrs[{arg!r}] must hold (attribute, value) pairs such as ('tt.divisibility', 16)"
                    )
                pairs.append((pair[0], pair[1]))
            norm_attrs.append((arg, tuple(pairs)))
    ordered_constexprs = tuple((arg, constexprs[arg]) for arg in arg_names if arg in constexprs)
    return tuple(full_signature), ordered_constexprs, tuple(sorted(norm_attrs))


def _key(kernel_hash: str, spec_parts: tuple[Any, ...]) -> str:
    env = tuple(sorted((k, v) for k, v in job_env().items() if k not in _ENV_NOT_IN_KEY))
    text = repr((_KEY_VERSION, kernel_hash, spec_parts, env, _installed_triton_version()))
    return hashlib.sha256(text.encode()).hexdigest()


# -- prepare: the entry point the scheduler calls ----------------------------------------------


async def prepare(
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
    options = dict(options or {})
    parsed_target = parse_target(target)
    _check_options(options, parsed_target)

    if isinstance(kernel, TritonSource):
        name, arg_names = kernel.name, kernel.arg_names
        ref: KernelRef = SourceModule(kernel.source, kernel.name, kernel.filename)
        kernel_hash = f"source:{kernel.digest}:{kernel.name}"
    else:
        if "triton" not in sys.modules:
            raise TypeError(
                f"kernel must be a @triton.jit function or aiocompile.TritonSource, got {type(kernel).__name__}"
            )
        fn = unwrap_jit(kernel)
        name, arg_names = fn.__name__, tuple(fn.arg_names)
        shipped = _ship_cache.lookup(fn)
        if shipped is None:
            shipped = await ctx.to_thread(lambda: _ship_cache.compute(fn))
        ref, kernel_hash = shipped.ref, shipped.kernel_hash

    full_signature, ordered_constexprs, norm_attrs = _normalize(name, arg_names, signature, constexprs, attrs)

    if parsed_target is None:
        parsed_target = await _current_target(ctx)
        _check_options(options, parsed_target)
    norm_options = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))
    key = _key(kernel_hash, (name, full_signature, repr(ordered_constexprs), norm_attrs, norm_options,
                             str(parsed_target), parsed_target.warp_size))
    spec = TritonSpec(ref, name, arg_names, full_signature, ordered_constexprs, norm_attrs, norm_options,
                      parsed_target, key, kernel_hash)
    return Request(
        backend="triton",
        key=key,
        name=name,
        target=str(parsed_target),
        fn=_triton_worker.compile_kernel,
        args=(spec,),
        finish=lambda artifact: TritonKernel._from_artifact(spec, artifact),
    )


async def _current_target(ctx: BackendContext) -> Target:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        # The parent already holds a device: ask it (no new driver initialisation).
        if getattr(torch.version, "hip", None):
            arch = torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName.split(":")[0]
            target = parse_target(f"hip:{arch}")
        else:
            major, minor = torch.cuda.get_device_capability()
            target = parse_target(f"cuda:{major * 10 + minor}")
        assert target is not None
        return target
    try:
        backend, arch, warp_size = await ctx.run_in_worker(_triton_worker.detect_target)
    except Exception as exc:
        raise ValueError(
            f"target=None means the current GPU, and none was found ({exc}); pass an explicit "
            "target such as 'cuda:90' or 'hip:gfx942'"
        ) from None
    return Target(backend, arch, warp_size)


# -- TritonKernel -----------------------------------------------------------------------------

_MAGIC = b"AIOCOMPILE-TRITON\n"
_FORMAT_VERSION = 1


class TritonKernel:
    """A compiled Triton kernel: its binary, its intermediate forms and its metadata.

    ``kernel[grid](*args)`` launches it on the current GPU. Pass the kernel's runtime
    arguments only (positionally, in order, or by name); constexprs were fixed at compile
    time. ``grid`` is a tuple of up to three ints or a callable taking the dict of
    arguments (constexprs included), as with Triton's own launch syntax. The binary is
    loaded on the first launch, or ahead of it with ``await kernel.load()``.

    It pickles, and ``to_bytes()`` / ``TritonKernel.from_bytes()`` give a checksummed
    byte form that any process can read, with or without a GPU.
    """

    def __init__(
        self,
        *,
        name: str,
        key: str,
        target: str,
        asm: Mapping[str, str | bytes],
        metadata_json: str,
        compile_time: float,
        arg_names: tuple[str, ...],
        signature: Mapping[str, Any],
        constexprs: Mapping[str, Any],
        triton_version: str,
        triton_hash: str,
    ) -> None:
        self.name = name
        self.key = key
        self.target = target
        self.asm = dict(asm)
        self.metadata: dict[str, Any] = json.loads(metadata_json)
        self._metadata_json = metadata_json
        self.compile_time = compile_time
        self.arg_names = tuple(arg_names)
        self.signature = dict(signature)
        self.constexprs = dict(constexprs)
        self.triton_version = triton_version
        self.triton_hash = triton_hash
        self._load_lock = threading.Lock()
        self._compiled: Any = None
        self._size: int | None = None

    @classmethod
    def _from_artifact(cls, spec: TritonSpec, artifact: Mapping[str, Any]) -> TritonKernel:
        if not isinstance(spec.kernel, SourceModule) and artifact["fn_cache_key"] != spec.kernel_hash:
            # The worker compiled other source than this process holds: a module edited on
            # disk after it was imported here, say. Its binary is not the kernel asked for.
            raise CompileError(
                "the worker compiled a different version of this kernel than the one loaded in this "
                "process (was its source file changed after it was imported?); restart to pick up the change",
                kernel_name=spec.name, key=spec.key, target=str(spec.target),
            )
        return cls(
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

    def __repr__(self) -> str:
        return f"<TritonKernel {self.name} {self.target} key={self.key[:12]} {self.binary_ext}:{len(self.binary)}B>"

    @property
    def binary_ext(self) -> str:
        return "hsaco" if "hsaco" in self.asm else "cubin"

    @property
    def binary(self) -> bytes:
        value = self.asm.get(self.binary_ext, b"")
        return value if isinstance(value, bytes) else value.encode()

    @property
    def gpu_target(self) -> Any:
        """The target as Triton's ``GPUTarget`` (imports Triton)."""
        target = parse_target(self.target)
        assert target is not None
        warp_size = int(self.metadata.get("warp_size", target.warp_size))
        return Target(target.backend, target.arch, warp_size).to_gpu_target()

    @property
    def size(self) -> int:
        """Bytes of all the artifacts (binary and intermediate forms)."""
        if self._size is None:
            self._size = sum(len(v) if isinstance(v, bytes) else len(v.encode()) for v in self.asm.values())
        return self._size

    # -- serialisation ------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        blobs: list[bytes] = []
        sections = {}
        offset = 0
        for ext, value in sorted(self.asm.items()):
            data = value if isinstance(value, bytes) else value.encode()
            sections[ext] = {"offset": offset, "length": len(data), "text": not isinstance(value, bytes)}
            blobs.append(data)
            offset += len(data)
        header = json.dumps({
            "name": self.name,
            "key": self.key,
            "target": self.target,
            "metadata_json": self._metadata_json,
            "compile_time": self.compile_time,
            "arg_names": list(self.arg_names),
            "signature": self.signature,
            "constexprs": {k: _encode_constexpr(v) for k, v in self.constexprs.items()},
            "triton_version": self.triton_version,
            "triton_hash": self.triton_hash,
            "sections": sections,
        }).encode()
        body = struct.pack("<I", len(header)) + header + b"".join(blobs)
        return _MAGIC + struct.pack("<B", _FORMAT_VERSION) + hashlib.sha256(body).digest() + body

    @classmethod
    def from_bytes(cls, data: bytes) -> TritonKernel:
        """Rebuild a kernel from :meth:`to_bytes`; raises ``ValueError`` if the bytes are
        not such a kernel, or are truncated or corrupted."""
        prefix = len(_MAGIC)
        if not data.startswith(_MAGIC) or len(data) < prefix + 1 + 32 + 4:
            raise ValueError("not an aiocompile Triton kernel")
        (version,) = struct.unpack_from("<B", data, prefix)
        if version != _FORMAT_VERSION:
            raise ValueError(f"unsupported kernel format version {version}")
        digest, body = data[prefix + 1:prefix + 33], data[prefix + 33:]
        if hashlib.sha256(body).digest() != digest:
            raise ValueError("the kernel's bytes are corrupted (checksum mismatch)")
        (header_len,) = struct.unpack_from("<I", body)
        header = json.loads(body[4:4 + header_len])
        blob = body[4 + header_len:]
        asm: dict[str, str | bytes] = {}
        for ext, section in header["sections"].items():
            raw = blob[section["offset"]:section["offset"] + section["length"]]
            asm[ext] = raw.decode() if section["text"] else raw
        return cls(
            name=header["name"],
            key=header["key"],
            target=header["target"],
            asm=asm,
            metadata_json=header["metadata_json"],
            compile_time=header["compile_time"],
            arg_names=tuple(header["arg_names"]),
            signature=header["signature"],
            constexprs={k: _decode_constexpr(v) for k, v in header["constexprs"].items()},
            triton_version=header["triton_version"],
            triton_hash=header["triton_hash"],
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (TritonKernel.from_bytes, (self.to_bytes(),))

    # -- loading and launching ------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self._compiled is not None and getattr(self._compiled, "function", None) is not None

    async def load(self) -> TritonKernel:
        """Load the binary on the current GPU and build its launcher, in a thread so that
        the event loop keeps running. Returns the kernel itself."""
        import anyio

        device = _current_device()
        await anyio.to_thread.run_sync(lambda: self._ensure_loaded(device))
        return self

    def _ensure_loaded(self, device: int | None = None) -> Any:
        with self._load_lock:
            if self._compiled is None:
                self._compiled = _rebuild_compiled_kernel(self)
            if getattr(self._compiled, "function", None) is None:
                if device is not None:
                    from triton.runtime import driver

                    driver.active.set_current_device(device)
                self._compiled._init_handles()
            return self._compiled

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, stream: Any = None, **kwargs: Any) -> None:
            compiled = self._ensure_loaded()
            full_args = self._bind(args, kwargs)
            meta = dict(zip(self.arg_names, full_args))
            dims = grid(meta) if callable(grid) else grid
            if isinstance(dims, int):
                dims = (dims,)
            dims = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
            compiled[dims](*full_args, stream=stream)

        return launch

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        runtime = [a for a in self.arg_names if a not in self.constexprs]
        if len(args) > len(runtime):
            raise TypeError(
                f"{self.name} takes {len(runtime)} runtime arguments ({', '.join(runtime)}), got {len(args)}"
            )
        values = dict(zip(runtime, args))
        for arg, value in kwargs.items():
            if arg not in runtime:
                raise TypeError(f"{self.name} has no runtime argument {arg!r}")
            if arg in values:
                raise TypeError(f"{self.name} got argument {arg!r} twice")
            values[arg] = value
        missing = [a for a in runtime if a not in values]
        if missing:
            raise TypeError(f"{self.name} is missing argument(s): {', '.join(missing)}")
        return [self.constexprs[a] if a in self.constexprs else values[a] for a in self.arg_names]


def _encode_constexpr(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return {"tuple": [_encode_constexpr(v) for v in value]}
    return {"repr": repr(value)}


def _decode_constexpr(value: Any) -> Any:
    if isinstance(value, dict):
        if "tuple" in value:
            return tuple(_decode_constexpr(v) for v in value["tuple"])
        return value["repr"]
    return value


def _current_device() -> int | None:
    try:
        from triton.runtime import driver

        return int(driver.active.get_current_device())
    except Exception:
        return None


class _LaunchFn:
    """Enough of a ``JITFunction`` for Triton's launcher: names and no launch hook."""

    def __init__(self, name: str, arg_names: tuple[str, ...]) -> None:
        self.__name__ = name
        self.arg_names = list(arg_names)
        self.launch_metadata = None


def _rebuild_compiled_kernel(kernel: TritonKernel) -> Any:
    from triton.compiler.compiler import ASTSource, CompiledKernel

    scratch = tempfile.mkdtemp(prefix="aiocompile-load-")
    try:
        group = {}
        for ext, value in kernel.asm.items():
            path = os.path.join(scratch, f"{kernel.name}.{ext}")
            with open(path, "wb") as f:
                f.write(value if isinstance(value, bytes) else value.encode())
            group[f"{kernel.name}.{ext}"] = path
        path = os.path.join(scratch, f"{kernel.name}.json")
        with open(path, "w") as f:
            f.write(kernel._metadata_json)
        group[f"{kernel.name}.json"] = path
        src = ASTSource(_LaunchFn(kernel.name, kernel.arg_names), dict(kernel.signature), dict(kernel.constexprs))
        # CompiledKernel reads every file now, so the scratch directory can go at once.
        return CompiledKernel(src, group, kernel.triton_hash)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
