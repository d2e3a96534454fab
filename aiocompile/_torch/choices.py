"""The choices a background compile takes (``compile_in_background``'s ``mode``,
``artifact`` and ``options``), checked, and what they come to: the form the worker builds,
Inductor's settings for the compile."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ARTIFACTS", "MODES", "check_options", "form_for", "inductor_configs", "model_device", "worker_idle"]

MODES = (None, "default", "max-autotune", "max-autotune-no-cudagraphs")
"""``mode=`` values: Inductor's own settings for the mode, less CUDA graphs (the compiled
version is not run under CUDA graph trees)."""


ARTIFACTS = ("auto", "package", "python")


def form_for(artifact: str) -> str:
    """What ``artifact`` asks the worker to build: ``"auto"`` is the Python form, what
    ``torch.compile`` runs, on a GPU and on the CPU."""
    return "python" if artifact == "auto" else artifact


def worker_idle(device: str, configured: bool) -> bool:
    """Whether a background compile's processes for a model on ``device`` run under
    ``SCHED_IDLE``: ``configured`` (the scheduler configuration's ``worker_idle``) where the
    environment names it, else for the CPU only, whose eager calls share the CPUs with them."""
    from aiocompile._base.config import named_in_env

    return configured if "worker_idle" in named_in_env() else device == "cpu"


def model_device(model: Any) -> str:
    """Where the model's weights are, ``"cuda"`` or ``"cpu"``: what its workers warm up for."""
    for tensor in (*model.parameters(), *model.buffers()):
        return "cuda" if tensor.device.type == "cuda" else "cpu"
    return "cpu"


def check_options(options: Mapping[str, Any]) -> None:
    """``options`` checked against the settings Inductor has (the one part of the
    constructor that imports Inductor, and only when options are given)."""
    from torch._inductor import config

    known = set(config.get_config_copy())
    for name in options:
        if not isinstance(name, str):
            raise TypeError(f"options keys must be str (Inductor setting names), got {name!r}")
        if name not in known:
            raise ValueError(f"options names an Inductor setting that does not exist: {name!r}")


def inductor_configs(torch: Any, mode: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """Inductor's settings for ``mode`` (less CUDA graphs), or ``options`` (checked)."""
    if mode in (None, "default"):
        return options
    import torch._inductor

    chosen = dict(torch._inductor.list_mode_options(mode))
    return {name: value for name, value in chosen.items() if "cudagraph" not in name}
