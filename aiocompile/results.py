"""What the compiles return, for annotations and ``isinstance``:

- :class:`TritonKernel`: ``compile_triton``, ``warmup``; launch it with ``kernel[grid](...)``;
- :class:`NativeLibrary`: ``compile_cpp``; call into it with ``lib.symbol("f")``;
- :class:`CudaBinary` and its :class:`CudaKernel`: ``compile_cuda``;
- :class:`AutotuneResult` (with a :class:`ConfigTiming` per configuration): ``autotune``.

Each pickles, and each compiled artifact has a checksummed byte form (``to_bytes()``,
``from_bytes()``). Importing this module imports neither Triton nor torch.
"""

from aiocompile._tuning.tuner import AutotuneResult, ConfigTiming
from aiocompile.backends.cpp import NativeLibrary
from aiocompile.backends.cuda import CudaBinary, CudaKernel
from aiocompile.backends.triton import TritonKernel

__all__ = [
    "AutotuneResult",
    "ConfigTiming",
    "CudaBinary",
    "CudaKernel",
    "NativeLibrary",
    "TritonKernel",
]
