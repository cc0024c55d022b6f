"""The shared tiers' value format: what a node with the cluster secret
accepts, and what it refuses (no server needed)."""
from __future__ import annotations

import pytest

from kvferry.kvstore.block_value import encode_value, encode_value_into, owner_label, parse_value, value_nbytes
from kvferry.kvstore.crypto import TierCrypto
from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.conftest import SECRET, block, key

ACME = BlockOwner("acme")
PUBLIC = BlockOwner(public=True)
CRYPTO = TierCrypto(SECRET)


@pytest.mark.parametrize("owner", [ACME, PUBLIC], ids=["private", "public"])
@pytest.mark.parametrize("crypto", [CRYPTO, None], ids=["keyed", "insecure"])
def test_encode_into_matches_encode_and_parses_back(crypto, owner):
    data = block(1)
    value = encode_value(crypto, key(1), data, owner)
    assert len(value) == value_nbytes(crypto, len(data), owner)
    out = memoryview(bytearray(len(value) + 10))
    n = encode_value_into(crypto, key(1), data, owner, out)
    assert n == len(value)
    parsed = parse_value(crypto, key(1), bytes(out[:n]))
    assert parsed is not None and parsed.public == owner.public and parsed.label == owner_label(crypto, key(1), owner)
    assert parsed.sealed == (crypto is not None and not owner.public)
    if not parsed.sealed:
        assert bytes(parsed.payload) == data
    else:
        assert CRYPTO.open(key(1), "acme", parsed.payload) == data


@pytest.mark.parametrize("owner", [ACME, PUBLIC], ids=["private", "public"])
def test_a_secret_holder_refuses_unkeyed_foreign_and_moved_values(owner):
    keyed = encode_value(CRYPTO, key(1), block(1), owner)
    assert parse_value(CRYPTO, key(1), keyed) is not None
    assert parse_value(CRYPTO, key(2), keyed) is None  # bound to its block key
    assert parse_value(TierCrypto(b"another secret of 32 bytes......"), key(1), keyed) is None
    assert parse_value(None, key(1), keyed) is None  # a node without the secret cannot check it
    assert parse_value(CRYPTO, key(1), encode_value(None, key(1), block(1), owner)) is None  # unkeyed
    flipped = bytearray(keyed)
    flipped[5] ^= 2  # the sealed flag: "not sealed" (or "sealed" for a public block)
    assert parse_value(CRYPTO, key(1), bytes(flipped)) is None
    if owner.public:  # the MAC covers a public payload
        flipped = bytearray(keyed)
        flipped[-1] ^= 1
        assert parse_value(CRYPTO, key(1), bytes(flipped)) is None


def test_private_labels_differ_per_block_and_per_tenant():
    labels = {owner_label(CRYPTO, key(i), BlockOwner(t)) for i in range(4) for t in ("acme", "beta")}
    assert len(labels) == 8 and owner_label(CRYPTO, key(1), PUBLIC) == b""


def test_a_public_blocks_gmac_nonce_is_fresh_per_value_and_authenticated():
    # GMAC's key is one per secret: a nonce repeated under it would leak the
    # authentication key, so every value draws its own, and the nonce itself
    # is covered (a value with another nonce fails).
    values = [encode_value(CRYPTO, key(1), block(1), PUBLIC) for _ in range(8)]
    nonce_at = 8 + 16  # header, empty label, tag
    assert len({v[nonce_at:nonce_at + 12] for v in values}) == 8
    flipped = bytearray(values[0])
    flipped[nonce_at] ^= 1
    assert parse_value(CRYPTO, key(1), bytes(flipped)) is None
    out = memoryview(bytearray(len(values[0])))
    encode_value_into(CRYPTO, key(1), block(1), PUBLIC, out)
    assert bytes(out[nonce_at:nonce_at + 12]) not in {v[nonce_at:nonce_at + 12] for v in values}


@pytest.mark.parametrize("owner", [ACME, PUBLIC], ids=["private", "public"])
def test_a_value_of_the_previous_version_is_refused(owner):
    old = bytearray(encode_value(CRYPTO, key(1), block(1), owner))
    old[4] = 3  # version 3: a keyed BLAKE2b over a public payload
    assert parse_value(CRYPTO, key(1), bytes(old)) is None
