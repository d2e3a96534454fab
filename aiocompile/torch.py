"""``torch.compile`` with aiocompile underneath.

::

    import aiocompile.torch

    sched = aiocompile.torch.install()  # or: with aiocompile.torch.installed() as sched: ...
    model = torch.compile(model)
    model(x)                            # its kernels compiled by aiocompile's workers
    sched.statistics()                  # ... and counted there
    aiocompile.torch.uninstall()

    m = aiocompile.torch.compile_in_background(model)   # eager now, compiled when ready
    await m.ready(*example_inputs); m.status()

    await aiocompile.torch.warm()       # a server's start-up: workers ready before traffic

``install()`` sends Inductor's Triton kernels and its C++ and CUDA builds to an aiocompile
scheduler: a worker that dies in a compile costs a retry of that kernel, not the whole
``torch.compile``; a per-kernel ``timeout`` kills only that kernel's worker; every kernel
compiles once across graphs and threads, and shows in ``statistics()``, ``records()`` and
the event log. Inductor generates the same kernels and gets the same kernel objects back.
``compile_in_background()`` serves a model eagerly while a worker compiles it. docs/torch.md
tells both stories whole.

Importing this module does not import torch, nor aiocompile's scheduler, pool or backends:
those are for the thread that first makes a scheduler. It imports the background compile's
own modules (a few milliseconds), so that ``compile_in_background``, called in a serving
loop, does not import them there; the other public names are imported at their first use.
"""

import importlib as _importlib
import typing as _typing

from aiocompile._torch.background import BackgroundCompiled, compile_in_background
from aiocompile._torch.states import BackgroundStatus, ShapeStatus
from aiocompile._torch.warming import warm

# The other public names -> the module that defines each, imported at first use.
_EXPORTS = {
    "PRELOAD": "aiocompile.backends.inductor._worker",
    "install": "aiocompile._torch.install",
    "installed": "aiocompile._torch.install",
    "is_installed": "aiocompile._torch.install",
    "uninstall": "aiocompile._torch.install",
}

__all__ = [
    "PRELOAD",
    "BackgroundCompiled",
    "BackgroundStatus",
    "ShapeStatus",
    "compile_in_background",
    "install",
    "installed",
    "is_installed",
    "uninstall",
    "warm",
]


def __getattr__(name: str) -> _typing.Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiocompile.torch' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if _typing.TYPE_CHECKING:
    from aiocompile._torch.install import install, installed, is_installed, uninstall
    from aiocompile.backends.inductor._worker import PRELOAD
