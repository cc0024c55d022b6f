"""Token bitmasks: one bit per vocabulary id, 32 ids per int32 word.

Layout (as xgrammar and vLLM use it): ``bitmask[row, word]`` holds ids
``32 * word .. 32 * word + 31``; bit ``i`` (least significant first) set
means id ``32 * word + i`` is allowed.
"""
from __future__ import annotations

import torch


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """All ids allowed: every bit set (-1 is all ones in two's complement)."""
    return torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32)  # [batch, words]


_BIT = torch.arange(32, dtype=torch.int32)  # [32]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with every id whose bit is clear set to -inf; inputs untouched.

    logits:  [batch, vocab] (vocab may exceed the tokenizer's: padded rows of
             the embedding; ids past 32 * words are disallowed)
    bitmask: [batch, words] int32
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits [batch, vocab] and bitmask [batch, words] must agree, got "
                         f"{tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    batch, vocab = logits.shape
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> _BIT.to(logits.device)) & 1  # [batch, words, 32]
    allowed = bits.reshape(batch, -1).bool()  # [batch, words * 32]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed[:, :vocab], float("-inf"))
