"""The byte form of native artifacts (``NativeLibrary``, ``CudaBinary``): versioned and
checksummed, as ``TritonKernel.to_bytes`` is, and what the disk cache stores.

::

    b"AIOCOMPILE-NATIVE\\n"    magic
    u8                        format version (1)
    32 bytes                  SHA-256 of everything after it
    u32 (little-endian)       length of the header
    header                    JSON: {"kind": ..., "fields": {...}, "sections": {name: [offset, length]}}
    sections                  the binaries, one after the other

``kind`` says which artifact the bytes are (``"cpp-library"``, ``"cuda-binary"``), so that
the bytes of one are never read as the other. ``fields`` holds the artifact's plain values
(names, command line, compiler, times), ``sections`` its binaries, by name.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from typing import Any

__all__ = ["pack", "unpack"]

_MAGIC = b"AIOCOMPILE-NATIVE\n"
_FORMAT_VERSION = 1
_PREFIX = len(_MAGIC) + 1 + 32


def pack(kind: str, fields: Mapping[str, Any], sections: Mapping[str, bytes]) -> bytes:
    offsets: dict[str, list[int]] = {}
    offset = 0
    for name, data in sections.items():
        offsets[name] = [offset, len(data)]
        offset += len(data)
    header = json.dumps({"kind": kind, "fields": dict(fields), "sections": offsets}).encode()
    body = b"".join([struct.pack("<I", len(header)), header, *sections.values()])
    return _MAGIC + struct.pack("<B", _FORMAT_VERSION) + hashlib.sha256(body).digest() + body


def unpack(data: bytes, kind: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """``(fields, sections)`` of bytes made by :func:`pack` for ``kind``; ``ValueError``
    for bytes that are not such an artifact, or are truncated or corrupted."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data.startswith(_MAGIC) or len(data) < _PREFIX + 4:
        raise ValueError("not an aiocompile native artifact")
    version = data[len(_MAGIC)]
    if version != _FORMAT_VERSION:
        raise ValueError(f"unsupported native artifact format version {version}")
    digest, body = data[len(_MAGIC) + 1:_PREFIX], data[_PREFIX:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("the artifact's bytes are corrupted (checksum mismatch)")
    # A matching checksum says the bytes are as written, not that a whole header was
    # written: anything missing or of the wrong kind is bad bytes too.
    try:
        (length,) = struct.unpack_from("<I", body)
        header = json.loads(body[4:4 + length])
        blob = body[4 + length:]
        if header["kind"] != kind:
            raise ValueError(f"these bytes hold a {header['kind']!r}, not a {kind!r}")
        sections = {}
        for name, (start, size) in header["sections"].items():
            if start < 0 or size < 0 or start + size > len(blob):
                raise ValueError(f"section {name!r} lies outside the artifact")
            sections[name] = blob[start:start + size]
        fields = header["fields"]
        if not isinstance(fields, dict):
            raise TypeError("fields is not a mapping")
        return fields, sections
    except (KeyError, TypeError, AttributeError, IndexError, struct.error, UnicodeDecodeError,
            json.JSONDecodeError) as exc:
        raise ValueError(f"the artifact's header is incomplete or malformed ({type(exc).__name__}: {exc})") from exc
