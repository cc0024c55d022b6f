"""The MoE experts' software prefetch choices on cold experts, by rows, and the layer under each.

Two measurements, in one process, the choices taken in turn (one call of
each a round, so that a shared machine's load falls on all alike), by this
process's CPU time, one thread unless told:

- ``--kernel``: small_gemm's ``linear_prefetch`` over every expert of an
  OLMoE-1B-7B-shaped layer (64 experts, gate_up 2048 x 2048 and down
  2048 x 1024, random bf16, packed as served on 2 MiB pages: 806 MB, so
  each expert is cold), the same rows for each, per software prefetch mode
  (1 none, 2 prefetcht1 of the next column block, 3 prefetcht1 of the
  stream 8 KiB ahead); GB/s of weights read and GFLOP/s, against the same
  calls over expert 0 alone (``warm``: its 12.6 MB from L3);
- ``--layer``: the served one-call layer (moe_op.moe_layer) at each batch,
  with each ``expert_prefetch`` given (moe_op.expert_prefetch: 0 small_gemm's
  own, 1 by rows, 2 by rows with the in-stream choice at 7-8 rows).

    python bench/moe_expert_prefetch.py --kernel --rows 4 6 7 8 9 12 --reps 15
    python bench/moe_expert_prefetch.py --layer --threads 2 --batches 32 64 --choices 1 2 --iters 40
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_step import OLMOE, bandwidths, build, time_interleaved  # noqa: E402
from kvferry.model import moe_op  # noqa: E402
from kvferry.model.config import ModelConfig  # noqa: E402


def kernel_rates(block, rows: list[int], modes: list[int], reps: int) -> list[dict]:
    lp = torch.ops.kvferry_gemm.linear_prefetch
    gu, dn = block.w13.expert_args, block.w2.expert_args
    nbytes = sum(a.weight.numel() * 2 for a in (*gu, *dn))
    gen = torch.Generator().manual_seed(0)
    out = []
    for r in rows:
        x = torch.randn(r, OLMOE["hidden_size"], generator=gen).to(torch.bfloat16)
        h = torch.randn(r, OLMOE["moe_intermediate_size"], generator=gen).to(torch.bfloat16)
        experts = list(range(len(gu)))
        runs = {**{m: (m, experts) for m in modes}, "warm": (1, [0] * len(gu))}
        cpu: dict = {k: [] for k in runs}
        for _ in range(reps):
            for name, (mode, which) in runs.items():
                c0 = time.process_time()
                for e in which:
                    lp(x, gu[e].weight, gu[e].out_features, mode)
                    lp(h, dn[e].weight, dn[e].out_features, mode)
                cpu[name].append(time.process_time() - c0)
        row = {"rows": r}
        for name, ts in cpu.items():
            t = statistics.median(ts)
            row[str(name)] = {"gbps": round(nbytes / t / 1e9, 1), "gflops": round(nbytes * r / t / 1e9)}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def expert_mode(rows: int) -> int:
    """linear_prefetch's mode moe_experts.cpp takes at this many rows on Zen 4 (expert_prefetch 2)."""
    return 1 if rows <= 6 else 3 if rows <= 8 else 2


def wide_rates(block, rows: list[int], modes: list[int], reps: int) -> list[dict]:
    """small_gemm's one-pass micro-kernel (linear_rows' one_pass = 1: every row's
    accumulators over one pass of the weight stream) against its register
    blocks of up to 8 rows (one_pass = 0), over every expert, cold: CPU seconds,
    the choices in turn; ``old`` is one_pass = 0 at the experts' own mode by rows,
    ``wide_<mode>`` the one-pass kernel at each prefetch mode. x_floor: the
    time against the experts' bytes at the 2 MiB-page read rate (moe_step.bandwidths)."""
    lr = torch.ops.kvferry_gemm.linear_rows
    gu, dn = block.w13.expert_args, block.w2.expert_args
    nbytes = sum(a.weight.numel() * 2 for a in (*gu, *dn))
    read = bandwidths()["read_huge_cpu"]
    gen = torch.Generator().manual_seed(0)
    out = []
    for r in rows:
        x = torch.randn(r, OLMOE["hidden_size"], generator=gen).to(torch.bfloat16)
        h = torch.randn(r, OLMOE["moe_intermediate_size"], generator=gen).to(torch.bfloat16)
        runs = {"old": (expert_mode(r), 0), **{f"wide_{m}": (m, 1) for m in modes}}
        for mode, wide in runs.values():  # the same bits
            assert torch.equal(lr(x, gu[0].weight, gu[0].out_features, mode, wide),
                               lr(x, gu[0].weight, gu[0].out_features, 0, 0))
        cpu: dict = {k: [] for k in runs}
        load0 = os.getloadavg()[0]
        for _ in range(reps):
            for name, (mode, wide) in runs.items():
                c0 = time.process_time()
                for e in range(len(gu)):
                    lr(x, gu[e].weight, gu[e].out_features, mode, wide)
                    lr(h, dn[e].weight, dn[e].out_features, mode, wide)
                cpu[name].append(time.process_time() - c0)
        t_old = statistics.median(cpu["old"])
        row = {"rows": r, "loadavg_1m": [round(load0, 1), round(os.getloadavg()[0], 1)],
               "read_huge_gbps": round(read / 1e9, 1)}
        for name, ts in cpu.items():
            t = statistics.median(ts)
            row[name] = {"ms": round(t * 1e3, 2), "gbps": round(nbytes / t / 1e9, 1), "x_old": round(t / t_old, 3),
                         "x_floor": round(t * read / nbytes, 2)}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def layer_times(block, batches: list[int], choices: list[int], iters: int) -> None:
    layer = block._layer(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for batch in batches:
        x = torch.randn(batch, OLMOE["hidden_size"], generator=gen).to(torch.bfloat16)
        args = {c: layer._replace(experts=layer.experts._replace(prefetch=c)) for c in choices}
        want = moe_op.moe_layer(args[choices[0]], x)
        assert all(torch.equal(moe_op.moe_layer(a, x), want) for a in args.values())  # the same bits
        load0 = os.getloadavg()[0]
        res = time_interleaved({c: (lambda a=a: moe_op.moe_layer(a, x)) for c, a in args.items()}, iters)
        w0, c0 = res[choices[0]]
        print(json.dumps(dict(batch=batch, loadavg_1m=[round(load0, 1), round(os.getloadavg()[0], 1)],
                              **{f"prefetch_{k}": dict(wall_ms=round(w * 1e3, 2), cpu_ms=round(c * 1e3, 2),
                                                       wall_x=round(w / w0, 3), cpu_x=round(c / c0, 3))
                                 for k, (w, c) in res.items()})), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", action="store_true")
    ap.add_argument("--layer", action="store_true")
    ap.add_argument("--wide", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 6, 7, 8, 9, 12])
    ap.add_argument("--modes", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--choices", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    block, _, _ = build(ModelConfig.from_hf_dict(OLMOE), torch.bfloat16)
    with torch.inference_mode():
        if args.kernel:
            kernel_rates(block, args.rows, args.modes, args.reps)
        if args.wide:
            wide_rates(block, args.rows, args.modes, args.reps)
        if args.layer:
            layer_times(block, args.batches, args.choices, args.iters)


if __name__ == "__main__":
    main()
