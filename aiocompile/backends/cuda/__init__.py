"""The CUDA backend (and ROCm's, through hipcc): ``compile_cuda`` arguments -> nvcc in a
worker -> a ``CudaBinary``.

- ``_backend``: checking a request, its command lines and its key;
- ``_worker``: what a worker runs (nvcc or hipcc, in a scratch directory, and nvcc's phase
  times);
- ``_binary``: ``CudaBinary``, the artifact: images, loading, launching (``CudaKernel``).

What it shares with the C++ backend is in ``backends._native``.
"""

from aiocompile.backends.cuda._backend import CudaBackend, CudaSpec
from aiocompile.backends.cuda._binary import CudaBinary, CudaKernel

__all__ = ["CudaBackend", "CudaBinary", "CudaKernel", "CudaSpec"]
