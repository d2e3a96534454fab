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

Importing this module does not import torch; ``install()`` does.
"""

from aiocompile._torch.background import (
    BackgroundCompiled,
    BackgroundStatus,
    ShapeStatus,
    compile_in_background,
)
from aiocompile._torch.install import install, installed, is_installed, uninstall
from aiocompile._torch.warming import warm
from aiocompile.backends.inductor._worker import PRELOAD

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
