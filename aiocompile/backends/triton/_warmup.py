"""Warming Triton's JIT for launch code that stays as it is.

Serving code launches kernels the ordinary way, ``add_kernel[grid](x, y, out, n,
BLOCK=1024)``. The first launch with a new specialisation compiles in the calling thread.
``warmup()`` moves that compile into the pool ahead of time:

1. **Specialise** exactly as the JIT would for those arguments, with Triton's own code:
   the binder Triton builds per kernel (argument types, divisibility by 16 of pointers
   and integers, integers equal to 1 and ``None`` made constants), then
   ``JITFunction._pack_args`` (options, signature, constexprs, attributes) and
   ``compute_cache_key`` (the key of the JIT's in-process cache). For the current device
   that is the very binder the JIT uses; for an explicit target, one built the same way
   for that target. The keywords ``JITFunction.run`` adds before binding (``debug`` and
   the instrumentation knobs) are added the same way.
2. **Compile** that specialisation in the pool, like any ``compile_triton`` request: the
   attributes go in the JIT's order, so the key is the hash Triton itself gives it.
3. **Prime** the JIT's cache for the current device: a ``CompiledKernel`` made from the
   compiled binary, with the JIT function itself as its source, goes under the JIT's key,
   and its binary is loaded and its launcher built (in a thread). The next ordinary launch
   with such arguments finds it and compiles nothing: Triton's ``jit_cache_hook`` is not
   even called.

Nested (tuple) arguments with constant members cannot be expressed as a
``compile_triton`` request and are refused.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from aiocompile._base.target import Target, parse_target
from aiocompile.backends.triton._targets import check_target

_PRIME_LOCK = threading.Lock()


def jit_function(kernel: Any) -> Any:
    """The ``JITFunction`` behind ``kernel``, or ``TypeError``."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    inner = getattr(kernel, "fn", None)
    if isinstance(inner, JITFunction):
        raise TypeError(
            f"warmup() takes a plain @triton.jit function; {type(kernel).__name__} around "
            f"{inner.__name__} chooses its configuration at launch time (warm each configuration's "
            "specialisation with compile_triton instead)"
        )
    raise TypeError(f"warmup() takes a @triton.jit function, got {type(kernel).__name__}")


def jit_run_keywords(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords as ``JITFunction.run`` has them when it binds the arguments: it sets
    ``debug`` and, in the Triton versions that have them, the instrumentation knobs."""
    from triton import knobs

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    return kwargs


@dataclass
class Plan:
    """One specialisation of a JIT function, as its JIT sees it and as a request."""

    fn: Any
    target: Target
    device: int | None
    """The current device whose JIT cache is primed; None for an explicit target."""
    jit_key: str
    """The key of the JIT's in-process cache."""
    signature: dict[str, Any]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]
    """The compile options among the keywords (as the JIT binder returns them)."""
    bound_args: dict[str, Any] = field(default_factory=dict, repr=False)
    """Every parameter and its value, in order, as the JIT binds them: what a callable
    grid is given, and what the launch passes to the compiled kernel."""

    def request(self) -> dict[str, Any]:
        """``compile_triton``'s keyword arguments for this specialisation."""
        names = self.fn.arg_names
        for path in list(self.constexprs) + list(self.attrs):
            if len(path) != 1:
                raise NotImplementedError(
                    f"argument {names[path[0]]!r} of {self.fn.__name__} is a tuple with specialised members; "
                    "warmup() cannot express that as a compile request"
                )
        return {
            "signature": dict(self.signature),
            "constexprs": {names[path[0]]: value for path, value in self.constexprs.items()},
            "attrs": {names[path[0]]: [tuple(pair) for pair in value] for path, value in self.attrs.items()},
            "target": self.target,
            **self.options,
        }


def plan(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any = None,
         device: int | None = None) -> Plan:
    """Specialise ``kernel`` for a launch with ``args`` and ``kwargs`` (see the module
    docstring). With ``target=None`` this asks the GPU driver for the current device, or
    specialises for ``device`` where one is given (the JIT keeps a cache per device)."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import MockTensor, compute_cache_key, create_function_from_signature

    fn = jit_function(kernel)
    args = tuple(MockTensor.wrap_dtype(arg) for arg in args)  # as JITFunction.warmup does
    kwargs = jit_run_keywords(fn, kwargs)
    parsed = parse_target(target)
    if parsed is None:
        from triton.runtime import driver

        try:
            if device is None:
                device = int(driver.active.get_current_device())
            _, kernel_key_cache, gpu_target, backend, binder = fn.device_caches[device]
        except RuntimeError as exc:  # Triton's "0 active drivers": no GPU here
            raise ValueError(
                f"target=None means the current GPU, whose JIT warmup() primes, and Triton found none ({exc}); "
                "pass an explicit target such as 'cuda:90' to compile without priming"
            ) from None
        parsed = parse_target(gpu_target)
        assert parsed is not None
    else:
        device = None  # an explicit target: no device's cache to prime
        check_target(parsed)
        backend = make_backend(parsed.to_gpu_target())
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        kernel_key_cache = {}
    try:
        bound_args, specialization, options = binder(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{fn.__name__}: {exc}") from None
    from triton import knobs

    inspection = getattr(knobs.runtime, "add_stages_inspection_hook", None)
    if inspection is not None:
        raise NotImplementedError("warmup() does not support Triton's add_stages_inspection_hook")
    jit_key = compute_cache_key(kernel_key_cache, specialization, options)
    _, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return Plan(fn, parsed, device, jit_key, dict(signature), dict(constexprs), dict(attrs), dict(options),
                dict(bound_args))


def prime(plan: Plan, kernel: Any, *, load: bool = True) -> Any:
    """Put ``kernel`` (a ``TritonKernel`` compiled from ``plan.request()``) into the JIT's
    cache for ``plan.device`` under the JIT's key, and, with ``load``, load its binary and
    build its launcher now. Returns the ``CompiledKernel`` the JIT will launch. Blocking:
    run it in a thread."""
    from triton.compiler.compiler import ASTSource

    from aiocompile.backends.triton._kernel import rebuild_compiled_kernel

    if plan.device is None:
        raise ValueError("a specialisation for an explicit target has no JIT cache to prime")
    if kernel.triton_hash != kernel.key:  # pragma: no cover - checked when it was compiled
        raise ValueError("the kernel's binary does not match its key")
    src = ASTSource(plan.fn, dict(plan.signature), dict(plan.constexprs), dict(plan.attrs))
    compiled = rebuild_compiled_kernel(kernel, src)
    if load:
        from triton.runtime import driver

        driver.active.set_current_device(plan.device)
        compiled._init_handles()
    kernel_cache = plan.fn.device_caches[plan.device][0]
    with _PRIME_LOCK:
        # A launch that compiled it meanwhile keeps its own.
        return kernel_cache.setdefault(plan.jit_key, compiled)
