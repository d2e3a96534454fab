"""What Triton's autotuner would do for one launch, worked out without launching anything.

An autotuned kernel is a chain: ``@triton.heuristics`` wrappers may sit above the
``@triton.autotune`` object and below it, and a ``@triton.jit`` function ends it. A launch
``kernel[grid](*args, **kwargs)`` runs the chain from the top: each wrapper adds keywords
and calls the next. Rather than imitate the wrappers, the plan runs Triton's own code on
copies of them whose next link records what it is given, so that

- the autotuner sees exactly the arguments it would see (the heuristics above it applied);
- its key is computed as ``Autotuner.run`` computes it (the values of the ``key``
  arguments, then the dtype of every argument that has one), and the configurations are
  pruned by Triton's own ``Autotuner.prune_configs`` (``early_config_prune``,
  ``perf_model`` and ``top_k``), on a copy so that the caller's autotuner is untouched;
- for each remaining configuration, the JIT function receives what it would receive (the
  configuration's keywords and options, the heuristics below the autotuner applied), and
  ``_warmup.plan`` specialises it as the JIT would: the very compile Triton would do.

Everything here runs in the caller's process, in a thread: the user's heuristics, pruning
functions, performance model and grid are called here, as Triton calls them at launch.
"""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
from dataclasses import dataclass, field
from typing import Any, Iterator

from aiocompile._tuning.inputs import ArgRef, InputCollector, Inputs
from aiocompile._tuning.task import Hooks
from aiocompile.backends.triton import _warmup


class _Recorder:
    """Stands for the rest of a chain: keeps what it is run with."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def run(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


@dataclass(frozen=True)
class Chain:
    """An autotuned kernel taken apart: the wrappers above the autotuner (outermost
    first), the autotuner, the wrappers below it, the JIT function."""

    outer: tuple[Any, ...]
    tuner: Any
    inner: tuple[Any, ...]
    jit: Any

    @property
    def name(self) -> str:
        return str(self.jit.__name__)


def chain_of(kernel: Any) -> Chain:
    """``kernel`` taken apart, or ``TypeError`` for what is not an autotuned Triton kernel."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        raise TypeError(
            f"autotune() takes a kernel decorated with @triton.autotune; {kernel.__name__} is a plain @triton.jit "
            "function with nothing to tune: compile its one specialisation ahead with warmup()"
        )
    links: list[Any] = []
    current = kernel
    while not isinstance(current, JITFunction):
        if not isinstance(current, (Autotuner, Heuristics)):
            what = type(current).__name__
            if links:
                raise TypeError(
                    f"autotune() understands @triton.autotune and @triton.heuristics over a @triton.jit function; "
                    f"{what} in the chain is neither"
                )
            raise TypeError(
                f"autotune() takes a kernel decorated with @triton.autotune, got {what}; for a plain @triton.jit "
                "function use warmup()"
            )
        links.append(current)
        current = current.fn
    tuners = [index for index, link in enumerate(links) if isinstance(link, Autotuner)]
    if not tuners:
        raise TypeError(
            f"autotune() takes a kernel decorated with @triton.autotune; {current.__name__} has only "
            "@triton.heuristics: its configuration follows from its arguments, so compile it ahead with warmup()"
        )
    if len(tuners) > 1:
        raise TypeError(f"{current.__name__} is autotuned twice over; autotune() takes one @triton.autotune")
    at = tuners[0]
    return Chain(tuple(links[:at]), links[at], tuple(links[at + 1:]), current)


def _through(wrappers: tuple[Any, ...], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What the link below ``wrappers`` is run with when the first of them is run with
    ``args`` and ``kwargs``: Triton's own ``run`` of each, on copies."""
    if not wrappers:
        return args, dict(kwargs)
    recorder = _Recorder()
    copies = [copy.copy(wrapper) for wrapper in wrappers]
    for upper, lower in zip(copies, [*copies[1:], recorder]):
        upper.fn = lower
    copies[0].run(*args, **kwargs)
    (call,) = recorder.calls
    return call


def tuning_key(tuner: Any, nargs: dict[str, Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The key under which ``Autotuner.run`` keeps its choice for these arguments (the
    same steps, in the same order, in the Triton versions we support)."""
    everything = {**nargs, **kwargs}
    named = {name: value for name, value in everything.items() if name in tuner.arg_names}
    key = [named[name] for name in tuner.keys if name in named]
    for value in named.values():
        if hasattr(value, "dtype"):
            key.append(str(value.dtype))
    return tuple(key)


def prune(tuner: Any, nargs: dict[str, Any], kwargs: dict[str, Any]) -> list[Any]:
    """The configurations Triton would benchmark: its own ``prune_configs``, on a copy."""
    from triton.runtime.autotuner import Autotuner

    probe = copy.copy(tuner)
    probe.nargs = nargs
    pruned = list(Autotuner.prune_configs(probe, kwargs))
    if not pruned:
        raise ValueError(f"pruning left no configuration of {tuner.base_fn.__name__} to tune (check top_k)")
    return pruned


def config_id(config: Any) -> str:
    """A configuration as stable text: its keywords and options (and its pre-hook's name)."""
    items = sorted(config.all_kwargs().items())
    hook = config.pre_hook
    hook_name = None if hook is None else f"{getattr(hook, '__module__', '?')}:{getattr(hook, '__qualname__', hook)}"
    return json.dumps({"kwargs": items, "pre_hook": hook_name}, default=repr)


def describe(config: Any) -> str:
    """A configuration as a person reads it: ``BLOCK=128, num_warps=4, num_stages=3``."""
    parts = [f"{name}={value}" for name, value in config.kwargs.items()]
    for name in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
        value = getattr(config, name, None)
        if value is not None:
            parts.append(f"{name}={value}")
    return ", ".join(parts)


@dataclass
class ConfigPlan:
    """One configuration: its compile, and its launch as a benchmark process repeats it."""

    index: int
    config: Any
    label: str
    spec: _warmup.Plan
    grid: tuple[int, int, int]
    args: tuple[ArgRef, ...]
    """The launch's arguments in parameter order (constexprs as placeholders)."""
    hook_args: tuple[tuple[str, ArgRef], ...]
    """What the hooks are given: the autotuner's arguments with the configuration's."""


@dataclass
class TuningPlan:
    """Everything an ``autotune()`` call does, worked out before anything compiles."""

    chain: Chain
    device: int
    key: tuple[Any, ...] | None
    """The autotuner's key; None when it has one configuration (nothing to tune)."""
    configs: list[ConfigPlan]
    """The configurations left after pruning, in the autotuner's order."""
    collector: InputCollector
    """The launch's tensors, whose values are read only if there is something to tune."""
    hooks: Hooks
    pruned_away: int = 0
    decision_parts: dict[str, Any] = field(default_factory=dict)
    tuner_args: tuple[Any, ...] = ()
    """What the autotuner is run with (the heuristics above it applied)."""
    tuner_kwargs: dict[str, Any] = field(default_factory=dict)
    pruned: list[Any] = field(default_factory=list)
    """The ``triton.Config`` objects left after pruning, in the autotuner's order."""

    def expand(self) -> None:
        """Specialise each configuration left (``configs``), as the JIT would."""
        for _ in self.expanding():
            pass

    def expanding(self) -> Iterator[ConfigPlan]:
        """Each configuration left, specialised as it is reached (those specialised
        before are kept in ``configs``), so that the first can compile while the others
        are specialised."""
        for index, config in enumerate(self.pruned):
            if index == len(self.configs):
                self.configs.append(self.plan_config(index, config))
            yield self.configs[index]

    def check(self) -> None:
        """Raise at once what specialising the configurations would raise for any of them
        alone (a keyword the autotuner also tunes, a pre-hook that does not pickle), so
        that the rest can be specialised while the first compile."""
        for config in self.pruned:
            self._check_config(config)

    def _check_config(self, config: Any) -> None:
        conflicts = self.tuner_kwargs.keys() & config.kwargs.keys()
        if conflicts:
            # What Triton's autotuner raises for them, here at once.
            raise ValueError(f"Conflicting meta-parameters: {', '.join(sorted(conflicts))}. Make sure that you don't "
                             "re-define auto-tuned symbols.")
        if config.pre_hook is not None:
            _pickled("configuration's pre_hook", config.pre_hook)

    def plan_config(self, index: int, config: Any) -> ConfigPlan:
        """One configuration's compile and launch (raises what the launch would raise)."""
        tuner = self.chain.tuner
        self._check_config(config)
        current = dict(self.tuner_kwargs, **config.all_kwargs())
        jit_args, jit_kwargs = _through(self.chain.inner, self.tuner_args, current)
        launch_grid = jit_kwargs.pop("grid")
        jit_kwargs.pop("warmup", None)
        spec = _warmup.plan(self.chain.jit, jit_args, jit_kwargs, device=self.device)
        dims = _grid(launch_grid, spec.bound_args)
        launch = tuple(self.collector.ref(value, constant=spec.signature.get(name) == "constexpr")
                       for name, value in spec.bound_args.items())
        full_nargs = {**dict(zip(tuner.arg_names, self.tuner_args)), **current, "grid": dims}
        hook_args = tuple((name, self.collector.ref(value, hook=True)) for name, value in full_nargs.items())
        return ConfigPlan(index, config, describe(config), spec, dims, launch, hook_args)

    def config_for(self, text: str) -> ConfigPlan | None:
        """The configuration ``config_id`` wrote as ``text``: one of those planned, or
        another of the autotuner's (a decision made where pruning kept others)."""
        for planned in self.configs:
            if config_id(planned.config) == text:
                return planned
        for config in self.chain.tuner.configs:
            if config_id(config) == text:
                return self.plan_config(len(self.configs), config)
        return None

    @property
    def name(self) -> str:
        return self.chain.name

    def read_inputs(self) -> Inputs:
        """The tensors' shapes, strides and values, for a benchmark process (blocking:
        reading a GPU tensor waits for the work queued on it)."""
        return self.collector.finish()

    @property
    def tunes(self) -> bool:
        """Whether configurations are to be benchmarked (more than one is left)."""
        return self.key is not None and len(self.pruned) > 1

    def decision_key(self, device_name: str) -> str:
        """Where a decision for this launch is kept: the kernel (its source and what it
        calls, as Triton hashes it), the autotuner's key, its configurations, the device
        model, Triton's version and the environment that changes what Triton builds."""
        text = json.dumps({**self.decision_parts, "device": device_name}, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()


def _pickled(what: str, value: Any) -> bytes:
    try:
        return pickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"the autotuner's {what} must pickle (a function defined at module level) to run in a benchmark "
            f"process: {type(exc).__name__}: {exc}"
        ) from None


DO_BENCH_DEFAULTS = (25.0, 100.0)
"""``triton.testing.do_bench``'s warm-up and repetition milliseconds: what the driver's
benchmarker (the autotuner's default) uses, and what ``warmup=``/``rep=`` left unset mean."""


def _hooks(tuner: Any) -> Hooks:
    pre = _pickled("pre_hook", tuner.pre_hook) if getattr(tuner, "user_defined_pre_hook", False) else None
    post = _pickled("post_hook", tuner.post_hook) if getattr(tuner, "user_defined_post_hook", False) else None
    timing: tuple[Any, ...] = ("default",)
    warmup, rep = DO_BENCH_DEFAULTS
    if getattr(tuner, "use_cuda_graph", False):
        timing = ("cudagraph", tuner.num_reps if tuner.num_reps is not None else int(rep))
    elif getattr(tuner, "num_warmups", None) is not None or getattr(tuner, "num_reps", None) is not None:
        timing = ("do_bench", tuner.num_warmups if tuner.num_warmups is not None else int(warmup),
                  tuner.num_reps if tuner.num_reps is not None else int(rep))
    elif tuner._do_bench is not None:
        timing = ("custom", _pickled("do_bench", tuner._do_bench))
    return Hooks(tuple(tuner.reset_to_zero), tuple(tuner.restore_value), pre, post, timing)


def _grid(grid: Any, bound_args: dict[str, Any]) -> tuple[int, int, int]:
    # As JITFunction.run does: a callable is given the bound arguments.
    dims = grid(bound_args) if callable(grid) else grid
    if isinstance(dims, int):
        dims = (dims,)
    dims = tuple(int(d) for d in dims)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"a grid has one to three dimensions, got {dims!r}")
    return (*dims, *(1,) * (3 - len(dims)))


def prepare(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grid: Any, device: int) -> TuningPlan:
    """The first half of ``plan``: the autotuner's arguments, its key and the
    configurations left after pruning, without specialising any (which is what needs
    Triton's driver). Enough to look a decision up."""
    chain = chain_of(kernel)
    tuner = chain.tuner
    # As KernelInterface.__getitem__ launches: grid and warmup are keywords from the top.
    tuner_args, tuner_kwargs = _through(chain.outer, args, {"grid": grid, "warmup": False, **kwargs})
    nargs = dict(zip(tuner.arg_names, tuner_args))
    if len(tuner.configs) > 1:
        key: tuple[Any, ...] | None = tuning_key(tuner, nargs, tuner_kwargs)
        configs = prune(tuner, nargs, tuner_kwargs)
    else:
        key, configs = None, list(tuner.configs)
    return TuningPlan(chain, device, key, [], InputCollector(), _hooks(tuner), len(tuner.configs) - len(configs),
                      _decision_parts(chain, key), tuner_args, tuner_kwargs, configs)


def plan(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grid: Any, device: int) -> TuningPlan:
    """Work out what ``kernel[grid](*args, **kwargs)`` would tune on ``device``. Raises
    what the launch would raise for arguments that do not bind, ``TypeError`` for what is
    not an autotuned kernel. Blocking (it calls the user's functions): run it in a thread."""
    found = prepare(kernel, args, kwargs, grid, device)
    found.expand()
    return found


def _decision_parts(chain: Chain, key: tuple[Any, ...] | None) -> dict[str, Any]:
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars

    return {
        "format": 1,
        "kernel": chain.jit.cache_key,
        "name": chain.name,
        "key": repr(key),
        "configs": [config_id(config) for config in chain.tuner.configs],
        "triton": triton.__version__,
        "env": sorted(get_cache_invalidating_env_vars().items()),
    }
