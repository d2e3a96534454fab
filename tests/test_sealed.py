"""The signed envelope of cache entries: what verifies, and everything that does not."""

import pytest

from aiocompile._cache.sealed import MAGIC, BadSeal, NotSealed, SealError, payload, seal, unseal

SECRET = b"the build's secret"
DATA = b"AIOCOMPILE-TRITON\n" + bytes(range(256)) * 8
NAME = "ab" * 32


def test_a_sealed_entry_opens_with_its_secret_under_its_name():
    sealed = seal(DATA, SECRET, NAME)
    assert sealed.startswith(MAGIC) and sealed.endswith(DATA)
    assert unseal(sealed, SECRET, NAME) == DATA
    assert payload(sealed) == DATA  # a reader without the secret gets the bytes, unverified


def test_another_secret_another_name_or_any_changed_byte_is_a_bad_seal():
    sealed = seal(DATA, SECRET, NAME)
    with pytest.raises(BadSeal):
        unseal(sealed, b"another secret", NAME)
    with pytest.raises(BadSeal):
        unseal(sealed, SECRET, "cd" * 32)  # copied to another key's place
    for index in (len(MAGIC), len(MAGIC) + 1, len(MAGIC) + 20, len(sealed) - 1, len(sealed) // 2):
        changed = sealed[:index] + bytes([sealed[index] ^ 1]) + sealed[index + 1:]
        with pytest.raises(BadSeal):
            unseal(changed, SECRET, NAME)
    with pytest.raises(BadSeal):
        unseal(sealed[:len(MAGIC) + 10], SECRET, NAME)  # truncated inside the envelope
    with pytest.raises(BadSeal):
        unseal(sealed[:-1], SECRET, NAME)


def test_an_entry_without_an_envelope_is_not_sealed():
    with pytest.raises(NotSealed):
        unseal(DATA, SECRET, NAME)
    with pytest.raises(NotSealed):
        unseal(b"", SECRET, NAME)
    assert payload(DATA) == DATA  # entries written without a secret stay readable
    assert issubclass(NotSealed, SealError) and issubclass(BadSeal, SealError)
    assert issubclass(SealError, ValueError)


def test_the_secret_must_be_bytes_and_not_empty():
    for bad in (b"", "text", None):
        with pytest.raises(TypeError):
            seal(DATA, bad, NAME)
        with pytest.raises(TypeError):
            unseal(seal(DATA, SECRET, NAME), bad, NAME)
