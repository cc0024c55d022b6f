"""How a KV block is stored in a shared tier (Redis, the Mooncake pool):
one self-authenticating value, so that every rule of ``tier.py`` holds the
same way wherever the bytes live::

    header (magic, version, flags, label length) | label | tag | [nonce] | payload

Anyone who reaches the server can write a value, so a node with the cluster
secret (``crypto``) accepts only values that a holder of the secret wrote
for this block key (flag ``keyed``):

* a private block's payload is sealed with its tenant's AES-GCM key
  (``crypto.py``: the GCM tag binds the payload to the block key and the
  tenant); ``tag`` is a MAC of the block key, header and tenant tag;
* a public block's ``tag`` is a GMAC (``TierCrypto.gmac``) of the block
  key, header, tenant tag and payload, under a random ``nonce`` stored
  before the payload.

``label`` names the owner: empty for a public block; for a private one a
MAC of the tenant's tag and the block key, which the tenant's readers
recompute but which differs per block, so that a stranger reading values
learns neither whose they are nor which belong together; that MAC is keyed
BLAKE2b-128 (``TierCrypto.mac``), over a few dozen bytes. Either way one
pass over the payload, at AES-GCM's speed: a sealed payload is covered by
its GCM tag, not hashed again, and a public one by its GMAC.
A private block that is not sealed, a value without the ``keyed`` flag or
of another version is refused.

Without a secret (``--insecure-shared-tier``) ``label`` is the tenant's
(unkeyed) tag, ``tag`` an unkeyed xxh3-128 checksum of the same four parts
and private blocks rest unsealed: it
catches torn values, not forged ones, and such a node refuses keyed values
(it cannot check them). Version 4: a public block's GMAC and nonce
(version 3 had a keyed BLAKE2b over its payload, at a fifth of the pool's
bandwidth); a value of another version fails ``parse_value``.
"""
from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

import xxhash

from kvferry.kvstore.crypto import MAC_BYTES, NONCE_BYTES, SEAL_OVERHEAD, TENANT_TAG_BYTES, TierCrypto, tenant_tag
from kvferry.kvstore.tier import BlockOwner

_MAGIC = b"KVFR"
_VERSION = 4
_HEADER = struct.Struct("<4sBBH")
_KEY_LEN = struct.Struct("<H")
_TAG_BYTES = MAC_BYTES  # xxh3-128 and GCM's tag are as long
_FLAG_PUBLIC = 1
_FLAG_SEALED = 2
_FLAG_KEYED = 4
_LABEL_DOMAIN = b"kvferry owner label v1\0"


@dataclass(slots=True)
class BlockValue:
    """A value that authenticated (or checksummed, without a secret); the
    views point into the value read."""

    public: bool
    sealed: bool
    label: memoryview  # ``owner_label`` ("" for a public block)
    payload: memoryview  # the block's bytes, sealed when ``sealed``


def owner_label(crypto: TierCrypto | None, key: bytes, owner: BlockOwner) -> bytes:
    """What a value of ``owner``'s block ``key`` carries to name its owner
    (module docstring)."""
    if owner.public:
        return b""
    if crypto is None:
        return tenant_tag(None, owner.tenant)
    return crypto.mac(_LABEL_DOMAIN, crypto.tenant_tag(owner.tenant), key)  # the tag's length is fixed


def _header(crypto: TierCrypto | None, owner: BlockOwner, tenant_len: int) -> tuple[bytes, bool]:
    sealed = crypto is not None and not owner.public
    flags = (_FLAG_PUBLIC if owner.public else 0) | (_FLAG_SEALED if sealed else 0) | (_FLAG_KEYED if crypto else 0)
    return _HEADER.pack(_MAGIC, _VERSION, flags, tenant_len), sealed


def encode_value(crypto: TierCrypto | None, key: bytes, data: bytes | memoryview, owner: BlockOwner,
                 head: bytes = b"") -> bytes:
    """The value, after ``head`` (what a tier keeps before it: Redis' purge
    tag) in the same buffer: a block is copied once."""
    tenant = owner_label(crypto, key, owner)
    header, sealed = _header(crypto, owner, len(tenant))
    if sealed:
        nonce, sealed_payload = crypto.seal(key, owner.tenant, data)
        tag = _tag(crypto, sealed, key, header, tenant, None, b"")
        return b"".join((head, header, tenant, tag, nonce, sealed_payload))
    nonce = _new_nonce(crypto, owner.public)
    return b"".join((head, header, tenant, _tag(crypto, sealed, key, header, tenant, data, nonce), nonce, data))


def value_nbytes(crypto: TierCrypto | None, data_nbytes: int, owner: BlockOwner) -> int:
    """The length of ``encode_value``'s result for a block of ``data_nbytes``."""
    sealed = crypto is not None and not owner.public
    label_nbytes = 0 if owner.public else MAC_BYTES if crypto is not None else TENANT_TAG_BYTES
    return (_HEADER.size + label_nbytes + _TAG_BYTES + _nonce_nbytes(crypto is not None, owner.public)
            + data_nbytes + (SEAL_OVERHEAD if sealed else 0))


def encode_value_into(crypto: TierCrypto | None, key: bytes, data: bytes | memoryview, owner: BlockOwner,
                      out: memoryview) -> int:
    """``encode_value`` written into ``out`` (at least ``value_nbytes``
    bytes: a transfer buffer); returns the bytes written. The payload is
    sealed or copied straight into place, and the tag taken there."""
    tenant = owner_label(crypto, key, owner)
    header, sealed = _header(crypto, owner, len(tenant))
    nonce_at = _HEADER.size + len(tenant) + _TAG_BYTES
    nonce = b"" if sealed else _new_nonce(crypto, owner.public)
    payload_at = nonce_at + len(nonce)
    if sealed:
        end = payload_at + crypto.seal_into(key, owner.tenant, data, out[payload_at:])
    else:
        end = payload_at + len(data)
        out[payload_at:end] = memoryview(data).cast("B")
    out[:_HEADER.size] = header
    out[_HEADER.size:_HEADER.size + len(tenant)] = tenant
    out[nonce_at:payload_at] = nonce
    out[_HEADER.size + len(tenant):nonce_at] = _tag(crypto, sealed, key, header, tenant, out[payload_at:end], nonce)
    return end


def parse_value(crypto: TierCrypto | None, key: bytes, value: bytes | memoryview) -> BlockValue | None:
    """The value's parts, or None when it is torn, forged, unauthenticated
    where a secret is held, or of another version. A sealed payload is
    opened (and so authenticated) by the caller."""
    view = memoryview(value)
    body = _HEADER.size
    if len(view) < body:
        return None
    magic, version, flags, tenant_len = _HEADER.unpack_from(view)
    public, sealed, keyed = bool(flags & _FLAG_PUBLIC), bool(flags & _FLAG_SEALED), bool(flags & _FLAG_KEYED)
    nonce_at = body + tenant_len + _TAG_BYTES
    payload_at = nonce_at + _nonce_nbytes(keyed, public)
    if magic != _MAGIC or version != _VERSION or len(view) < payload_at:
        return None
    # A secret's holder writes every value keyed, and every private one
    # sealed (public ones never); a node without one writes neither.
    if keyed != (crypto is not None) or sealed != (keyed and not public):
        return None
    tenant, payload = view[body:body + tenant_len], view[payload_at:]
    tag = _tag(crypto, sealed, key, view[:body], tenant, payload, view[nonce_at:payload_at])
    if not hmac.compare_digest(tag, view[body + tenant_len:nonce_at]):
        return None
    return BlockValue(public, sealed, tenant, payload)


def is_public(value: bytes | memoryview) -> bool:
    """Whether a value ``parse_value`` accepted is a public block's."""
    return bool(memoryview(value)[5] & _FLAG_PUBLIC)  # the header's flags byte


def _nonce_nbytes(keyed: bool, public: bool) -> int:
    """The nonce before the payload: a keyed public block's GMAC needs one
    (a sealed payload carries its own)."""
    return NONCE_BYTES if keyed and public else 0


def _new_nonce(crypto: TierCrypto | None, public: bool) -> bytes:
    return crypto.new_nonce() if crypto is not None and public else b""


def _tag(crypto: TierCrypto | None, sealed: bool, key: bytes, header, tenant, payload, nonce) -> bytes:
    if crypto is not None:
        # The key length first: (key, header) cannot be split another way.
        key_len = _KEY_LEN.pack(len(key))
        if sealed:
            return crypto.mac(key_len, key, header, tenant)
        return crypto.gmac(nonce, key_len, key, header, tenant, payload)
    h = xxhash.xxh3_128()
    for part in (key, header, tenant, payload):
        h.update(part)
    return h.digest()
