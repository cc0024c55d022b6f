"""A mixture-of-experts layer as one C++ call (``csrc/moe_experts.cpp``), built at first use.

``SparseMoeBlock.forward`` (moe.py) routes (the router's matmul, softmax,
top-k, renormalization), sorts the (token, expert) pairs by expert,
gathers, runs each active expert's gate_up matmul, SiLU-and-mul and down
matmul over its rows, weights and scatters back, and adds Qwen2-MoE's gated
shared expert. From Python that is a dozen ops plus a few module calls an
expert (~20 us each: 64 experts a layer at batch 32), and with several
threads every one of those ops is its own OpenMP region, each ending in a
wait for a thread another process may have descheduled. ``moe_layer`` runs
the same ops (linear.py's matmuls with the same row padding, the same ATen
ops on the same tensors, so the same bits) in one call and one parallel
region: one thread routes (another takes the shared expert meanwhile, an
idle one sleeps until the routing is done), then the threads claim the
experts one at a time, and the last one done scatters.

It applies where the router, both expert stacks and the shared expert's
three matmuls are plain packed copies (small_gemm's or oneDNN's; the
experts one kind for all). Where only the experts are (``loop_args``),
``expert_loop`` runs the experts alone, the routing in Python; a quantized
stack (moe_quant.py) keeps the Python loop.
``KVFERRY_DISABLE_CPP_KERNELS=1`` turns it off with the other kernels.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from kvferry.model import fused_ops, paged_kernel
from kvferry.model.cpu_features import cpu_features
from kvferry.model.layers.base import MatmulArgs
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
    prefetch: int  # the op's expert_prefetch (expert_prefetch below)


def expert_prefetch(kind: int, dtype: torch.dtype, flags: frozenset[str] | None = None) -> int:
    """The op's ``expert_prefetch`` for experts of this kind and dtype: 3
    (small_gemm's bf16 matmuls with no software prefetch up to 6 rows,
    prefetcht1 of the weight stream 8 KiB ahead at 7-10, 9-10 rows in
    small_gemm's one-pass kernel, prefetcht1 of the next column block from
    11) on Zen 4, else 0 (small_gemm's own linear: prefetcht0, one pass at
    9-10). 2 is 3 with two row blocks at 9-10 and prefetcht1 of the next
    block there; 1 is 2 without the in-stream choice (prefetcht1 of the next
    block from 7 rows).

    On Zen 4 (2 cores, cold 2048 x 2048 bf16 experts on 2 MiB pages, one
    thread) prefetcht0 of the next column block held the stream at 27-29
    GB/s at 1-4 rows against 31-33 with none (a plain reduction: 33), and
    at 8-16 rows prefetcht1 was 15-40% faster than either (csrc/small_gemm.cpp);
    at 7-8 rows, where the multiply about keeps pace with the read,
    prefetcht1 within the stream itself read 5-10% faster than of the next
    block, and at 9-10 rows the one-pass kernel with it took 0.76-0.85x the
    time of 2's (bench/moe_expert_prefetch.py --kernel, --wide).
    small_gemm's prefetcht0 was tuned on Zen 5, which this was not measured
    on; Zen 4 is told from Zen 5 by AVX-VNNI's VEX form, which Zen 5 added
    (an AMD CPU: SSE4a). ``flags``: /proc/cpuinfo's (default: this CPU's)."""
    if flags is None:
        flags = cpu_features().flags
    zen4 = "sse4a" in flags and "avx512_bf16" in flags and "avx_vnni" not in flags
    return 3 if zen4 and kind == 1 and dtype == torch.bfloat16 else 0


def loop_args(w13: object, w2: object) -> LoopArgs | None:
    """Two expert stacks' packed copies as the op takes them, or None where it
    does not take them (unprocessed, quantized, mixed kinds, no library).
    ``ExpertLinear.expert_args`` holds each stack's, taken when it was packed."""
    args13, args2 = getattr(w13, "expert_args", None), getattr(w2, "expert_args", None)
    if not args13 or not args2 or not available():
        return None
    # Kept on w13 (ExpertLinear.loop_args_cache, dropped by a reload) for the
    # lists it was made from: every step asks, and rebuilding 64 experts'
    # lists took about as long as the rest of the call's Python.
    cached = w13.loop_args_cache
    if cached is not None and cached[0] is args13 and cached[1] is args2:
        return cached[2]
    kind = args13[0].kind
    if kind not in (1, 2, 3) or any(a.kind != kind for a in args13) or any(a.kind != kind for a in args2):
        loop = None
    else:
        loop = LoopArgs([a.weight for a in args13], [a.weight for a in args2], args13[0].out_features,
                        args2[0].out_features, kind, expert_prefetch(kind, args13[0].weight.dtype))
    w13.loop_args_cache = (args13, args2, loop)
    return loop


def expert_loop(args: LoopArgs, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """xs [P, hidden] sorted by expert, ``counts[e]`` rows of expert e -> [P, hidden]."""
    return torch.ops.kvferry_moe.expert_loop(xs.contiguous(), counts, args.gate_up, args.down, args.gate_up_n,
                                             args.down_n, args.kind, EXACT_ROWS, ROW_BUCKET, args.prefetch)


class LayerArgs(NamedTuple):
    """A whole block as moe_layer takes it (its arguments after x)."""
    gate: MatmulArgs  # the router
    top_k: int
    renormalize: bool
    weights_float32: bool
    first_expert: int  # an expert-parallel rank's first expert; -1: every expert is here
    experts: LoopArgs
    shared: list[torch.Tensor]  # Qwen2-MoE: [gate_up, down, gate] packed copies; else []
    shared_n_kind: list[int]  # each shared weight's [out_features, kind]


_PLAIN_KINDS = (1, 2, 3)  # small_gemm's, oneDNN's, oneDNN's in fixed blocks (layers/base.py MatmulArgs)


def layer_args(gate: object, experts: LoopArgs, shared: tuple[object, object, object] | None, top_k: int,
               renormalize: bool, weights_float32: bool, first_expert: int | None) -> LayerArgs | None:
    """The block's linears as moe_layer takes them, or None where one of the
    router's or the shared expert's is not a plain packed copy (unprocessed,
    quantized): the block then routes in Python and calls ``expert_loop``."""
    args = [lin.matmul_args() for lin in (gate, *(shared or ()))]
    if any(a is None or a.kind not in _PLAIN_KINDS for a in args):
        return None
    return LayerArgs(args[0], top_k, renormalize, weights_float32, -1 if first_expert is None else first_expert,
                     experts, [a.weight for a in args[1:]], [v for a in args[1:] for v in (a.out_features, a.kind)])


def moe_layer(args: LayerArgs, x: torch.Tensor,
              routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, hidden] (T > 0) -> the block's output before its all-reduce, in x's dtype.
    ``routing``: (weights [T, k] float, ids [T, k] int64) in place of the
    router's choice (the router still runs); moe.py's ``SparseMoeBlock.forward``."""
    g, e = args.gate, args.experts
    weights, ids = routing or (None, None)
    return torch.ops.kvferry_moe.moe_layer(x.contiguous(), g.weight, g.out_features, g.kind, args.top_k,
                                           args.renormalize, args.weights_float32, args.first_expert, e.gate_up,
                                           e.down, e.gate_up_n, e.down_n, e.kind, args.shared, args.shared_n_kind,
                                           EXACT_ROWS, ROW_BUCKET, weights, ids, e.prefetch)


def available() -> bool:
    """True once the op's library is loaded (building it on the first call)."""
    if paged_kernel.kernels_disabled() or not fused_ops.fused_ops_available():
        return False
    return _library.available()


def _load() -> bool:
    return paged_kernel.try_load_library("kvferry_moe", _SOURCE, paged_kernel._cflags(),
                                         "the C++ expert loop", "the Python loop")
