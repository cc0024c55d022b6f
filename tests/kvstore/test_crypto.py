"""AES-GCM at rest: per-tenant keys, bound to block key and tenant."""
from __future__ import annotations

import os

import pytest

from kvferry.kvstore.crypto import SEAL_OVERHEAD, TierCrypto

SECRET = b"0123456789abcdef0123456789abcdef"


def sealed(crypto: TierCrypto, key: bytes, tenant: str, data: bytes) -> bytes:
    nonce, body = crypto.seal(key, tenant, data)
    return nonce + body


def test_round_trip_is_bit_exact_and_hides_the_plaintext():
    crypto = TierCrypto(SECRET)
    data = os.urandom(4096)
    blob = sealed(crypto, b"k" * 32, "acme", data)
    assert len(blob) == len(data) + SEAL_OVERHEAD
    assert data[:64] not in blob
    assert crypto.open(b"k" * 32, "acme", blob) == data


def test_another_tenant_or_another_block_key_fails_authentication():
    crypto = TierCrypto(SECRET)
    blob = sealed(crypto, b"k" * 32, "acme", b"private kv bytes")
    assert crypto.open(b"k" * 32, "beta", blob) is None
    assert crypto.open(b"j" * 32, "acme", blob) is None  # moved to another key
    # Another server secret derives other keys.
    assert TierCrypto(b"another secret of 32 bytes......").open(b"k" * 32, "acme", blob) is None
    flipped = bytearray(blob)
    flipped[20] ^= 1
    assert crypto.open(b"k" * 32, "acme", bytes(flipped)) is None
    assert crypto.open(b"k" * 32, "acme", blob[:10]) is None


def test_tenant_and_key_cannot_be_split_differently():
    crypto = TierCrypto(SECRET)
    blob = sealed(crypto, b"ab", "c", b"x")
    assert crypto.open(b"a", "bc", blob) is None


def test_every_write_draws_a_fresh_nonce():
    crypto = TierCrypto(SECRET)
    first, second = (sealed(crypto, b"k", "acme", b"same") for _ in range(2))
    assert first[:12] != second[:12] and first != second


def test_secret_is_validated_and_read_from_a_file(tmp_path):
    with pytest.raises(ValueError, match="secret"):
        TierCrypto(b"short")
    with pytest.raises(ValueError, match="secret_file"):
        TierCrypto.from_file(tmp_path / "missing")
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    blob = sealed(TierCrypto(SECRET), b"k", "acme", b"x")
    assert TierCrypto.from_file(tmp_path / "secret").open(b"k", "acme", blob) == b"x"
