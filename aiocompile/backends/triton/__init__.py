"""The Triton backend: ``compile_triton`` arguments -> a worker compile -> a ``TritonKernel``.

- ``_backend``: checking a request, how its kernel travels, its key (Triton's own);
- ``_check``: argument and option checks; ``_ship``: how a kernel reaches a worker (by
  reference, or its source and the globals it reads);
- ``_worker``: what a worker runs (the compile, its stage times, warm-up);
- ``_kernel``: ``TritonKernel``, the artifact: bytes, loading and launching;
- ``_warmup``: what Triton's JIT would compile for a launch, and priming it.
"""

from aiocompile.backends.triton._backend import TritonBackend, TritonSource, TritonSpec
from aiocompile.backends.triton._kernel import TritonKernel

__all__ = ["TritonBackend", "TritonKernel", "TritonSource", "TritonSpec"]
