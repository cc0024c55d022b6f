"""Chained block hashes: the identity of a KV block is its content.

``hash(block i) = sha256(parent = hash(block i-1), token ids of block i,
extra keys)``. Extra keys carry the model fingerprint, the KV dtype and the
cache namespace (the tenant, as the server sees it); the namespace also
seeds the chain's root, so two namespaces share no key at any depth.

A chain may start in the public namespace (a declared public prefix) and
continue privately::

    root(public) -> b0 [public] -> b1 [public] -> b2 [tenant] -> b3 [tenant]
                    '-- wholly inside the prefix --'  '-- any other token, and after --'

Private blocks are keyed by the tenant's namespace, so a block past the
boundary never matches across tenants even though its parent is shared. Every field is tagged and
length-prefixed, so no value of one field can be mistaken for another (a
LoRA name can never collide with a namespace). sha256 with no seed gives the
same key on every process and node, unlike Python's ``hash``.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

# CacheScope is a wire type (types/cache_scope.py); re-exported for the chains built from it.
from kvferry.types.cache_scope import CacheScope  # noqa: F401

BlockHash = bytes

ROOT_PARENT: BlockHash = hashlib.sha256(b"kvferry-root-v1").digest()


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Everything besides tokens that changes what a block's KV holds."""

    model_fingerprint: str = ""
    namespace: str = ""
    kv_dtype: str = ""  # "": the model's own (one dtype per pool)

    def encode(self) -> bytes:
        return (_tagged(b"model", self.model_fingerprint.encode()) + _tagged(b"ns", self.namespace.encode())
                + _tagged(b"kvdtype", self.kv_dtype.encode()))


@dataclass(frozen=True, slots=True)
class ChainKeys:
    """Everything that keys one request's chain besides its tokens."""

    root: BlockHash
    private_extra: bytes
    public_extra: bytes = b""
    num_public_blocks: int = 0

    @classmethod
    def of(cls, scope: CacheScope, model_fingerprint: str = "", kv_dtype: str = "") -> "ChainKeys":
        def extra(ns: str) -> bytes:
            return ExtraKeys(model_fingerprint, ns, kv_dtype).encode()

        return cls(
            root=chain_root(scope.namespace_of(0)),
            private_extra=extra(scope.namespace),
            public_extra=extra(scope.public_namespace) if scope.num_public_blocks else b"",
            num_public_blocks=scope.num_public_blocks,
        )

    def extra(self, block_index: int) -> bytes:
        return self.public_extra if block_index < self.num_public_blocks else self.private_extra


def chain_root(namespace: str) -> BlockHash:
    """The parent of a chain's first block. The empty namespace keeps the
    plain root (one tenant, as before namespaces existed)."""
    if not namespace:
        return ROOT_PARENT
    return hashlib.sha256(_tagged(b"root", ROOT_PARENT) + _tagged(b"ns", namespace.encode())).digest()


def _tagged(tag: bytes, value: bytes) -> bytes:
    return tag + b":" + len(value).to_bytes(8, "little") + value


def hash_block(parent: BlockHash, token_ids: list[int], extra: bytes) -> BlockHash:
    tokens = array("q", token_ids).tobytes()  # int64 little-endian on x86/arm
    h = hashlib.sha256()
    h.update(_tagged(b"parent", parent))
    h.update(_tagged(b"tokens", tokens))
    h.update(_tagged(b"extra", extra))
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: list[int], block_size: int, keys: ChainKeys | bytes
) -> None:
    """Append the hashes of every newly full block of ``token_ids`` to ``hashes``.

    ``hashes`` already covers the first ``len(hashes)`` blocks; this makes it
    cover all ``len(token_ids) // block_size`` full blocks. ``keys``: the
    request's ChainKeys, or one encoded ExtraKeys for every block (plain root).
    """
    if isinstance(keys, bytes):
        keys = ChainKeys(ROOT_PARENT, keys)
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else keys.root
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], keys.extra(i))
        hashes.append(parent)
