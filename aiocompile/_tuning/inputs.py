"""A launch's tensors, carried to a benchmark process.

A benchmark process times each configuration on tensors of its own, on its own device,
never on the caller's. They must be what the caller's are to the kernel:

- the same dtype, shape and strides, and the same offset into their storage: views of one
  storage stay views of one buffer there (so tensors that alias still alias), and each
  pointer keeps its alignment (``ptr % 16`` decides Triton's specialisation, so a kernel
  compiled for aligned pointers is timed on aligned pointers);
- the same values: a kernel's speed may follow its data (indices it gathers, a mask, the
  zeros ``reset_to_zero`` asks for), and a gather with made-up indices could fault.
  Values are read once per tuning, a storage's covered bytes at a time.

``ArgRef`` says where an argument comes from: ``("view", i)``, the i-th tensor;
``("value", v)``, a plain value sent as it is; ``("none",)``, nothing (a constexpr, which
the compiled kernel ignores, or a value a hook is given that cannot be sent).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

ArgRef = tuple[Any, ...]
NONE: ArgRef = ("none",)
_ALIGN = 256


@dataclass(frozen=True)
class View:
    """One tensor, as a view of one of the buffers."""

    buffer: int
    dtype: str
    """torch's name for it, without ``torch.``: ``float16``."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """In elements, from the buffer's start."""


@dataclass(frozen=True)
class Inputs:
    """The bytes of each storage the launch reads or writes (the part its tensors cover),
    and each tensor as a view of them."""

    buffers: tuple[Any, ...]
    """Each storage's bytes: ``bytes``, or in a benchmark process views of shared memory."""
    views: tuple[View, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(buffer) for buffer in self.buffers)


SHARE_ABOVE = 1 << 20
"""Inputs of more bytes than this go through shared memory rather than the pipe."""
_SHARED_DIRECTORY = "/dev/shm"


@dataclass(frozen=True)
class SharedInputs:
    """``Inputs`` whose bytes wait in a file of shared memory (``/dev/shm``), written
    once by the parent and mapped by each benchmark process: a tuning's tensors (often
    hundreds of MiB) are not pickled, sent through a pipe and unpickled for each."""

    path: str
    spans: tuple[tuple[int, int], ...]
    """(offset, size) of each buffer in the file."""
    views: tuple[View, ...]

    def open(self) -> Inputs:
        """The inputs, their buffers views of a private mapping of the file (read where
        they are used, copied only by the device)."""
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        whole = memoryview(mapping) if mapping is not None else memoryview(bytearray())
        return Inputs(tuple(whole[offset:offset + length] for offset, length in self.spans), self.views)


def share(inputs: Inputs) -> Inputs | SharedInputs:
    """``inputs`` as they travel to benchmark processes: in shared memory where they are
    large and there is some, else as they are."""
    if inputs.nbytes <= SHARE_ABOVE or not os.path.isdir(_SHARED_DIRECTORY):
        return inputs
    try:
        fd, path = tempfile.mkstemp(prefix="aiocompile-inputs-", dir=_SHARED_DIRECTORY)  # private to this user
    except OSError:  # not writable here: through the pipe
        return inputs
    spans = []
    try:
        with os.fdopen(fd, "wb") as f:
            offset = 0
            for buffer in inputs.buffers:
                f.write(buffer)
                spans.append((offset, len(buffer)))
                offset += len(buffer)
    except OSError:  # no room there: through the pipe
        unshare(path)
        return inputs
    return SharedInputs(path, tuple(spans), inputs.views)


def unshare(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


class InputCollector:
    """Collects the tensors of a launch (by identity) as its arguments are described."""

    def __init__(self) -> None:
        self._tensors: list[Any] = []
        self._index: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._tensors)

    def ref(self, value: Any, *, constant: bool = False, hook: bool = False) -> ArgRef:
        """Where ``value`` comes from in a benchmark process. A launch argument that is
        neither a tensor nor a value that pickles raises ``TypeError``; a hook's is left
        out (``("none",)``)."""
        if _torch_tensor(value):
            index = self._index.get(id(value))
            if index is None:
                index = self._index[id(value)] = len(self._tensors)
                self._tensors.append(value)
            return ("view", index)
        if constant:
            return NONE
        if hasattr(value, "data_ptr"):
            if hook:
                return NONE
            raise TypeError(f"autotune() benchmarks with torch tensors; cannot carry a {type(value).__name__} "
                            "to a benchmark process")
        try:
            pickle.dumps(value)
        except Exception:
            if hook:
                return NONE
            raise TypeError(f"autotune() cannot carry the argument {value!r} to a benchmark process: it does not "
                            "pickle") from None
        return ("value", value)

    def finish(self) -> Inputs:
        """Read the tensors: shapes, strides, and the covered bytes of each storage.
        Blocking (a GPU tensor's bytes are copied to this host)."""
        if not self._tensors:
            return Inputs((), ())
        import torch

        groups: dict[tuple[int, str], list[int]] = {}
        for index, tensor in enumerate(self._tensors):
            if tensor.layout is not torch.strided:
                raise TypeError(f"autotune() benchmarks with strided tensors, got one with layout {tensor.layout}")
            key = (tensor.untyped_storage().data_ptr(), str(tensor.device))
            groups.setdefault(key, []).append(index)
        buffers: list[bytes] = []
        views: list[View | None] = [None] * len(self._tensors)
        with torch.no_grad():
            for members in groups.values():
                first = self._tensors[members[0]]
                storage = first.untyped_storage()
                base = storage.data_ptr()
                spans = [_span(self._tensors[i]) for i in members]
                # From a 256-byte boundary, so that each pointer keeps its alignment there.
                low = max(base, min(start for start, _ in spans) & ~(_ALIGN - 1))
                high = max(end for _, end in spans)
                size = max(0, high - low)
                raw = torch.empty(0, dtype=torch.uint8, device=first.device)
                raw.set_(storage, low - base, (size,), (1,))
                host = raw.cpu().contiguous()
                data = ctypes.string_at(host.data_ptr(), size) if size else b""
                for i in members:
                    tensor = self._tensors[i]
                    views[i] = View(len(buffers), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                                    tuple(tensor.stride()), (tensor.data_ptr() - low) // tensor.element_size())
                buffers.append(data)
        return Inputs(tuple(buffers), tuple(v for v in views if v is not None))


def _span(tensor: Any) -> tuple[int, int]:
    """The bytes a tensor covers, as addresses: [start, end)."""
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (last + 1) * tensor.element_size()


def rebuild(inputs: Inputs, device: str) -> list[Any]:
    """The tensors on ``device`` (in a benchmark process): a buffer per storage, holding
    its bytes, and each tensor a view of its buffer."""
    import torch

    buffers = []
    for data in inputs.buffers:
        buffer = torch.zeros(max(len(data), _ALIGN), dtype=torch.uint8, device=device)
        if len(data):
            # A writable view (of a private mapping) is read in place; bytes are copied.
            source = data if isinstance(data, memoryview) and not data.readonly else bytearray(data)
            buffer[:len(data)].copy_(torch.frombuffer(source, dtype=torch.uint8))
        buffers.append(buffer)
    tensors = []
    for view in inputs.views:
        dtype = getattr(torch, view.dtype)
        tensor = torch.empty(0, dtype=dtype, device=device)
        tensor.set_(buffers[view.buffer].untyped_storage(), view.offset, view.shape, view.stride)
        tensors.append(tensor)
    return tensors


def resolve(ref: ArgRef, tensors: list[Any]) -> Any:
    """The value an ``ArgRef`` stands for, given the rebuilt tensors."""
    kind = ref[0]
    if kind == "view":
        return tensors[ref[1]]
    if kind == "value":
        return ref[1]
    return None
