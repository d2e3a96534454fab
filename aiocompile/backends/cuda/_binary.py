"""CudaBinary: GPU code built by nvcc (or hipcc), its byte form, and launching its kernels.

Loading and launching go through NVIDIA's ``cuda.core`` (``pip install 'aiocompile[cuda]'``),
imported only then: a module from the binary (``ObjectCode``), its kernels, a
``launch`` on a stream. Nothing here needs a GPU until ``load()`` or a launch.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from aiocompile.backends._native import _artifact
from aiocompile.backends._native._load import _UNSET, Library

__all__ = ["CudaBinary", "CudaKernel"]

_KIND = "cuda-binary"
_EXTENSIONS = {"cubin": "cubin", "ptx": "ptx", "fatbin": "fatbin", "shared": "so", "hsaco": "hsaco"}


def _arch_number(arch: str) -> tuple[int, int, str]:
    """``sm_90a`` -> (9, 0, "a"): major, minor, and the suffix of an architecture-specific
    variant (which runs on that very architecture only)."""
    digits = arch.split("_", 1)[1]
    suffix = digits[-1] if digits[-1].isalpha() else ""
    number = digits.rstrip("af")
    return int(number[:-1]), int(number[-1]), suffix


class CudaBinary:
    """GPU code built by ``compile_cuda``: its images, how they were built (``command``,
    the compiler) and how long it took, with nvcc's phase times in ``stages``.

    ``images`` maps each image to its bytes: one per architecture for ``"cubin"`` and
    ``"ptx"`` (``images["sm_90"]``), one in all for ``"fatbin"``, ``"shared"`` and
    ``"hsaco"`` (named after the output). ``binary`` is the only image.

    On an NVIDIA GPU, ``await binary.load()`` loads it (in a thread) on the current device
    and ``binary.kernel("name")`` returns a launchable :class:`CudaKernel`; a ``"shared"``
    library is loaded into this process instead and its host functions come from
    ``symbol("name")``. Needs ``cuda-core``, imported only then.

    It pickles, and ``to_bytes()`` / ``CudaBinary.from_bytes()`` give a versioned,
    checksummed byte form; neither carries what was loaded.
    """

    def __init__(
        self,
        *,
        name: str,
        key: str,
        target: str,
        arch: Sequence[str],
        output: str,
        images: Mapping[str, bytes],
        command: str,
        compiler: str,
        compiler_version: str,
        compiler_identity: str,
        compile_time: float,
        stages: Sequence[tuple[str, float]] = (),
        diagnostics: str = "",
    ) -> None:
        self.name = name
        self.key = key
        self.target = target
        self.arch = tuple(arch)
        self.output = output
        self.images = {label: bytes(data) for label, data in images.items()}
        self.command = command
        self.compiler = compiler
        self.compiler_version = compiler_version
        self.compiler_identity = compiler_identity
        self.compile_time = compile_time
        self.stages = tuple((str(stage), float(seconds)) for stage, seconds in stages)
        self.diagnostics = diagnostics
        self._lock = threading.Lock()
        self._code: Any = None
        self._device_id: int | None = None
        self._kernels: dict[str, CudaKernel] = {}
        self._library = Library(self.images["shared"], name) if output == "shared" else None

    def __repr__(self) -> str:
        sizes = ", ".join(f"{label}:{len(data)}B" for label, data in self.images.items())
        return f"<CudaBinary {self.name} {self.target} {self.output} key={self.key[:12]} {sizes}>"

    @property
    def binary(self) -> bytes:
        """The only image; ``ValueError`` where there is one per architecture."""
        if len(self.images) != 1:
            raise ValueError(f"{self.name} holds one {self.output} per architecture ({', '.join(self.images)}): "
                             "take one from images[...]")
        return next(iter(self.images.values()))

    @property
    def binary_ext(self) -> str:
        return _EXTENSIONS[self.output]

    @property
    def ptx(self) -> str:
        """The PTX text (``output="ptx"``, one architecture)."""
        if self.output != "ptx":
            raise ValueError(f"{self.name} holds {self.output}, not PTX")
        return self.binary.decode()

    @property
    def size(self) -> int:
        return sum(len(data) for data in self.images.values())

    # -- serialisation ------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        fields = {
            "name": self.name, "key": self.key, "target": self.target, "arch": list(self.arch),
            "output": self.output, "command": self.command, "compiler": self.compiler,
            "compiler_version": self.compiler_version, "compiler_identity": self.compiler_identity,
            "compile_time": self.compile_time, "stages": [list(stage) for stage in self.stages],
            "diagnostics": self.diagnostics,
        }
        return _artifact.pack(_KIND, fields, self.images)

    @classmethod
    def from_bytes(cls, data: bytes) -> CudaBinary:
        """Rebuild a binary from :meth:`to_bytes`; ``ValueError`` if the bytes are not such
        a binary, or are truncated or corrupted."""
        fields, sections = _artifact.unpack(data, _KIND)
        try:
            return cls(images=sections, **fields)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the binary's header is incomplete or malformed ({type(exc).__name__}: {exc})") from exc

    def __reduce__(self) -> tuple[Any, ...]:
        return (CudaBinary.from_bytes, (self.to_bytes(),))

    # -- loading and launching ----------------------------------------------------------

    @property
    def loaded(self) -> bool:
        if self._library is not None:
            return self._library.loaded
        return self._code is not None

    async def load(self) -> CudaBinary:
        """Load the code on the current GPU (a ``"shared"`` library: into this process), in
        a thread, so that the event loop keeps running. Returns the binary itself.
        Cancelling the await does not stop the load."""
        from aiocompile._base.threads import LOADS

        device = _current_device()
        await LOADS.run(lambda: self._ensure_loaded(device))
        return self

    def kernel(self, name: str) -> CudaKernel:
        """The kernel ``name`` (its symbol: an ``extern "C"`` kernel's own name, else its
        mangled name), loading the code on the current GPU first if need be."""
        from aiocompile._base import checks

        checks.SYMBOL.check("name", name)
        if self.output == "shared":
            raise TypeError(f"{self.name} is a shared library: its kernels are launched by its own host code; "
                            "call that with symbol()")
        found = self._kernels.get(name)
        if found is None:
            code = self._ensure_loaded(_current_device())
            try:
                handle = code.get_kernel(name)
            except Exception as exc:
                raise AttributeError(f"{self.name} has no kernel {name!r} ({exc}); a kernel not declared "
                                     "extern \"C\" has a mangled name") from None
            assert self._device_id is not None
            found = self._kernels.setdefault(name, CudaKernel(name, handle, self._device_id))
        return found

    def symbol(self, name: str, *, restype: Any = _UNSET, argtypes: Sequence[Any] | None = None) -> Any:
        """A host function of a ``"shared"`` library, through ctypes (as
        ``NativeLibrary.symbol``)."""
        from aiocompile._base import checks

        checks.SYMBOL.check("name", name)
        if self._library is None:
            raise TypeError(f"{self.name} is a {self.output}, not a shared library: use kernel()")
        return self._library.symbol(name, restype, argtypes)

    def _ensure_loaded(self, device_id: int | None) -> Any:
        if self._library is not None:
            return self._library.handle()
        if self.target.startswith("hip:"):
            raise RuntimeError(f"{self.name} is AMD code: load it with HIP (hipModuleLoadData on binary); "
                               "aiocompile loads NVIDIA code only")
        with self._lock:
            if self._code is None:
                device, code_type = _cuda_core(), None
                dev = device.Device(device_id if device_id is not None else 0)
                dev.set_current()
                image, code_type = self._image_for(dev.compute_capability)
                make = {"cubin": device.ObjectCode.from_cubin, "ptx": device.ObjectCode.from_ptx,
                        "fatbin": device.ObjectCode.from_fatbin}[code_type]
                code = make(image, name=self.name)
                getattr(code, "handle", None)  # loads it now, not at the first launch
                self._code, self._device_id = code, int(dev.device_id)
            return self._code

    def _image_for(self, capability: Any) -> tuple[bytes, str]:
        """The image to load on a GPU of this compute capability, and its kind."""
        if self.output == "fatbin":
            return self.images["fatbin"], "fatbin"
        major, minor = int(capability[0]), int(capability[1])
        fits = []
        for label, data in self.images.items():
            a_major, a_minor, suffix = _arch_number(label)
            if suffix and (a_major, a_minor) != (major, minor):
                continue
            # Machine code runs on its own major architecture (same or later minor); PTX
            # is compiled by the driver for any later GPU.
            if (self.output == "cubin" and a_major == major and a_minor <= minor) or \
                    (self.output == "ptx" and (a_major, a_minor) <= (major, minor)):
                fits.append(((a_major, a_minor), label, data))
        if not fits:
            raise RuntimeError(f"{self.name} has no {self.output} for this GPU (sm_{major}{minor}): it was built for "
                               f"{', '.join(self.arch)}")
        _, label, data = max(fits)
        return data, self.output


class CudaKernel:
    """A kernel of a loaded :class:`CudaBinary`, ready to launch:
    ``kernel[grid, block](*args)`` or ``kernel.launch(grid, block, *args)``.

    ``grid`` and ``block`` are ints or tuples of up to three. Arguments: tensors (anything
    with ``data_ptr()``, as torch tensors) go as their device pointers; Python ints and
    floats are sized from the kernel's own parameters (a ``float`` parameter gets a 32-bit
    float, an ``int`` a 32-bit int, a ``double``/``long`` 64 bits), as the driver reports
    them; numpy scalars and ctypes values go as they are. The launch goes on ``stream``:
    by default torch's current stream where torch has started CUDA, else the device's
    default stream. It is asynchronous, as every kernel launch.
    """

    def __init__(self, name: str, handle: Any, device_id: int) -> None:
        self.name = name
        self.handle = handle
        self.device_id = device_id
        self._sizes: tuple[int, ...] | None = None
        try:
            self._sizes = tuple(int(getattr(info, "size", None) or info[1]) for info in handle.arguments_info)
        except Exception:  # a driver too old to say (CUDA < 12.4): sizes are then guessed
            self._sizes = None

    def __repr__(self) -> str:
        return f"<CudaKernel {self.name} on device {self.device_id}>"

    def __getitem__(self, config: Any) -> Any:
        if not isinstance(config, tuple) or len(config) != 2:
            raise TypeError(f"launch {self.name} as kernel[grid, block](*args), got kernel[{config!r}]")
        grid, block = config

        def launch(*args: Any, shared_mem: int = 0, stream: Any = None) -> None:
            self.launch(grid, block, *args, shared_mem=shared_mem, stream=stream)

        return launch

    def launch(self, grid: Any, block: Any, *args: Any, shared_mem: int = 0, stream: Any = None) -> None:
        core = _cuda_core()
        core.Device(self.device_id).set_current()
        config = core.LaunchConfig(grid=grid, block=block, shmem_size=shared_mem)
        core.launch(_stream(core, stream, self.device_id), config, self.handle, *self._arguments(args))

    def _arguments(self, args: tuple[Any, ...]) -> list[Any]:
        sizes = self._sizes
        if sizes is not None and len(args) != len(sizes):
            raise TypeError(f"{self.name} takes {len(sizes)} arguments, got {len(args)}")
        out: list[Any] = []
        for index, value in enumerate(args):
            size = sizes[index] if sizes is not None else None
            if hasattr(value, "data_ptr"):
                out.append(ctypes.c_uint64(int(value.data_ptr())))
            elif isinstance(value, bool):
                out.append(ctypes.c_bool(value))
            elif isinstance(value, int):
                out.append(_integer(value, size or 8))
            elif isinstance(value, float):
                out.append(_floating(value, size or 4))
            else:
                out.append(value)
        return out


def _integer(value: int, size: int) -> Any:
    signed = {1: ctypes.c_int8, 2: ctypes.c_int16, 4: ctypes.c_int32, 8: ctypes.c_int64}
    unsigned = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32, 8: ctypes.c_uint64}
    bits = 8 * size if size in signed else 64
    if -(1 << (bits - 1)) <= value < (1 << (bits - 1)):
        return signed.get(size, ctypes.c_int64)(value)
    if 0 <= value < (1 << bits):
        return unsigned.get(size, ctypes.c_uint64)(value)
    raise OverflowError(f"{value} does not fit in the kernel's {size}-byte parameter")


def _floating(value: float, size: int) -> Any:
    if size == 8:
        return ctypes.c_double(value)
    if size == 2:
        import numpy

        return numpy.float16(value)
    return ctypes.c_float(value)


def _stream(core: Any, stream: Any, device_id: int) -> Any:
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            stream = torch.cuda.current_stream(device_id)
        else:
            return core.Device(device_id).default_stream
    handle = getattr(stream, "cuda_stream", None)  # a torch stream
    if handle is None and isinstance(stream, int):
        handle = stream
    if handle is not None:
        return core.LEGACY_DEFAULT_STREAM if int(handle) == 0 else core.Stream.from_handle(int(handle))
    return stream


def _cuda_core() -> Any:
    try:
        import cuda.core as core
    except ImportError as exc:
        raise RuntimeError("loading and launching CUDA code needs cuda-core (pip install 'aiocompile[cuda]'): "
                           f"{exc}") from exc
    return core


def _current_device() -> int | None:
    """The caller's current device where knowing it is cheap (torch has started CUDA
    here); None otherwise, which means device 0."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        return int(torch.cuda.current_device())
    except Exception:
        return None
