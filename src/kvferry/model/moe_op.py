"""A mixture-of-experts layer's expert loop as one C++ call (``csrc/moe_experts.cpp``), built at first use.

``fused_experts`` (moe.py) runs each active expert's gate_up matmul,
SiLU-and-mul and down matmul over its sorted rows. From Python that is a
few module calls and slices an expert (~20 us: 64 experts a layer at batch
32), and with several threads each matmul is its own OpenMP region: two
barriers an expert, each a wait for a descheduled thread on a shared
machine. ``expert_loop`` runs the same matmuls (linear.py's ops, the same
row padding, so the same bits) for every active expert in one call and one
parallel region, the threads splitting the experts.

It applies where both of a block's stacks are plain packed experts
(``ExpertLinear`` with small_gemm's or oneDNN's copies, one kind for all);
a quantized stack (moe_quant.py) keeps the Python loop.
``KVFERRY_DISABLE_CPP_KERNELS=1`` turns it off with the other kernels.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from kvferry.model import fused_ops, paged_kernel
from kvferry.model.linear import EXACT_ROWS, ROW_BUCKET

_SOURCE = Path(__file__).parent / "csrc" / "moe_experts.cpp"
_library = paged_kernel.LazyLibrary(lambda: _load())


class LoopArgs(NamedTuple):
    """A block's experts as expert_loop takes them (its arguments after xs and counts)."""
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    gate_up_n: int
    down_n: int
    kind: int


def loop_args(w13: object, w2: object) -> LoopArgs | None:
    """Two expert stacks' packed copies as the op takes them, or None where it
    does not take them (unprocessed, quantized, mixed kinds, no library).
    ``ExpertLinear.expert_args`` holds each stack's, taken when it was packed."""
    args13, args2 = getattr(w13, "expert_args", None), getattr(w2, "expert_args", None)
    if not args13 or not args2 or not available():
        return None
    kind = args13[0].kind
    if kind not in (1, 2, 3) or any(a.kind != kind for a in args13) or any(a.kind != kind for a in args2):
        return None
    return LoopArgs([a.weight for a in args13], [a.weight for a in args2], args13[0].out_features,
                    args2[0].out_features, kind)


def expert_loop(args: LoopArgs, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """xs [P, hidden] sorted by expert, ``counts[e]`` rows of expert e -> [P, hidden]."""
    return torch.ops.kvferry_moe.expert_loop(xs.contiguous(), counts, args.gate_up, args.down, args.gate_up_n,
                                             args.down_n, args.kind, EXACT_ROWS, ROW_BUCKET)


def available() -> bool:
    """True once the op's library is loaded (building it on the first call)."""
    if paged_kernel.kernels_disabled() or not fused_ops.fused_ops_available():
        return False
    return _library.available()


def _load() -> bool:
    return paged_kernel.try_load_library("kvferry_moe", _SOURCE, paged_kernel._cflags(),
                                         "the C++ expert loop", "the Python loop")
