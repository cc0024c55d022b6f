"""Time the C++ paged attention kernel alone, against the torch path (gather + SDPA).

One layer's attention for a batch of sequences with `--context` cached tokens
each and `--q-len` new query tokens per sequence (1 = decode; k+1 = a
speculative verify window; a short prefill chunk), SmolLM2-135M's head shapes
by default. Times are process CPU seconds per call (use `--threads 1` on a
busy machine: preemption then costs nothing; `--wall` for wall-clock time,
the figure that matters with several threads on a quiet machine), median of
`--repeats`, with the
kernel and torch calls interleaved. `--q-lens 1,2,4,8,16,32` sweeps the
chunk length to find where SDPA overtakes the kernel.

    python bench/paged_attention_kernel.py --threads 1 --q-lens 1,4,8,16,32,64
    python bench/paged_attention_kernel.py --threads 2 --wall --layers 30 --no-torch   # cold K/V
    python bench/paged_attention_kernel.py --threads 2 --wall --layers 30 --no-torch --kv-cache-dtype fp8_e4m3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvferry.model import paged_kernel
from kvferry.model import attention
from kvferry.model.attention import AttentionMetadata, paged_attention
from kvferry.model.cpu_features import cpu_features
from kvferry.model.kv_cache_dtype import resolve_kv_cache_dtype, to_cache_dtype


def _meta(batch: int, context: int, q_len: int, block_size: int, num_blocks: int, dtype: torch.dtype,
          table_order: str = "random") -> dict:
    per_seq = -(-(context + q_len) // block_size)
    ids = torch.randperm(num_blocks) if table_order == "random" else torch.arange(num_blocks)
    perm = ids[: batch * per_seq].view(batch, per_seq)
    if table_order == "descending":
        perm = perm.flip(1)
    slots = []
    for r in range(batch):
        for p in range(context, context + q_len):
            slots.append(int(perm[r, p // block_size]) * block_size + p % block_size)
    return dict(query_start_loc=[r * q_len for r in range(batch + 1)], seq_lens=[context + q_len] * batch,
                slot_mapping=torch.tensor(slots), block_tables=perm.contiguous(), block_size=block_size,
                num_prefills=batch if q_len > 1 else 0, kv_dtype=dtype)


def _time(fn, repeats: int, clock=time.process_time) -> float:
    fn()  # warm-up (and the kernel's first build / load)
    samples = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return statistics.median(samples) * 1e3


def run(args: argparse.Namespace, q_len: int) -> dict:
    dtype = getattr(torch, args.dtype)
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, torch.device("cpu"), False)
    torch.manual_seed(0)
    t = args.batch * q_len
    per_seq = -(-(args.context + q_len) // args.block_size)
    num_blocks = args.batch * per_seq + 8
    # --layers caches, one per call in turn: with enough of them the K/V come
    # from memory, as in a forward pass (one layer's cache alone stays in L3).
    caches = [to_cache_dtype(torch.randn(2, num_blocks, args.block_size, args.kv_heads, args.head_dim), cache_dtype)
              for _ in range(args.layers)]
    q = torch.randn(t, args.heads, args.head_dim).to(dtype)
    k = torch.randn(t, args.kv_heads, args.head_dim).to(dtype)
    v = torch.randn(t, args.kv_heads, args.head_dim).to(dtype)
    meta_args = _meta(args.batch, args.context, q_len, args.block_size, num_blocks, cache_dtype, args.table_order)
    scale = args.head_dim ** -0.5

    def call(disable: bool):
        os.environ["KVFERRY_DISABLE_CPP_KERNELS"] = "1" if disable else "0"
        meta = AttentionMetadata(**meta_args)
        meta.prepare()  # per step in the engine, not per layer: outside the timed call
        turn = iter(range(1 << 62))
        return lambda: paged_attention(q, k, v, caches[next(turn) % len(caches)], meta, scale)

    kernel_fn, torch_fn = call(False), call(True)
    clock = time.perf_counter if args.wall else time.process_time
    kernel_ms, torch_ms = [], []
    for _ in range(args.rounds):  # interleaved
        kernel_ms.append(_time(kernel_fn, args.repeats, clock))
        torch_ms.append(float("nan") if args.no_torch else _time(torch_fn, args.repeats, clock))
    kv_bytes = 2 * args.batch * (args.context + q_len) * args.kv_heads * args.head_dim * caches[0].element_size()
    km = statistics.median(kernel_ms)
    return {"q_len": q_len, "kernel_ms": round(km, 3), "torch_ms": round(statistics.median(torch_ms), 3),
            "kernel_over_torch": round(km / statistics.median(torch_ms), 3),
            "kv_read_gb_s": round(kv_bytes / km / 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=384, help="cached tokens per sequence before the step")
    ap.add_argument("--q-lens", default="1", help="comma-separated new tokens per sequence")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--table-order", choices=("random", "ascending", "descending"), default="random",
                    help="each sequence's blocks: drawn at random from the pool, in order, or in reverse")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the query's dtype), fp8_e4m3 or fp8_e5m2")
    ap.add_argument("--layers", type=int, default=1,
                    help="caches called in turn (30: K/V read from memory as in a forward pass; 1: warm in L3)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved kernel / torch rounds")
    ap.add_argument("--kernel-max-tokens", type=int, default=None,
                    help="chunks up to this many tokens go to the kernel (default: attention.py's threshold)")
    ap.add_argument("--wall", action="store_true", help="wall-clock time per call instead of process CPU time")
    ap.add_argument("--no-torch", action="store_true", help="time the kernel only (for profiling)")
    args = ap.parse_args()
    if args.kernel_max_tokens is not None:
        attention._KERNEL_MAX_PREFILL_TOKENS = args.kernel_max_tokens
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, torch.device("cpu"), False)
    print(json.dumps({"cpu": cpu_features().describe(), "threads": args.threads, "dtype": args.dtype,
                      "kv_cache_dtype": str(cache_dtype).removeprefix("torch."), "isa": paged_kernel.kernel_isa(),
                      "path": paged_kernel.kernel_path(dtype, cache_dtype, args.head_dim),
                      "batch": args.batch, "context": args.context, "layers": args.layers,
                      "block_size": args.block_size, "table_order": args.table_order}))
    for q_len in (int(x) for x in args.q_lens.split(",")):
        print(json.dumps(run(args, q_len)))


if __name__ == "__main__":
    main()
