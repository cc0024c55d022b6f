"""Chained block hashes: the identity of a KV block is its content.

``hash(block i) = sha256(parent = hash(block i-1), token ids of block i,
extra keys)``. Extra keys carry the model fingerprint and the cache
namespace (the tenant, as the server sees it). Every field is tagged and
length-prefixed, so no value of one field can be mistaken for another (a
LoRA name can never collide with a namespace). sha256 with no seed gives the
same key on every process and node, unlike Python's ``hash``.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

BlockHash = bytes

ROOT_PARENT: BlockHash = hashlib.sha256(b"kvferry-root-v1").digest()


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Everything besides tokens that changes what a block's KV holds."""

    model_fingerprint: str = ""
    namespace: str = ""

    def encode(self) -> bytes:
        return _tagged(b"model", self.model_fingerprint.encode()) + _tagged(b"ns", self.namespace.encode())


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
    hashes: list[BlockHash], token_ids: list[int], block_size: int, extra: bytes
) -> None:
    """Append the hashes of every newly full block of ``token_ids`` to ``hashes``.

    ``hashes`` already covers the first ``len(hashes)`` blocks; this makes it
    cover all ``len(token_ids) // block_size`` full blocks.
    """
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else ROOT_PARENT
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
