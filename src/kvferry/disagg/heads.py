"""Which KV heads go from which prefill rank to which decode rank, when the
two pools run different tensor-parallel sizes (no torch: pure arithmetic).

A rank ``r`` of a tensor-parallel group of ``size`` holds KV heads
``[r * K / size, (r + 1) * K / size)`` of the model's ``K``
(``model/layers/parallel.py``: whole heads, in order). Prefill rank ``p`` of
``A`` ranks sends decode rank ``d`` of ``B`` ranks the heads both hold: the
intersection of the two ranges, when it is not empty::

    K = 4      heads:   0   1   2   3
    prefill A = 2     | p0    | p1    |
    decode  B = 1     | d0            |      p0 -> d0 heads [0, 2), p1 -> d0 heads [2, 4)
    decode  B = 4     |d0 |d1 |d2 |d3 |      p0 -> d0 [0, 1), d1 [1, 2); p1 -> d2, d3

With ``A == B`` each prefill rank sends its whole pool layer to the decode
rank of the same index (rank to rank). Each piece is one contiguous range
of heads on both sides, so every decode rank receives exactly its heads,
each from the one prefill rank that holds it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """One piece of a layer: global KV heads ``[start, stop)``, at
    ``[src_lo, src_hi)`` of the sending rank's pool and ``[dst_lo, dst_hi)``
    of decode rank ``dst_rank``'s."""

    dst_rank: int
    start: int
    stop: int
    src_lo: int
    src_hi: int
    dst_lo: int
    dst_hi: int

    @property
    def num_heads(self) -> int:
        return self.stop - self.start


def rank_heads(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of the global KV heads rank ``rank`` of ``size`` holds."""
    if size < 1 or not 0 <= rank < size or num_kv_heads % size:
        raise ValueError(f"{num_kv_heads} KV heads do not split over rank {rank} of {size}")
    per = num_kv_heads // size
    return rank * per, (rank + 1) * per


def head_slices(num_kv_heads: int, src_rank: int, src_size: int, dst_size: int) -> list[HeadSlice]:
    """The pieces prefill rank ``src_rank`` of ``src_size`` sends, one per
    decode rank (of ``dst_size``) whose heads overlap its own, in head order."""
    lo, hi = rank_heads(num_kv_heads, src_rank, src_size)
    pieces = []
    for d in range(dst_size):
        d_lo, d_hi = rank_heads(num_kv_heads, d, dst_size)
        start, stop = max(lo, d_lo), min(hi, d_hi)
        if start < stop:
            pieces.append(HeadSlice(d, start, stop, start - lo, stop - lo, start - d_lo, stop - d_lo))
    return pieces


def dst_rank_of(num_kv_heads: int, dst_size: int, start: int, stop: int) -> int | None:
    """The decode rank that holds all of heads ``[start, stop)``, or None
    when they are not one rank's (a piece never spans two)."""
    if not 0 <= start < stop <= num_kv_heads or num_kv_heads % dst_size:
        return None
    per = num_kv_heads // dst_size
    rank = start // per
    return rank if stop <= (rank + 1) * per else None


def covers(ranges: list[tuple[int, int]], num_heads: int) -> bool:
    """Whether the ``[start, stop)`` ranges together hold every head of ``[0, num_heads)``."""
    reach = 0
    for start, stop in sorted(ranges):
        if start > reach:
            return False
        reach = max(reach, stop)
    return reach >= num_heads
