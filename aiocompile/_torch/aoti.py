"""An AOTInductor package loaded with torch's C++ loader, without importing Inductor.

``torch._inductor.aoti_load_package`` imports Inductor (and Dynamo with it) to compare the
device information the package recorded with this process's, a comparison whose only
outcome is a log line; on the CPU that information includes Inductor's vector-ISA check,
which builds a test program per instruction set and loads each in a fresh interpreter.
A serving process that loads what its own workers built on the same machine needs
neither, and paying them there costs it seconds of CPU and, importing several hundred
thousand objects, full garbage collections that hold the interpreter lock for a tenth of a
second each, beside the eager calls it is answering.

:func:`load` hands the file to ``torch._C._aoti.AOTIModelPackageLoader`` and calls it as
Inductor's ``AOTICompiledModel`` does: the inputs flattened by the package's own call
spec (read once here, not at each call), its tensors passed to ``boxed_run``. Where this
torch has no such loader, it falls back to Inductor's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["PackageRunner", "load"]

MODEL_NAME = "model"
"""The name AOTInductor gives the one model of a package it builds."""


class PackageRunner:
    """A loaded package: ``get_constant_fqns()``, ``load_constants()`` and calls, as
    Inductor's ``AOTICompiledModel`` offers them."""

    def __init__(self, loader: Any) -> None:
        import torch
        from torch.utils import _pytree as pytree

        self._pytree = pytree
        self._tensor = torch.Tensor
        self._loader = loader
        in_spec, out_spec = (pytree.treespec_loads(spec) for spec in loader.get_call_spec())
        self._out_spec = out_spec
        self._kwarg_names = _kwarg_names(in_spec)

    def get_constant_fqns(self) -> list[str]:
        return list(self._loader.get_constant_fqns())

    def load_constants(self, constants: Mapping[str, Any], *, check_full_update: bool,
                       user_managed: bool = False) -> None:
        """Give the package its constants; with ``user_managed`` it keeps pointers to these
        tensors (the caller keeps them alive) rather than copies."""
        self._loader.load_constants(dict(constants), False, check_full_update, user_managed)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ordered = {name: kwargs[name] for name in self._kwarg_names if name in kwargs}
        if len(ordered) != len(kwargs):
            unknown = sorted(set(kwargs) - set(ordered))
            raise TypeError(f"the compiled package takes no keyword argument {', '.join(map(repr, unknown))}")
        leaves = self._pytree.tree_leaves((args, ordered))
        outputs = self._loader.boxed_run([leaf for leaf in leaves if isinstance(leaf, self._tensor)])
        return self._pytree.tree_unflatten(outputs, self._out_spec)


def load(path: str, device_index: int = -1) -> Any:
    """The package at ``path``, loaded for ``device_index`` (-1: the CPU): a
    :class:`PackageRunner`, or Inductor's own loaded model where this torch's C++ loader
    cannot be called as expected."""
    import torch

    loader_type = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader_type is not None:
        try:
            loader = loader_type(path, MODEL_NAME, False, 1, device_index)
        except TypeError:  # another signature: Inductor knows this torch's
            loader = None
        if loader is not None:
            return PackageRunner(loader)
    import torch._inductor

    return torch._inductor.aoti_load_package(path, device_index=device_index)


def _kwarg_names(in_spec: Any) -> list[str]:
    """The keyword arguments' names, in the order the package takes them: the context of
    the second child of its ``(args, kwargs)`` spec."""
    children = in_spec.children() if callable(getattr(in_spec, "children", None)) else in_spec.children_specs
    if len(children) != 2 or children[1].context is None:
        return []
    return list(children[1].context)
