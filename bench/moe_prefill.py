"""One MoE layer at prefill sizes against the dense matmuls of the same rows.

The block of bench/moe_step.py (OLMoE-1B-7B-shaped: 64 experts, top-8,
hidden 2048, expert width 1024, random bf16 weights, packed as served) over
a prefill chunk of T tokens (512: ~64 rows an expert; 2048: ~256). The
floor is the same experts' matmuls run as dense ones: for every active
expert, its gate_up, SiLU-and-mul and down over as many rows as the router
gave it, each a separate call over the expert's packed copy on one thread
(``ExpertLinear.forward_expert``: the dense MLP's kernel; one thread, so
that no call waits at a barrier for a thread a loaded machine has
descheduled), so the ratio is what routing, sorting, gathering,
scattering and the layer's threads cost over the same arithmetic, in
core-seconds (CPU time; the wall ratio scales the one thread's time down
by the layer's threads). A second floor is the arithmetic alone: the
layer's flops at the kernel's one-core rate on a warm 256-row expert
matmul (GFLOP/s by CPU time).

Timed in turn (one of each a round), wall clock and this process's CPU
time, medians:

    python bench/moe_prefill.py [--threads 2] [--tokens 512 2048] [--iters 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_step import OLMOE, build, time_interleaved  # noqa: E402

from kvferry.model.config import ModelConfig  # noqa: E402
from kvferry.model.cpu_features import cpu_features  # noqa: E402
from kvferry.model.fused_ops import silu_and_mul  # noqa: E402
from kvferry.model.moe import route  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = ModelConfig.from_hf_dict(OLMOE)
    block, w13, w2 = build(config, torch.bfloat16)
    del w13, w2  # the plain stacks: only the packed copies run here
    hidden, width = config.hidden_size, config.moe_intermediate_size
    flops_per_row = 2 * hidden * (2 * width) + 2 * width * hidden

    def dense(xs: list[torch.Tensor]) -> None:
        torch.set_num_threads(1)  # one thread: no barrier for a loaded machine's descheduled thread
        try:
            for e, x in enumerate(xs):
                if x.shape[0]:
                    block.w2.forward_expert(e, silu_and_mul(block.w13.forward_expert(e, x)))
        finally:
            torch.set_num_threads(args.threads)

    warm = torch.randn(256, hidden).to(torch.bfloat16)
    _, peak_cpu = time_interleaved({"warm": lambda: [dense([warm]) for _ in range(4)]}, 5)["warm"]
    gflops = 4 * 256 * flops_per_row / peak_cpu / 1e9  # per core
    rows = []
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
            _, ids = route(block.gate(x), config.num_experts_per_tok, False)
            counts = torch.bincount(ids.flatten(), minlength=config.num_experts).tolist()
            xs = [torch.randn(c, hidden, generator=gen).to(torch.bfloat16) for c in counts]
            times = time_interleaved({"layer": lambda: block(x), "dense": lambda: dense(xs)}, args.iters)
            (lw, lc), (dw, dc) = times["layer"], times["dense"]
            flops = sum(counts) * flops_per_row
            rows.append(dict(tokens=tokens, active_experts=sum(c > 0 for c in counts),
                             rows_per_expert=[min(counts), round(sum(counts) / len(counts), 1), max(counts)],
                             wall_ms=dict(layer=round(lw * 1e3, 1), dense_1_thread=round(dw * 1e3, 1),
                                          x_dense=round(lw * args.threads / dw, 2)),
                             cpu_ms=dict(layer=round(lc * 1e3, 1), dense_1_thread=round(dc * 1e3, 1),
                                         x_dense=round(lc / dc, 2),
                                         x_arithmetic=round(lc * gflops * 1e9 / flops, 2))))
    print(json.dumps(dict(cpu=cpu_features().describe(), threads=args.threads, loadavg_1m=os.getloadavg()[0],
                          warm_256_row_gflops=round(gflops, 1), rows=rows), indent=1))


if __name__ == "__main__":
    main()
