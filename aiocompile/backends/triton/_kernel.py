"""TritonKernel: a compiled Triton kernel, its byte form, and launching it on a GPU."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import Any, Callable

from aiocompile._base.target import Target, parse_target

# -- TritonKernel -----------------------------------------------------------------------------

_MAGIC = b"AIOCOMPILE-TRITON\n"
_FORMAT_VERSION = 1


class TritonKernel:
    """A compiled Triton kernel: its binary, its intermediate forms and its metadata.

    ``kernel[grid](*args)`` launches it on the current GPU. Pass the kernel's runtime
    arguments only (positionally, in order, or by name); constexprs were fixed at compile
    time. ``grid`` is a tuple of up to three ints or a callable taking the dict of
    arguments (constexprs included), as with Triton's own launch syntax. The binary is
    loaded on the first launch, or ahead of it with ``await kernel.load()``.

    It pickles, and ``to_bytes()`` / ``TritonKernel.from_bytes()`` give a checksummed
    byte form that any process can read, with or without a GPU.
    """

    def __init__(
        self,
        *,
        name: str,
        key: str,
        target: str,
        asm: Mapping[str, str | bytes],
        metadata_json: str,
        compile_time: float,
        arg_names: tuple[str, ...],
        signature: Mapping[str, Any],
        constexprs: Mapping[str, Any],
        triton_version: str,
        triton_hash: str,
    ) -> None:
        self.name = name
        self.key = key
        self.target = target
        self.asm = dict(asm)
        self.metadata: dict[str, Any] = json.loads(metadata_json)
        self.metadata_json = metadata_json
        """The metadata as Triton wrote it (``metadata`` is this, parsed)."""
        self.compile_time = compile_time
        self.arg_names = tuple(arg_names)
        self.signature = dict(signature)
        self.constexprs = dict(constexprs)
        self.triton_version = triton_version
        self.triton_hash = triton_hash
        self._load_lock = threading.Lock()
        self._compiled: Any = None
        self._size: int | None = None

    def __repr__(self) -> str:
        return f"<TritonKernel {self.name} {self.target} key={self.key[:12]} {self.binary_ext}:{len(self.binary)}B>"

    @property
    def binary_ext(self) -> str:
        return "hsaco" if "hsaco" in self.asm else "cubin"

    @property
    def binary(self) -> bytes:
        value = self.asm.get(self.binary_ext, b"")
        return value if isinstance(value, bytes) else value.encode()

    @property
    def gpu_target(self) -> Any:
        """The target as Triton's ``GPUTarget`` (imports Triton)."""
        target = parse_target(self.target)
        assert target is not None
        warp_size = int(self.metadata.get("warp_size", target.warp_size))
        return Target(target.backend, target.arch, warp_size).to_gpu_target()

    @property
    def size(self) -> int:
        """Bytes of all the artifacts (binary and intermediate forms)."""
        if self._size is None:
            self._size = sum(len(v) if isinstance(v, bytes) else len(v.encode()) for v in self.asm.values())
        return self._size

    # -- serialisation ------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        blobs: list[bytes] = []
        sections = {}
        offset = 0
        for ext, value in sorted(self.asm.items()):
            data = value if isinstance(value, bytes) else value.encode()
            sections[ext] = {"offset": offset, "length": len(data), "text": not isinstance(value, bytes)}
            blobs.append(data)
            offset += len(data)
        header = json.dumps({
            "name": self.name,
            "key": self.key,
            "target": self.target,
            "metadata_json": self.metadata_json,
            "compile_time": self.compile_time,
            "arg_names": list(self.arg_names),
            "signature": self.signature,
            "constexprs": {k: _encode_constexpr(v) for k, v in self.constexprs.items()},
            "triton_version": self.triton_version,
            "triton_hash": self.triton_hash,
            "sections": sections,
        }).encode()
        body = struct.pack("<I", len(header)) + header + b"".join(blobs)
        return _MAGIC + struct.pack("<B", _FORMAT_VERSION) + hashlib.sha256(body).digest() + body

    @classmethod
    def from_bytes(cls, data: bytes) -> TritonKernel:
        """Rebuild a kernel from :meth:`to_bytes`; raises ``ValueError`` if the bytes are
        not such a kernel, or are truncated or corrupted."""
        prefix = len(_MAGIC)
        if not data.startswith(_MAGIC) or len(data) < prefix + 1 + 32 + 4:
            raise ValueError("not an aiocompile Triton kernel")
        (version,) = struct.unpack_from("<B", data, prefix)
        if version != _FORMAT_VERSION:
            raise ValueError(f"unsupported kernel format version {version}")
        digest, body = data[prefix + 1:prefix + 33], data[prefix + 33:]
        if hashlib.sha256(body).digest() != digest:
            raise ValueError("the kernel's bytes are corrupted (checksum mismatch)")
        # A checksum that matches says the bytes are as written, not that what wrote them
        # wrote a whole header: anything missing or of the wrong kind is bad bytes too.
        try:
            (header_len,) = struct.unpack_from("<I", body)
            header = json.loads(body[4:4 + header_len])
            blob = body[4 + header_len:]
            asm: dict[str, str | bytes] = {}
            for ext, section in header["sections"].items():
                raw = blob[section["offset"]:section["offset"] + section["length"]]
                asm[ext] = raw.decode() if section["text"] else raw
            return cls(
                name=header["name"],
                key=header["key"],
                target=header["target"],
                asm=asm,
                metadata_json=header["metadata_json"],
                compile_time=header["compile_time"],
                arg_names=tuple(header["arg_names"]),
                signature=header["signature"],
                constexprs={k: _decode_constexpr(v) for k, v in header["constexprs"].items()},
                triton_version=header["triton_version"],
                triton_hash=header["triton_hash"],
            )
        except (KeyError, TypeError, AttributeError, IndexError, struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"the kernel's header is incomplete or malformed ({type(exc).__name__}: {exc})") from exc

    def __reduce__(self) -> tuple[Any, ...]:
        return (TritonKernel.from_bytes, (self.to_bytes(),))

    def binary_only(self) -> TritonKernel:
        """This kernel without its intermediate forms: what loading it takes, and no more
        (a benchmark process is sent this)."""
        return TritonKernel(
            name=self.name, key=self.key, target=self.target, asm={self.binary_ext: self.asm[self.binary_ext]},
            metadata_json=self.metadata_json, compile_time=self.compile_time, arg_names=self.arg_names,
            signature=self.signature, constexprs=self.constexprs, triton_version=self.triton_version,
            triton_hash=self.triton_hash)

    # -- loading and launching ------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self._compiled is not None and getattr(self._compiled, "function", None) is not None

    async def load(self) -> TritonKernel:
        """Load the binary on the current GPU and build its launcher, in a thread so that
        the event loop keeps running. Returns the kernel itself."""
        from aiocompile._base.threads import LOADS

        device = _current_device()
        await LOADS.run(lambda: self.ensure_loaded(device))
        return self

    def ensure_loaded(self, device: int | None = None) -> Any:
        """Load the binary here and now (blocking; ``load()`` is the awaitable form) and
        return Triton's ``CompiledKernel``, handles ready."""
        with self._load_lock:
            if self._compiled is None:
                self._compiled = rebuild_compiled_kernel(self)
            if getattr(self._compiled, "function", None) is None:
                try:
                    if device is not None:
                        from triton.runtime import driver

                        driver.active.set_current_device(device)
                    self._compiled._init_handles()
                except RuntimeError as exc:
                    backend = self.target.partition(":")[0]
                    if _gpu_device_present(backend):
                        raise
                    # Triton's own words for it are "0 active drivers".
                    raise RuntimeError(
                        f"{self.name} is compiled for {self.target}: loading and launching it needs a GPU of that "
                        f"kind, and this machine has none ({exc}); its binary is kernel.binary"
                    ) from None
            return self._compiled

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, stream: Any = None, **kwargs: Any) -> None:
            compiled = self.ensure_loaded()
            full_args = self._bind(args, kwargs)
            meta = dict(zip(self.arg_names, full_args))
            dims = grid(meta) if callable(grid) else grid
            if isinstance(dims, int):
                dims = (dims,)
            dims = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
            compiled[dims](*full_args, stream=stream)

        return launch

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        runtime = [a for a in self.arg_names if a not in self.constexprs]
        if len(args) > len(runtime):
            raise TypeError(
                f"{self.name} takes {len(runtime)} runtime arguments ({', '.join(runtime)}), got {len(args)}"
            )
        values = dict(zip(runtime, args))
        for arg, value in kwargs.items():
            if arg not in runtime:
                raise TypeError(f"{self.name} has no runtime argument {arg!r}")
            if arg in values:
                raise TypeError(f"{self.name} got argument {arg!r} twice")
            values[arg] = value
        missing = [a for a in runtime if a not in values]
        if missing:
            raise TypeError(f"{self.name} is missing argument(s): {', '.join(missing)}")
        return [self.constexprs[a] if a in self.constexprs else values[a] for a in self.arg_names]


def _encode_constexpr(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return {"tuple": [_encode_constexpr(v) for v in value]}
    return {"repr": repr(value)}


def _decode_constexpr(value: Any) -> Any:
    if isinstance(value, dict):
        if "tuple" in value:
            return tuple(_decode_constexpr(v) for v in value["tuple"])
        return value["repr"]
    return value


_primed: bool | None = None


def prime_loading(backend: str) -> bool:
    """Pay this process's one-time costs of loading kernels for ``backend`` ("cuda" or
    "hip") now, if it has such a GPU: Triton's GPU driver (its imports, its small C
    helper module, the device and its context, which may import and initialise torch).

    These hold the interpreter lock for tens to hundreds of milliseconds at a time (a
    shared library's initialisation, torch's CUDA start), so whichever thread pays them
    stalls the event loop's thread; paid by ``warm()`` in a loading thread, they are not
    paid in the middle of a burst of loads. Returns whether loading is possible here."""
    global _primed
    if _primed is not None:
        return _primed
    if "torch" not in sys.modules and not _gpu_device_present(backend):
        # Triton asks torch whether there is a GPU: importing torch only to hear "no"
        # would cost a process that never uses it seconds and hundreds of MiB.
        return False
    try:
        from triton.runtime import driver

        active = driver.active
        target = active.get_current_target()
        if getattr(target, "backend", None) != backend:
            _primed = False
            return False
        device = active.get_current_device()
        active.utils.get_device_properties(device)
        active.get_current_stream(device)
    except Exception as exc:  # no GPU, or no driver for it: nothing to load on, nothing to pay
        logging.getLogger("aiocompile").debug("loading is not primed for %s: %s", backend, exc, exc_info=True)
        _primed = False
        return False
    _primed = True
    return True


def _gpu_device_present(backend: str) -> bool:
    """Whether the device files of a GPU of ``backend``'s kind exist (Linux): NVIDIA's
    ``/dev/nvidiactl``, AMD's ``/dev/kfd``. A cheap look, without loading any driver."""
    path = {"cuda": "/dev/nvidiactl", "hip": "/dev/kfd"}.get(backend)
    return path is not None and os.path.exists(path)


def _current_device() -> int | None:
    """The caller's current device, if knowing it is cheap; None otherwise.

    The current device belongs to the calling thread, so it is read here, before the load
    moves to a thread. But reading it must not be what initialises CUDA (or imports
    torch) in the event loop's thread: until this process has done so, the current device
    is the default one, which is what the loading thread gets anyway.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        return int(torch.cuda.current_device())
    except Exception:
        return None


class _LaunchFn:
    """Enough of a ``JITFunction`` for Triton's launcher: names and no launch hook."""

    def __init__(self, name: str, arg_names: tuple[str, ...]) -> None:
        self.__name__ = name
        self.arg_names = list(arg_names)
        self.launch_metadata = None


def rebuild_compiled_kernel(kernel: TritonKernel, src: Any = None) -> Any:
    """Triton's ``CompiledKernel`` for ``kernel``'s binary. ``src`` is the source it
    claims (by default one naming the kernel's arguments, enough for launching it)."""
    from triton.compiler.compiler import ASTSource, CompiledKernel

    scratch = tempfile.mkdtemp(prefix="aiocompile-load-")
    try:
        group = {}
        for ext, value in kernel.asm.items():
            path = os.path.join(scratch, f"{kernel.name}.{ext}")
            with open(path, "wb") as f:
                f.write(value if isinstance(value, bytes) else value.encode())
            group[f"{kernel.name}.{ext}"] = path
        path = os.path.join(scratch, f"{kernel.name}.json")
        with open(path, "w") as f:
            f.write(kernel.metadata_json)
        group[f"{kernel.name}.json"] = path
        if src is None:
            src = ASTSource(_LaunchFn(kernel.name, kernel.arg_names), dict(kernel.signature), dict(kernel.constexprs))
        # CompiledKernel reads every file now, so the scratch directory can go at once.
        return CompiledKernel(src, group, kernel.triton_hash)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
