"""The rate at which a batch-1 decode step's matmuls read their weights,
against a reduction over the same tensors, op by op, and over one big one.

A decode step at batch 1 is a chain of separate matmuls (SmolLM2-135M: 4 a
layer x 30 layers + the lm_head), each a stream of 1.3-113 MB of packed
weights. This times that chain with kvferry's float32 or bf16 matmul
(`small_gemm.linear`, one row) against `torch.sum` over the same packed
tensors in the same order, and against one sum over 512 MB: if the matmul
chain reads at the per-op sum's rate, what is left to the floor is the cost
of many short streams, not the kernel.

    python bench/gemv_stream.py --threads 2 [--dtype float32|bfloat16] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvferry.model import small_gemm
from kvferry.model.cpu_features import cpu_features

# SmolLM2-135M's matmuls, [N, K]: fused qkv, o, fused gate_up, down; the lm_head.
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not small_gemm.available(dtype):
        raise SystemExit(f"kvferry's {args.dtype} matmul kernel is not available on this CPU")
    gen = torch.Generator().manual_seed(0)
    ops = []  # (packed, x, n) in a step's order
    for _ in range(args.layers):
        for n, k in LAYER_SHAPES.values():
            ops.append((small_gemm.pack(torch.randn(n, k, generator=gen).to(dtype)), torch.randn(1, k).to(dtype), n))
    n, k = LM_HEAD
    ops.append((small_gemm.pack(torch.randn(n, k, generator=gen).to(dtype)), torch.randn(1, k).to(dtype), n))
    total = sum(p.numel() * p.element_size() for p, _, _ in ops)

    def chain(fn) -> float:
        t0 = time.perf_counter()
        for op in ops:
            fn(*op)
        return time.perf_counter() - t0

    big = torch.ones(total // 4)
    big.sum()
    gemv, per_op, one = [], [], []
    for _ in range(args.repeats):  # interleaved, so a noisy minute hits all three
        gemv.append(chain(lambda p, x, n: small_gemm.linear(x, p, n)))
        per_op.append(chain(lambda p, x, n: p.sum()))
        t0 = time.perf_counter()
        big.sum()
        one.append(time.perf_counter() - t0)
    g, s, b = (statistics.median(v) for v in (gemv, per_op, one))
    print(json.dumps({
        "cpu": cpu_features().describe(),
        "threads": args.threads, "dtype": args.dtype, "ops": len(ops), "weight_mb": round(total / 1e6, 1),
        "matmul_chain_ms": round(g * 1e3, 2), "matmul_gb_s": round(total / g / 1e9, 2),
        "sum_per_op_ms": round(s * 1e3, 2), "sum_per_op_gb_s": round(total / s / 1e9, 2),
        "one_sum_gb_s": round(total / b / 1e9, 2),
        "matmul_over_sum_per_op": round(g / s, 3), "matmul_over_one_sum": round(g / b, 3),
    }, indent=2))


if __name__ == "__main__":
    main()
