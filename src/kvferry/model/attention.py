"""Attention over the paged KV cache.

KV layout, stated once for the whole project:

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

``kv_cache[:, :, b]`` is block ``b``: ``[layers][2][block_size, kv_heads,
head_dim]``. Tiers and transports move whole blocks with that shape.
A token at position ``p`` of a request with block table ``bt`` lives in
block ``bt[p // block_size]`` at offset ``p % block_size``; its "slot" is
``bt[p // block_size] * block_size + p % block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one step's flattened batch for every layer.

    The batch is the concatenation of each scheduled request's new tokens
    (prefill chunks first, then single-token decodes)::

        tokens:  | req0 chunk (q0 tokens) | req1 chunk (q1) | dec2 | dec3 |
        query_start_loc = [0, q0, q0+q1, q0+q1+1, q0+q1+2]

    Request i's new tokens sit at positions ``seq_lens[i] - q_i .. seq_lens[i]-1``
    of its sequence; positions before that are already in the KV cache.
    """

    # [num_reqs + 1] python ints: token offsets of each request in the batch
    query_start_loc: list[int]
    # [num_reqs] python ints: context length after this step (cached + new)
    seq_lens: list[int]
    # [num_tokens] int64: where each new token's K/V is written
    slot_mapping: torch.Tensor
    # [num_reqs, max_num_blocks] int64, padded with 0 (never read past seq_len)
    block_tables: torch.Tensor
    block_size: int
    # Requests [0, num_prefills) have more than one new token; requests
    # [num_prefills, num_reqs) have exactly one (decodes, or a 1-token chunk).
    num_prefills: int

    def prepare(self) -> None:
        """Build derived tensors once per step (the runner calls this), so
        that the per-layer attention calls do no repeated set-up work."""
