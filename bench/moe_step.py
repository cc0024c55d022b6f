"""One mixture-of-experts layer (model/moe.py's SparseMoeBlock) against its floor.

An OLMoE-1B-7B-shaped layer by default (64 experts, top-8, hidden 2048,
expert width 1024), random weights in bf16, packed as the served model packs
them (small_gemm's or oneDNN's copy per expert, as the dense MLP's). The
step is timed at batch 1 and 32 (random tokens: about 8 and all 64 experts
active). The floor is the active experts' weights read once at the memcpy
bandwidth measured in the same run (bytes copied / s, read + write
counted, the best of several); a second column divides by the read-only
rate of a large reduction. The block runs as served: its expert loop one
C++ call (moe_op.py) where that builds. Beside it: the same block with
moe.py's Python loop over the same packed experts (``python_loop``), and
with ``F.linear`` over each expert's plain slice of the stack (no packed
copies).

Each figure is given twice: by the wall clock (median) and by this
process's CPU time (median, ``time.process_time``), the copy's bandwidth
likewise. On a machine other processes share, the wall clock measures
them as well; the CPU-time ratio is then the layer's own (with one thread:
with more, OpenMP's spinning workers count too).

    python bench/moe_step.py [--threads 1] [--batches 1 32] [--iters 20]
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
from kvferry.model import moe_op  # noqa: E402
from kvferry.model.moe import SparseMoeBlock, fused_experts, route  # noqa: E402

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
    fn()
    fn()  # primitives built, pages faulted
    wall, cpu = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return pick(wall), pick(cpu)


def bandwidths(num_bytes: int = 1 << 29) -> dict[str, float]:
    """Bytes/s of a large copy (read + write counted) and of a large
    reduction (read only), by wall clock and by CPU time: the best of 7."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_wall, copy_cpu = time_it(lambda: dst.copy_(src), 7, min)
    read_wall, read_cpu = time_it(lambda: src.sum(), 7, min)
    return dict(copy_wall=2 * num_bytes / copy_wall, copy_cpu=2 * num_bytes / copy_cpu,
                read_wall=num_bytes / read_wall, read_cpu=num_bytes / read_cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = ModelConfig.from_hf_dict(OLMOE)
    block, w13, w2 = build(config, dtype)
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()

    def plain_expert(e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(x, w13[e])), w2[e])

    bw = bandwidths()
    rows = []
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for batch in args.batches:
            x = torch.randn(batch, config.hidden_size, generator=gen).to(dtype)
            _, ids = route(block.gate(x), config.num_experts_per_tok, False)
            active = int(torch.unique(ids).numel())
            weights = active * per_expert + block.gate.out_features * config.hidden_size * w13.element_size()
            fused_wall, fused_cpu = time_it(lambda: block(x), args.iters)
            block._loop = lambda *_: None  # moe.py's Python loop, the same packed experts
            py_wall, py_cpu = time_it(lambda: block(x), args.iters)
            del block._loop
            plain_wall, plain_cpu = time_it(lambda: fused_experts(x, *_routed(block, x, config, dtype),
                                                                  config.num_experts, plain_expert), args.iters)
            floor_wall, floor_cpu = weights / bw["copy_wall"], weights / bw["copy_cpu"]
            rows.append(dict(batch=batch, active_experts=active, weight_mb=round(weights / 1e6, 1),
                             wall_ms=dict(fused=_ms(fused_wall), python_loop=_ms(py_wall),
                                          plain_f_linear=_ms(plain_wall),
                                          floor_memcpy=_ms(floor_wall), x_floor=round(fused_wall / floor_wall, 2)),
                             cpu_ms=dict(fused=_ms(fused_cpu), python_loop=_ms(py_cpu), plain_f_linear=_ms(plain_cpu),
                                         floor_memcpy=_ms(floor_cpu), x_floor=round(fused_cpu / floor_cpu, 2),
                                         x_floor_read=round(fused_cpu * bw["read_cpu"] / weights, 2))))
    print(json.dumps(dict(dtype=args.dtype, threads=args.threads, loadavg_1m=os.getloadavg()[0],
                          cpp_loop=moe_op.loop_args(block.w13, block.w2) is not None,
                          gbps={k: round(v / 1e9, 1) for k, v in bw.items()}, rows=rows), indent=1))


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def _routed(block: SparseMoeBlock, x: torch.Tensor, config: ModelConfig,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = route(block.gate(x), config.num_experts_per_tok, config.norm_topk_prob)
    return w.to(dtype), ids


if __name__ == "__main__":
    main()
