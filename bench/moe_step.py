"""One mixture-of-experts layer (model/moe.py's SparseMoeBlock) against its floor.

An OLMoE-1B-7B-shaped layer by default (64 experts, top-8, hidden 2048,
expert width 1024), random weights in bf16, packed as the served model packs
them (small_gemm's or oneDNN's copy per expert, as the dense MLP's). The
step is timed at batch 1 and 32 by default (random tokens: about 8 and all
64 experts active; batch 16: about 56). The floor is the active experts'
weights read once at the memcpy bandwidth measured in the same run (bytes
copied / s, read + write counted, the best of several); further columns
divide by the read-only rate of a large reduction (``x_floor_read``) and of
the same reduction over memory on 2 MiB pages (``x_floor_read_huge``: the
experts' small_gemm copies lie on such pages), with the same threads. The paths, timed in turn (one call of each a
round, so that a shared machine's load falls on all alike):

- ``layer``: as served, the whole block one C++ call (moe_op.moe_layer:
  routing, sort, gather, experts, scatter, shared expert; one parallel region);
- ``expert_loop``: the routing, sort, gather and scatter as torch ops, the
  experts one C++ call (moe_op.expert_loop; the served path before the layer op);
- ``python_loop``: moe.py's Python loop over the same packed experts;
- ``plain_f_linear``: ``F.linear`` over each expert's plain slice of the
  stack (no packed copies).

Each figure is given twice: by the wall clock (median) and by this
process's CPU time (median, ``time.process_time``), the copy's bandwidth
likewise. On a machine other processes share, the wall clock measures
them as well; the CPU-time ratio is then the layer's own (with one thread:
with more, OpenMP's spinning workers count too).

    python bench/moe_step.py [--threads 1] [--batches 1 16 64] [--iters 20] [--paths layer expert_loop]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from kvferry.model.config import ModelConfig  # noqa: E402
from kvferry.model.fused_ops import silu_and_mul  # noqa: E402
from kvferry.model.layers import UnquantizedConfig  # noqa: E402
from kvferry.model import huge_pages, moe_op  # noqa: E402
from kvferry.model.moe import SparseMoeBlock, fused_experts, route  # noqa: E402

PATHS = ("layer", "expert_loop", "python_loop", "plain_f_linear")
OLMOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=50304, hidden_size=2048, intermediate_size=1024,
             num_hidden_layers=1, num_attention_heads=16, num_experts=64, num_experts_per_tok=8,
             moe_intermediate_size=1024, norm_topk_prob=False)


def build(config: ModelConfig, dtype: torch.dtype) -> tuple[SparseMoeBlock, torch.Tensor, torch.Tensor]:
    """The block with random weights, packed; and plain copies of its stacks."""
    block = SparseMoeBlock(config, dtype, "cpu", UnquantizedConfig(), "model.layers.0.mlp")
    gen = torch.Generator().manual_seed(0)
    for lin in (block.gate, block.w13, block.w2):
        w = lin.weight.data
        w.copy_((torch.randn(w.shape, generator=gen) * 0.02).to(dtype))
    w13, w2 = block.w13.weight.data.clone(), block.w2.weight.data.clone()
    for lin in (block.gate, block.w13, block.w2):
        lin.process_weights_after_loading()
    return block, w13, w2


def time_it(fn, iters: int, pick=statistics.median) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one call: ``pick`` of ``iters`` calls each."""
    return time_interleaved({"fn": fn}, iters, pick)["fn"]


def time_interleaved(fns: dict, iters: int, pick=statistics.median) -> dict[str, tuple[float, float]]:
    """``time_it`` for several functions, their calls taken in turn (one of
    each, ``iters`` rounds), so that a shared machine's load moves all alike."""
    for fn in fns.values():
        fn()
        fn()  # primitives built, pages faulted
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {k: (pick(wall[k]), pick(cpu[k])) for k in fns}


def bandwidths(num_bytes: int = 1 << 29) -> dict[str, float]:
    """Bytes/s of a large copy (read + write counted), of a large reduction
    (read only), and of the same reduction over memory on 2 MiB pages (as the
    experts' copies are, where small_gemm's kernel takes them: huge_pages.py),
    by wall clock and by CPU time: the best of 7, with the threads set."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    huge = huge_pages.empty((num_bytes // 4,), torch.float32).fill_(1.0)
    copy_wall, copy_cpu = time_it(lambda: dst.copy_(src), 7, min)
    read_wall, read_cpu = time_it(lambda: src.sum(), 7, min)
    huge_wall, huge_cpu = time_it(lambda: huge.sum(), 7, min)
    return dict(copy_wall=2 * num_bytes / copy_wall, copy_cpu=2 * num_bytes / copy_cpu,
                read_wall=num_bytes / read_wall, read_cpu=num_bytes / read_cpu,
                read_huge_wall=num_bytes / huge_wall, read_huge_cpu=num_bytes / huge_cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS),
                    help="the ways to run the block, timed in turn; x_floor is the first one's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = ModelConfig.from_hf_dict(OLMOE)
    block, w13, w2 = build(config, dtype)
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()

    def plain_expert(e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(x, w13[e])), w2[e])

    def only(loop: bool, layer: bool):
        """The block's forward with its one-call layer and/or its C++ expert loop switched off."""
        def run(x: torch.Tensor) -> torch.Tensor:
            if not layer:
                block._layer = lambda *_: None
            if not loop:
                block._loop = lambda *_: None
            try:
                return block(x)
            finally:
                block.__dict__.pop("_layer", None)
                block.__dict__.pop("_loop", None)
        return run

    paths = {"layer": lambda x: block(x),  # as served: the whole block one C++ call (moe_op.moe_layer)
             "expert_loop": only(True, False),  # routing, sort, gather, scatter in torch; experts one C++ call
             "python_loop": only(False, False),  # moe.py's Python loop over the same packed experts
             "plain_f_linear": lambda x: fused_experts(x, *_routed(block, x, config, dtype), config.num_experts,
                                                       plain_expert)}
    bw = bandwidths()
    rows = []
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for batch in args.batches:
            x = torch.randn(batch, config.hidden_size, generator=gen).to(dtype)
            _, ids = route(block.gate(x), config.num_experts_per_tok, False)
            active = int(torch.unique(ids).numel())
            weights = active * per_expert + block.gate.out_features * config.hidden_size * w13.element_size()
            times = time_interleaved({k: (lambda f=paths[k]: f(x)) for k in args.paths}, args.iters)
            floor_wall, floor_cpu = weights / bw["copy_wall"], weights / bw["copy_cpu"]
            first_wall, first_cpu = times[args.paths[0]]
            rows.append(dict(batch=batch, active_experts=active, weight_mb=round(weights / 1e6, 1),
                             wall_ms=dict({k: _ms(w) for k, (w, _) in times.items()}, floor_memcpy=_ms(floor_wall),
                                          x_floor=round(first_wall / floor_wall, 2),
                                          x_floor_read_huge=round(first_wall * bw["read_huge_wall"] / weights, 2)),
                             cpu_ms=dict({k: _ms(c) for k, (_, c) in times.items()}, floor_memcpy=_ms(floor_cpu),
                                         x_floor=round(first_cpu / floor_cpu, 2),
                                         x_floor_read=round(first_cpu * bw["read_cpu"] / weights, 2),
                                         x_floor_read_huge=round(first_cpu * bw["read_huge_cpu"] / weights, 2))))
    print(json.dumps(dict(dtype=args.dtype, threads=args.threads, loadavg_1m=os.getloadavg()[0],
                          cpp_loop=moe_op.loop_args(block.w13, block.w2) is not None,
                          cpp_layer=getattr(block, "_layer", lambda _: None)(dtype) is not None,
                          gbps={k: round(v / 1e9, 1) for k, v in bw.items()}, rows=rows), indent=1))


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def _routed(block: SparseMoeBlock, x: torch.Tensor, config: ModelConfig,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = route(block.gate(x), config.num_experts_per_tok, config.norm_topk_prob)
    return w.to(dtype), ids


if __name__ == "__main__":
    main()
