"""A compiled version the worker built, loaded in the serving process and bound to the
model's own weights, without a copy.

What the worker sends back (``export.build_package``'s answer) is the compiled version in
one of two forms and the constants made during tracing; the weights stay the serving
model's own:

- the Python form (``graph``): Inductor's artifact, called with the model's parameters and
  buffers by name, and the traced constants;
- a package (``aoti``): written to a file for torch's C++ loader, which unpacks what it
  needs, then given the same tensors with ``user_managed`` (it keeps pointers to them).

Weights changed in place later (``load_state_dict``, an optimizer step) are what the
compiled version uses. Called in a thread of the background lane, never the caller's.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from aiocompile._torch import ahead, thread_plans


def load(model: Any, answer: Mapping[str, Any], device_index: int,
         timeout: float | None) -> tuple[Any, dict[str, Any]]:
    """The compiled version in ``answer``, loaded for ``device_index`` (-1: the CPU) and
    bound to ``model``'s tensors: its runner and the constants it was given (the caller
    keeps them alive). Waits at most ``timeout`` seconds for what the form's load needs
    made ahead (``ahead``)."""
    import torch

    from aiocompile._torch import aoti, export, graph

    form = answer["form"]
    ahead.wait(form, timeout)
    own = export.model_tensors(model)
    extra = torch.load(io.BytesIO(answer["extra_constants"]), weights_only=True)
    device = torch.device("cpu") if device_index < 0 else torch.device("cuda", device_index)
    if form == "python":
        plan = answer["plan"]
        constants = {name: own[name].detach() if kind == "weight" else extra[name].to(device)
                     for kind, name in plan.inputs if kind != "input"}
        return graph.load(answer["artifact"], plan, constants, answer.get("codes")), constants
    fd, path = tempfile.mkstemp(prefix="aiocompile-", suffix=".pt2")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(answer["package"])
        runner = aoti.load(path, device_index)
    finally:
        os.unlink(path)  # the loader has unpacked what it needs
    constants = {name: own[name].detach() if name in own else extra[name].to(device)
                 for name in answer["constants"]}
    runner.load_constants(constants, check_full_update=True, user_managed=True)
    return runner, constants


def first_call(runner: Any, inputs: bytes) -> list[thread_plans.Prime]:
    """Call a freshly loaded Python form once, here, with a copy of the inputs it was
    compiled for (``inputs``, as the job carried them), and drop what it returns. Returns
    the GPU convolutions it made, for the serving thread to make their plans of its own
    ahead (``thread_plans``).

    Its first call does what Inductor's runtime and Triton leave to it (each kernel's
    binary loaded on the GPU, its launcher made): made by the first call the serving
    process answers with it, that held the caller's thread, an event loop's on a server,
    for 30 to 110 ms on a GPU host. Made only when the worker's trial found that a call
    leaves the model as it was (it was in eval mode, its buffers and parameters
    unchanged), so that this call changes nothing the serving process can see."""
    import torch

    args, kwargs = torch.load(io.BytesIO(inputs), weights_only=True)
    with torch.no_grad(), thread_plans.recording("cuda") as primes:
        runner(*args, **kwargs)
    return primes
