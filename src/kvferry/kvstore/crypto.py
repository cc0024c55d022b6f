"""Encryption at rest for the cold tiers: AES-256-GCM with per-tenant keys.

    tenant key = HKDF-SHA256(server secret, salt="kvferry kv at rest v1",
                             info="tenant:" + tenant)          (32 bytes)
    sealed     = nonce (12 random bytes) || ciphertext || tag (16 bytes)
    associated data = "kvferry-kv" || len(key) || key || tenant

The associated data binds each sealed block to its block hash and tenant:
a block copied under another key, or read with another tenant's key, fails
authentication (``open`` returns None) instead of yielding bytes. A random
96-bit nonce per write keeps the GCM nonce bound (2**32 writes per key)
far from any cache's lifetime of writes.

Private blocks are sealed on disk and in the remote tier; public blocks
(an operator-declared public prefix, shared by every tenant) stay in the
clear, still checksummed.

Tenant names never rest in a tier either: records and keys carry the
tenant's tag instead (``tenant_tag``),

    tenant tag = secret id (8 bytes) || tenant id (16 bytes)
    secret id  = HMAC-SHA256(server secret, "kvferry secret id v1")[:8]
    tenant id  = HMAC-SHA256(server secret, "kvferry tenant id v1" 0x00 tenant)[:16]

the same for a tenant across restarts with the same secret (so a
restarted tier finds, quotas and drops its blocks), unlinkable to the name
without the secret. The secret id tells a block sealed under another
secret (unreadable now) from another tenant's.

The shared tiers (Redis, the cluster pool) authenticate every value, and
name their objects opaquely (``block_value.py``, ``cluster.py``,
``remote.py``: Redis' owner part is empty, one key per block)::

    MAC key     = HMAC-SHA256(server secret, "kvferry tier mac v1")
    MAC         = keyed BLAKE2b-128(MAC key, parts...)       (small parts)
    GMAC key    = HMAC-SHA256(server secret, "kvferry tier gmac v1")
    GMAC        = AES-256-GCM tag over parts... as associated data, with a
                  random 96-bit nonce stored beside it (a public block's
                  payload: 20-40x keyed BLAKE2b's speed, with AES-NI and
                  carry-less multiply)
    object name = HMAC-SHA256(server secret, "kvferry object name v1" 0x00
                              len(owner) owner block key)[:16], in hex
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

NONCE_BYTES = 12
TAG_BYTES = 16
# Bytes a sealed block carries beyond its plaintext.
SEAL_OVERHEAD = NONCE_BYTES + TAG_BYTES

_HKDF_SALT = b"kvferry kv at rest v1"
_AD_PREFIX = b"kvferry-kv"
_SECRET_ID_LABEL = b"kvferry secret id v1"
_TENANT_ID_LABEL = b"kvferry tenant id v1\0"
_MAC_KEY_LABEL = b"kvferry tier mac v1"
_GMAC_KEY_LABEL = b"kvferry tier gmac v1"
_NAME_LABEL = b"kvferry object name v1\0"
MAC_BYTES = 16
SECRET_ID_BYTES = 8
TENANT_TAG_BYTES = SECRET_ID_BYTES + 16


def tenant_tag(crypto: "TierCrypto | None", tenant: str) -> bytes:
    """What a tier stores in place of ``tenant``'s name. Without crypto (a
    tier built without a secret: tests, tools) an unkeyed digest under an
    all-zero secret id: the name is not in the clear, but a guessed name
    can be checked against it."""
    if crypto is not None:
        return crypto.tenant_tag(tenant)
    return bytes(SECRET_ID_BYTES) + hashlib.sha256(_TENANT_ID_LABEL + tenant.encode()).digest()[:16]


def associated_data(key: bytes, tenant: str) -> bytes:
    """What a sealed block is bound to; length-prefixed so that no
    (key, tenant) pair can be split differently into another."""
    return _AD_PREFIX + struct.pack("<H", len(key)) + key + tenant.encode()


class TierCrypto:
    """Seals and opens blocks under per-tenant keys derived from one server
    secret. Thread-safe (derived keys are cached under a lock)."""

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes | bytearray) or len(secret) < 16:
            raise ValueError("secret: must hold at least 16 bytes")
        self._secret = bytes(secret)
        self._ciphers: dict[str, AESGCM] = {}
        self._tags: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.secret_id = hmac.new(self._secret, _SECRET_ID_LABEL, hashlib.sha256).digest()[:SECRET_ID_BYTES]
        # Keyed BLAKE2b for small parts (labels, names' tags): one pass, no
        # nonce to store, in the standard library; copied per value, so the
        # key's setup is done once. Bulk bytes go through ``gmac`` instead.
        self._mac = hashlib.blake2b(key=hmac.new(self._secret, _MAC_KEY_LABEL, hashlib.sha256).digest(),
                                    digest_size=MAC_BYTES)
        self._gmac_key = algorithms.AES(hmac.new(self._secret, _GMAC_KEY_LABEL, hashlib.sha256).digest())

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> TierCrypto:
        """The server secret from a file (the same one that keys the cache
        namespaces, so a restarted node can still open its disk)."""
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"secret_file: cannot read {path}: {exc.strerror or exc}") from None
        return cls(secret)

    def tenant_tag(self, tenant: str) -> bytes:
        """``TENANT_TAG_BYTES`` naming ``tenant`` at rest (module docstring)."""
        tag = self._tags.get(tenant)
        if tag is None:
            tag = self.secret_id + hmac.new(self._secret, _TENANT_ID_LABEL + tenant.encode(),
                                            hashlib.sha256).digest()[:16]
            with self._lock:
                self._tags[tenant] = tag
        return tag

    def mac(self, *parts: bytes | memoryview) -> bytes:
        """``MAC_BYTES`` authenticating ``parts`` under the secret (the
        caller length-prefixes whatever could be split two ways)."""
        h = self._mac.copy()
        for part in parts:
            h.update(part)
        return h.digest()

    def gmac(self, nonce: bytes | memoryview, *parts: bytes | memoryview) -> bytes:
        """``TAG_BYTES`` authenticating ``parts`` under the secret: GCM's tag
        with ``parts`` as associated data and nothing encrypted. For bulk
        bytes (a public block's payload), where keyed BLAKE2b runs at well
        under a GB/s. ``nonce`` (``NONCE_BYTES``, from ``new_nonce``) must
        never repeat under one secret, so it is random per value and stored
        with the tag; the caller length-prefixes what could be split two ways."""
        tagger = Cipher(self._gmac_key, modes.GCM(bytes(nonce))).encryptor()
        for part in parts:
            tagger.authenticate_additional_data(part)
        tagger.finalize()
        return tagger.tag

    @staticmethod
    def new_nonce() -> bytes:
        """A fresh random nonce for ``gmac`` (96 bits: 2**32 values per
        secret keep the chance of a repeat negligible, as for ``seal``)."""
        return os.urandom(NONCE_BYTES)

    def object_name(self, owner: bytes, key: bytes) -> str:
        """An opaque name for ``owner``'s object ``key`` in a shared store:
        without the secret, names tell neither the owner nor which objects
        share one."""
        return hmac.new(self._secret, _NAME_LABEL + bytes([len(owner)]) + owner + key,
                        hashlib.sha256).hexdigest()[:32]

    def _cipher(self, tenant: str) -> AESGCM:
        cipher = self._ciphers.get(tenant)
        if cipher is None:
            kdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=_HKDF_SALT,
                       info=b"tenant:" + tenant.encode())
            cipher = AESGCM(kdf.derive(self._secret))
            with self._lock:
                self._ciphers[tenant] = cipher
        return cipher

    def seal(self, key: bytes, tenant: str, plaintext: bytes | memoryview) -> tuple[bytes, bytes]:
        """(nonce, ciphertext || tag); the caller writes them back to back
        (two buffers, so the tier need not copy them into one)."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce, self._cipher(tenant).encrypt(nonce, plaintext, associated_data(key, tenant))

    def seal_into(self, key: bytes, tenant: str, plaintext: bytes | memoryview, out: memoryview) -> int:
        """``seal`` written into ``out`` (nonce, ciphertext, tag: at least
        ``len(plaintext) + SEAL_OVERHEAD`` bytes); returns the bytes written.
        No allocation: fresh buffers of a block's size, not AES-GCM itself,
        are most of ``seal``'s cost."""
        nonce = os.urandom(NONCE_BYTES)
        out[:NONCE_BYTES] = nonce
        end = NONCE_BYTES + len(plaintext) + TAG_BYTES
        self._cipher(tenant).encrypt_into(nonce, plaintext, associated_data(key, tenant), out[NONCE_BYTES:end])
        return end

    def open_into(self, key: bytes, tenant: str, sealed: bytes | memoryview, out: memoryview) -> bool:
        """``open`` written into ``out`` (exactly the plaintext's length);
        False when authentication fails (``out`` then holds no block)."""
        if len(sealed) < SEAL_OVERHEAD or len(sealed) - SEAL_OVERHEAD != memoryview(out).nbytes:
            return False
        view = memoryview(sealed)
        try:
            self._cipher(tenant).decrypt_into(view[:NONCE_BYTES], view[NONCE_BYTES:],
                                              associated_data(key, tenant), out)
        except InvalidTag:
            return False
        return True

    def open(self, key: bytes, tenant: str, sealed: bytes | memoryview) -> bytes | None:
        """The plaintext, or None when authentication fails (another
        tenant's key, another block key, any flipped bit)."""
        if len(sealed) < SEAL_OVERHEAD:
            return None
        view = memoryview(sealed)
        try:
            return self._cipher(tenant).decrypt(view[:NONCE_BYTES], view[NONCE_BYTES:],
                                                associated_data(key, tenant))
        except InvalidTag:
            return None
