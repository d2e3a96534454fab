"""A signed envelope around a cache entry: HMAC-SHA256 over the whole of it.

A cache tier (a directory, or a store shared over the network) keeps whatever bytes a
backend encodes for a key. Those bytes carry their own checksum, which detects damage and
nothing more: whoever can write to the tier can write a kernel of their own with a checksum
to match, and every process reading the tier would load it. With a secret shared by the
processes that build a cache and those that read it, each entry is sealed when written, and
an entry whose seal is missing or does not match is never used. Writing to the tier then no
longer means putting code into its readers.

Layout::

    MAGIC  b"AIOCOMPILE-SEALED\\n"
    1 byte version (1)
    32 bytes tag = HMAC-SHA256(secret, MAGIC | version | len(name) | name | payload)
    payload  the backend's bytes, as they are

``name`` is the key the entry is stored under. It is signed but not stored: a sealed entry
copied to another key's place does not verify there, whatever the backend's bytes say.

The envelope belongs to the cache tier, not to a backend's format, so that every tier and
every backend seal alike. Unsealed entries (written without a secret) stay readable by a
reader without one (``payload``), who must then trust the tier by other means.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from typing import Any, Callable

MAGIC = b"AIOCOMPILE-SEALED\n"
_VERSION = 1
_TAG = hashlib.sha256().digest_size
_HEADER = len(MAGIC) + 1 + _TAG


class SealError(ValueError):
    """An entry whose seal does not vouch for it: never use it. Stays inside the cache tier,
    which treats it as a miss."""


class NotSealed(SealError):
    """The entry carries no seal: written without a secret, or not an entry at all."""


class BadSeal(SealError):
    """The entry's seal does not match: another secret sealed it, or its bytes (or the key
    it is stored under) changed since; or the envelope itself is damaged."""


class Undecodable(ValueError):
    """The entry's bytes are not a result the backend can read, or hold another key's:
    damaged, or written by an incompatible version. Its cause says why."""


def wrap(data: bytes, secret: bytes | None, name: str) -> bytes:
    """What a cache tier stores for ``data`` under ``name``: sealed with ``secret``, or as
    it is without one."""
    return data if secret is None else seal(data, secret, name)


def open_entry(blob: bytes, secret: bytes | None, name: str, decode: Callable[[bytes], Any]) -> tuple[Any, float]:
    """The result in an entry stored under ``name``, and the seconds ``decode`` took.

    Every tier reads its entries through this: with ``secret`` the seal is verified first
    (``NotSealed``, ``BadSeal``); without, a sealed entry's data is read unverified. Then
    the backend's own checksummed form is decoded, and must hold ``name``'s result
    (``Undecodable`` otherwise, whatever ``decode`` raised)."""
    data = payload(blob) if secret is None else unseal(blob, secret, name)
    started = time.perf_counter()
    try:
        result = decode(data)
        if getattr(result, "key", name) != name:
            raise ValueError("the entry holds another key's result")
    except Exception as exc:
        raise Undecodable(f"{type(exc).__name__}: {exc}") from exc
    return result, time.perf_counter() - started


def seal(data: bytes, secret: bytes, name: str) -> bytes:
    """``data`` in an envelope signed with ``secret``, to be stored under ``name``."""
    _check_secret(secret)
    return MAGIC + struct.pack("<B", _VERSION) + _tag(secret, _VERSION, name, data) + data


def unseal(blob: bytes, secret: bytes, name: str) -> bytes:
    """The bytes ``seal(data, secret, name)`` sealed, once the seal is verified.

    Raises ``NotSealed`` for a blob without an envelope, and ``BadSeal`` for one whose tag
    does not match (compared in constant time) or whose envelope is damaged."""
    _check_secret(secret)
    version, tag, data = _split(blob)
    if not hmac.compare_digest(tag, _tag(secret, version, name, data)):
        raise BadSeal("the seal does not match: signed with another key, or changed since")
    return data


def looks_sealed(head: bytes) -> bool:
    """Whether an entry starting with ``head`` (its first ``len(MAGIC)`` bytes, or all of
    it if shorter) carries an envelope: one that does not is refused without reading on."""
    return head.startswith(MAGIC)


def payload(blob: bytes) -> bytes:
    """What a blob holds, unverified: the data of a sealed entry, or the blob itself when
    it has no envelope. For a reader without the secret, who trusts the tier otherwise."""
    if not blob.startswith(MAGIC):
        return blob
    return _split(blob)[2]


def _split(blob: bytes) -> tuple[int, bytes, bytes]:
    if not blob.startswith(MAGIC):
        raise NotSealed("the entry is not sealed")
    if len(blob) < _HEADER:
        raise BadSeal("the seal is truncated")
    (version,) = struct.unpack_from("<B", blob, len(MAGIC))
    if version != _VERSION:
        raise BadSeal(f"unsupported seal version {version}")
    return version, blob[len(MAGIC) + 1:_HEADER], blob[_HEADER:]


def _tag(secret: bytes, version: int, name: str, data: bytes) -> bytes:
    encoded = name.encode()
    mac = hmac.new(secret, MAGIC + struct.pack("<BI", version, len(encoded)) + encoded, hashlib.sha256)
    mac.update(data)
    return mac.digest()


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes) or not secret:
        raise TypeError("the secret must be non-empty bytes")
