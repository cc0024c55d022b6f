from __future__ import annotations

import pytest

from kvferry.kvstore.crypto import TierCrypto

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def crypto() -> TierCrypto:
    return TierCrypto(SECRET)


def block(i: int, nbytes: int = 6000) -> bytes:
    """Deterministic block bytes (distinct per i)."""
    rng = __import__("random").Random(i)
    return rng.randbytes(nbytes)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like a block hash
