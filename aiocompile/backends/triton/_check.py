"""Checking ``compile_triton``'s arguments in the caller, before any worker is involved.

Types and options are checked against tables rather than against Triton itself, so that
bad input is refused at once even where Triton is not imported yet.
"""

from __future__ import annotations

import inspect
import pickle
import re
from collections.abc import Mapping
from typing import Any

from aiocompile._base.target import Target

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

_INT32_MAX = 2**31 - 1
_BLOCK_THREADS = 1024


def check_type(arg: str, ty: Any) -> None:
    if isinstance(ty, tuple):
        for item in ty:
            check_type(arg, item)
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


def check_options(options: Mapping[str, Any], target: Target | None) -> None:
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
    if num_warps is not None:
        # A program's num_warps x warp_size threads run as one GPU block, of at most 1024
        # threads on every GPU Triton compiles for.
        warp_size = target.warp_size if target is not None else 32
        most = max(1, _BLOCK_THREADS // warp_size)
        if num_warps < 1 or num_warps & (num_warps - 1) or num_warps > most:
            where = f" for {target} (warps of {warp_size} threads)" if target is not None else ""
            raise ValueError(f"num_warps must be a power of two from 1 to {most}{where}, got {num_warps}")
    for name, value in options.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT32_MAX:
            # Triton hands integer options to its C++ passes as 32-bit ints.
            raise ValueError(f"compile option {name}={value} is out of range: at most {_INT32_MAX}")
    for name in ("num_stages", "num_ctas"):
        value = options.get(name)
        if value is not None and value < (0 if name == "num_stages" else 1):
            raise ValueError(f"{name} must be {'non-negative' if name == 'num_stages' else 'at least 1'}, got {value}")


Signature = tuple[tuple[str, str], ...]
Constexprs = tuple[tuple[str, Any], ...]
Attrs = tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]


def normalize(
    name: str,
    arg_names: tuple[str, ...],
    signature: Any,
    constexprs: Any,
    attrs: Any,
    defaulted: tuple[str, ...] = (),
) -> tuple[Signature, Constexprs, Attrs]:
    """The arguments in canonical form. ``defaulted`` names the constexpr arguments with
    a default value in the kernel's signature: one given no value is typed "constexpr"
    here and left out of the constexprs, for ``fill_defaults`` to give it its default."""
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
            if arg in defaulted:
                full_signature.append((arg, "constexpr"))
                continue
            raise ValueError(f"missing type for argument {arg!r} of {name}: add it to signature= (or constexprs=)")
        ty = signature[arg]
        check_type(arg, ty)
        if ty == "constexpr":
            if arg in defaulted:
                full_signature.append((arg, "constexpr"))
                continue
            raise ValueError(f"argument {arg!r} is typed 'constexpr' but has no value in constexprs=")
        full_signature.append((arg, ty))
    for arg, value in constexprs.items():
        _check_picklable(arg, value)
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


def constexpr_defaults(fn: Any) -> tuple[str, ...]:
    """The constexpr arguments of ``fn`` (a ``JITFunction``) that have a default value."""
    return tuple(p.name for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty)


def fill_defaults(name: str, fn: Any, signature: Signature, constexprs: Constexprs) -> Constexprs:
    """``constexprs`` and, for each constexpr argument ``normalize`` left without a value,
    its default from ``fn``'s signature: the value Triton's JIT passes for an argument a
    launch leaves out, and the one the key must hash, so that leaving it out and giving
    it are one kernel."""
    given = dict(constexprs)
    missing = [arg for arg, ty in signature if ty == "constexpr" and arg not in given]
    if not missing:
        return constexprs
    params = {p.name: p for p in fn.params}
    for arg in missing:
        param = params.get(arg)
        if param is None or not param.is_constexpr or param.default is inspect.Parameter.empty:
            # The kernel executed is not what its text said (a TritonSource whose
            # annotation names another constexpr, say).
            raise ValueError(f"missing type for argument {arg!r} of {name}: add it to signature= (or constexprs=)")
        _check_picklable(arg, param.default)
        given[arg] = param.default
    return tuple((arg, given[arg]) for arg, _ in signature if arg in given)


def _check_picklable(arg: str, value: Any) -> None:
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise TypeError(f"the value of constexpr {arg!r} cannot be sent to a worker: {exc}") from None
