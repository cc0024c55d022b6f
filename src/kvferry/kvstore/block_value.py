"""How a KV block is stored in a shared cold tier (Redis, the Mooncake
pool): one self-checking value, so that every rule of ``tier.py`` holds the
same way wherever the bytes live::

    header (magic, version, flags, tenant tag length) | tenant tag | checksum | payload

The checksum (xxh3-128 over the block key, header, tag and payload) catches
a torn or foreign value; a private block's payload is sealed with its
tenant's AES-GCM key (``crypto.py``) and its tenant is stored as a tag, never
by name. Version 2: a tenant tag where version 1 held the name (a version-1
value fails ``parse_value`` and is deleted by the tier that reads it).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvferry.kvstore.crypto import SEAL_OVERHEAD, TENANT_TAG_BYTES, TierCrypto, tenant_tag
from kvferry.kvstore.tier import BlockOwner

_MAGIC = b"KVFR"
_VERSION = 2
_HEADER = struct.Struct("<4sBBH")
_CHECKSUM_BYTES = 16
_FLAG_PUBLIC = 1
_FLAG_SEALED = 2


@dataclass(slots=True)
class BlockValue:
    """A value whose checksum holds; the views point into the value read."""

    public: bool
    sealed: bool
    tenant: memoryview  # the tenant tag ("" for a public block)
    payload: memoryview  # the block's bytes, sealed when ``sealed``


def encode_value(crypto: TierCrypto | None, key: bytes, data: bytes | memoryview, owner: BlockOwner) -> bytes:
    sealed = crypto is not None and not owner.public
    payload = b"".join(crypto.seal(key, owner.tenant, data)) if sealed else data
    tenant = b"" if owner.public else tenant_tag(crypto, owner.tenant)
    header = _HEADER.pack(_MAGIC, _VERSION, (_FLAG_PUBLIC if owner.public else 0) | (_FLAG_SEALED if sealed else 0),
                          len(tenant))
    return b"".join((header, tenant, _checksum(key, header, tenant, payload), payload))


def value_nbytes(crypto: TierCrypto | None, data_nbytes: int, owner: BlockOwner) -> int:
    """The length of ``encode_value``'s result for a block of ``data_nbytes``."""
    sealed = crypto is not None and not owner.public
    return (_HEADER.size + (0 if owner.public else TENANT_TAG_BYTES) + _CHECKSUM_BYTES + data_nbytes
            + (SEAL_OVERHEAD if sealed else 0))


def encode_value_into(crypto: TierCrypto | None, key: bytes, data: bytes | memoryview, owner: BlockOwner,
                      out: memoryview) -> int:
    """``encode_value`` written into ``out`` (at least ``value_nbytes``
    bytes: a transfer buffer); returns the bytes written. The payload is
    sealed or copied straight into place, and the checksum taken there."""
    sealed = crypto is not None and not owner.public
    tenant = b"" if owner.public else tenant_tag(crypto, owner.tenant)
    header = _HEADER.pack(_MAGIC, _VERSION, (_FLAG_PUBLIC if owner.public else 0) | (_FLAG_SEALED if sealed else 0),
                          len(tenant))
    payload_at = _HEADER.size + len(tenant) + _CHECKSUM_BYTES
    if sealed:
        end = payload_at + crypto.seal_into(key, owner.tenant, data, out[payload_at:])
    else:
        end = payload_at + len(data)
        out[payload_at:end] = memoryview(data).cast("B")
    out[:_HEADER.size] = header
    out[_HEADER.size:_HEADER.size + len(tenant)] = tenant
    out[_HEADER.size + len(tenant):payload_at] = _checksum(key, header, tenant, out[payload_at:end])
    return end


def parse_value(key: bytes, value: bytes) -> BlockValue | None:
    """The value's parts, or None when it is torn, foreign or of another version."""
    view = memoryview(value)
    body = _HEADER.size
    if len(view) < body:
        return None
    magic, version, flags, tenant_len = _HEADER.unpack_from(view)
    payload_at = body + tenant_len + _CHECKSUM_BYTES
    if magic != _MAGIC or version != _VERSION or len(view) < payload_at:
        return None
    tenant, payload = view[body:body + tenant_len], view[payload_at:]
    if _checksum(key, view[:body], tenant, payload) != view[body + tenant_len:payload_at]:
        return None
    return BlockValue(bool(flags & _FLAG_PUBLIC), bool(flags & _FLAG_SEALED), tenant, payload)


def _checksum(key: bytes, header, tenant, payload) -> bytes:
    h = xxhash.xxh3_128()
    for part in (key, header, tenant, payload):
        h.update(part)
    return h.digest()
