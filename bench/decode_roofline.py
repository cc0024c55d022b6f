"""Decode step time at batch B as a multiple of the time to read the weights
once at this machine's memory bandwidth, both measured in the same run.

A decode step of a small batch is memory-bound: every weight is read once
(plus the KV of every request). The floor is ``weight_bytes / bandwidth``;
the figure reported is ``step_time / floor`` (goal <= 3x). Bandwidth is the
best of several large-tensor copies (read + write bytes counted), with the
same torch thread count as the model.

The weight-read floor leaves out two things a batch-32 step cannot avoid:
reading every request's K/V, and the matmuls' arithmetic (2 * batch flops
per weight, which on a CPU without AMX outgrows the read time well before
batch 32). So the run also measures the machine's peak matmul rate (the
model's own largest layer, oneDNN-packed as in serving, on a 2048-row
input) and reports the roofline floor ``max((weights + KV) / bandwidth,
flops / peak)``: no schedule of this step on this machine can be faster.

That roofline assumes the K/V read overlaps the matmuls completely and runs
at the contiguous read bandwidth. Neither holds on a small CPU: the K/V
blocks are scattered, and K/V requested during the matmuls slows them by
about its own read time (BENCHMARKS.md, session 15). So the run also reports
the serial floor ``flops / peak + KV / scattered_bw``, where scattered_bw is
what ``bench/scattered_read.c`` (built with gcc, if there is one) reads of
the model's own KV blocks in random order, read as the kernel reads them
(one head's rows at a time, or whole rows where its decode items cover all
KV heads: the AVX2 build in float32), on the same threads.

Also times one prefill-heavy step (``--prefill-tokens`` new tokens in chunks
of 512) and, with ``--profile``, prints the torch profiler's operator table
for both, which is how the time per operator was found. Malloc is tuned as
the engine's runner tunes it (engine/host_memory.py): without it the
logits' float32 copy alone faulted in fresh pages every step (~0.3 ms of a
24 ms bf16 step).

    python bench/decode_roofline.py [--dtype bfloat16] [--batch 32] [--context 384] [--threads 2] [--profile]
    python bench/decode_roofline.py --threads 1 --cpu-time     # CPU cost per step on a shared machine
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kvferry.model.attention import AttentionMetadata
from kvferry.model.llama import LlamaModel, allocate_kv_cache
from kvferry.model.loader import load_model

try:  # greedy sampling as the engine's sampler does it; trees before it had torch's argmax
    from kvferry.model.fused_ops import argmax_rows
except ImportError:
    def argmax_rows(x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1)


def copy_bandwidth(num_bytes: int = 1 << 29, repeats: int = 7) -> float:
    """Bytes/s moved by a large tensor copy (counting read + write): the
    best of several, so another process's burst does not set the figure."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best


def read_bandwidth(num_bytes: int = 1 << 29, repeats: int = 7) -> float:
    """Bytes/s of a large reduction (read only)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    src.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def kernel_reads_whole_rows(model: LlamaModel, cache_dtype: torch.dtype, batch: int, threads: int) -> bool:
    """Whether the paged attention kernel's decode items cover all KV heads of
    a sequence, reading its blocks as whole rows (kv heads 2-8, head_dim
    32/64/128, at least 2 sequences a thread, and either a float32 model and
    cache or the AVX512-BF16 build with a bf16 model and a bf16 cache (an
    fp8 one with AVX512-VBMI too); see
    csrc/paged_decode.cpp, attend_all), rather than one head's
    slice of each row."""
    from kvferry.model import paged_kernel
    from kvferry.model.cpu_features import cpu_features

    c = model.config
    features = cpu_features()
    avx2_build = paged_kernel.kernel_isa() == "avx2" or not features.avx512
    float32_rows = cache_dtype == torch.float32 and model.dtype == torch.float32
    fp8_cache = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    bf16_rows = (not avx2_build and "avx512_bf16" in features.flags and model.dtype == torch.bfloat16
                 and (cache_dtype == torch.bfloat16 or (fp8_cache and "avx512vbmi" in features.flags)))
    return ((float32_rows or bf16_rows)
            and 1 < c.num_key_value_heads <= 8 and c.head_dim in (32, 64, 128) and batch >= 2 * threads
            and os.environ.get("KVFERRY_ATTN_ALL_HEADS_ITEMS", "") != "0")


def scattered_read_bandwidth(model: LlamaModel, block_size: int, threads: int,
                             itemsize: int | None = None, whole_rows: bool = False) -> float | None:
    """Bytes/s that bench/scattered_read.c reads of this model's K (or V)
    blocks of one layer in random order, with a software prefetch, as a
    decode work item reads them: one KV head's row slice at a time, or whole
    rows (``whole_rows``); None without a C compiler with OpenMP."""
    c = model.config
    itemsize = itemsize or model.dtype.itemsize  # the cache's element size
    row = c.num_key_value_heads * c.head_dim * itemsize
    read = row if whole_rows else c.head_dim * itemsize
    if row % 64 or (c.head_dim * itemsize) % 64:
        return None
    source = Path(__file__).with_name("scattered_read.c")
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "scattered_read")
        try:
            subprocess.run(["gcc", "-O2", "-march=native", "-fopenmp", "-o", exe, str(source)], check=True,
                           capture_output=True, timeout=120)
            out = subprocess.run([exe, str(block_size * row), str(row), str(read), "64"],
                                 check=True, capture_output=True, text=True, timeout=300,
                                 env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    return json.loads(out.strip().splitlines()[-1])["gb_s"] * 1e9


def peak_matmul_flops(model: LlamaModel, rows: int = 2048, repeats: int = 7) -> float:
    """Flop/s of the model's largest decoder matmul (the MLP's gate_up, with
    its packed weight) over ``rows`` rows: the best of several. Compute-bound
    at that size, so it is what this machine's cores multiply at."""
    from kvferry.model.linear import linear

    mlp = model.layers[0].mlp
    # Shapes from the config: once packed, the plain weight may be released.
    n, k = 2 * model.config.intermediate_size, model.config.hidden_size
    w, packed = mlp.gate_up_proj.weight, mlp.gate_up_proj.packed
    x = torch.randn(rows, k, dtype=model.dtype)
    linear(x, w, None, packed)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        linear(x, w, None, packed)
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * n * k / best


def decode_step_work(model: LlamaModel, batch: int, context: int, cache_itemsize: int) -> tuple[float, int]:
    """(flops, KV bytes) of one decode step of ``batch`` requests that each
    attend to ``context + 1`` positions: 2 flops per weight of every matmul
    per request (the lm_head included, the embedding lookup not), plus q.k
    and p.v over the context per head; every layer's K and V of every
    position read once."""
    c = model.config
    matmul_weights = sum(p.numel() for name, p in model.named_parameters()
                         if p.dim() == 2 and name != "embed_tokens")
    if c.tie_word_embeddings:
        matmul_weights += model.lm_head.numel()  # the lm_head is the embedding, listed once as embed_tokens
    positions = context + 1
    attention = 4 * c.num_attention_heads * c.head_dim * positions * c.num_hidden_layers
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * positions * cache_itemsize
    return batch * (2 * matmul_weights + attention), batch * kv_bytes


def weight_bytes(model: LlamaModel) -> int:
    """Bytes a decode step reads: every parameter once (a tied embedding
    once, as the lm_head; the embedding lookup itself reads B rows only)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


class Steps:
    """Decode and prefill steps over a paged cache (block tables in order, or scattered)."""

    def __init__(self, model: LlamaModel, batch: int, context: int, block_size: int = 16,
                 cache_dtype: torch.dtype | None = None, prefill_tokens: int = 0,
                 table_order: str = "ascending") -> None:
        self.model, self.batch, self.context, self.block_size = model, batch, context, block_size
        self.blocks_per_req = -(-(context + 64) // block_size)
        # Enough blocks for the decode batch and for prefill(prefill_tokens) (small batches too).
        num_blocks = max(batch * self.blocks_per_req, -(-max(prefill_tokens, 512) // block_size)) + 64
        self.kv = allocate_kv_cache(model.config, num_blocks, block_size, cache_dtype or model.dtype)
        for layer in self.kv:  # context K/V: random, finite (one layer at a time: torch has no fp8 normal_)
            layer.copy_(torch.randn(layer.shape))
        self.vocab = model.config.vocab_size
        # The decode batch's block tables: in order (a fresh engine's prompts),
        # descending (blocks reused from the free queue's tail, where a finished
        # request's blocks go in reverse), or a random draw from the pool.
        ids = torch.randperm(num_blocks) if table_order == "random" else torch.arange(num_blocks)
        tables = ids[: batch * self.blocks_per_req].view(batch, self.blocks_per_req)
        self.decode_tables = (tables.flip(1) if table_order == "descending" else tables).contiguous()

    def decode(self, step: int = 0) -> torch.Tensor:
        b, bs = self.batch, self.block_size
        seq_lens = [self.context + 1 + step] * b
        tables = self.decode_tables
        pos = torch.full((b,), self.context + step, dtype=torch.int64)
        slots = tables[:, (self.context + step) // bs] * bs + (self.context + step) % bs
        meta = AttentionMetadata(query_start_loc=list(range(b + 1)), seq_lens=seq_lens, slot_mapping=slots,
                                 block_tables=tables, block_size=bs, num_prefills=0, kv_dtype=self.kv.dtype)
        ids = torch.randint(100, self.vocab, (b,))
        hidden = self.model(ids, pos, self.kv, meta)
        return argmax_rows(self.model.compute_logits(hidden))  # greedy, as the engine's sampler

    def prefill(self, tokens: int, chunk: int = 512) -> torch.Tensor:
        """``tokens`` new tokens as prompts of ``chunk`` tokens (no context)."""
        n = max(1, tokens // chunk)
        bs = self.block_size
        blocks = -(-chunk // bs)
        tables = torch.arange(n * blocks, dtype=torch.int64).view(n, blocks)
        pos = torch.arange(chunk).repeat(n)
        slots = (tables[:, :, None] * bs + torch.arange(bs)).reshape(n, -1)[:, :chunk].reshape(-1)
        # kv_dtype as the runner gives it: the chunks take the engine's path
        # (the C++ kernel for bf16 on AVX512-BF16, else SDPA).
        meta = AttentionMetadata(query_start_loc=[i * chunk for i in range(n + 1)], seq_lens=[chunk] * n,
                                 slot_mapping=slots, block_tables=tables, block_size=bs, num_prefills=n,
                                 kv_dtype=self.kv.dtype)
        ids = torch.randint(100, self.vocab, (n * chunk,))
        hidden = self.model(ids, pos, self.kv, meta)
        last = torch.arange(1, n + 1) * chunk - 1
        return argmax_rows(self.model.compute_logits(hidden[last]))


CLOCK = time.perf_counter


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median, min) seconds. On a shared machine the min is the figure
    least disturbed by other processes taking the cores."""
    times = []
    for i in range(repeats):
        t0 = CLOCK()
        fn(i)
        times.append(CLOCK() - t0)
    return statistics.median(times), min(times)


def cpu_description() -> str:
    try:
        from kvferry.model.cpu_features import cpu_features
    except ImportError:  # an older tree (A/B runs against a baseline checkout)
        import platform
        return platform.processor() or platform.machine()
    return cpu_features().describe()


def profile(fn, label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(3):
            fn(i)
    print(f"\n== {label}: top operators (3 steps) ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=384, help="cached tokens per request before the step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--table-order", choices=("ascending", "descending", "random"), default="ascending",
                   help="each request's decode blocks: in order, in reverse, or drawn at random from the pool")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e4m3 or fp8_e5m2")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--cpu-time", action="store_true",
                   help="time steps in process CPU seconds (use with --threads 1 on a busy machine: "
                        "preemption by other processes then costs nothing)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-rows", type=int, default=25)
    args = p.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    torch.set_num_threads(args.threads)
    try:  # the runner's malloc settings, so the steps' temporaries do not fault fresh pages each step
        from kvferry.engine.host_memory import tune_malloc
        tune_malloc()
    except ImportError:  # a tree from before host_memory
        pass
    loaded = load_model(args.model, dtype=args.dtype)
    model = loaded.model
    # Counted from the parameters before the first forward packs them (and
    # releases the plain copies).
    wbytes = weight_bytes(model)
    cache_dtype = model.dtype
    if args.kv_cache_dtype != "auto":  # (imported here: A/B runs time older trees without it)
        from kvferry.model.kv_cache_dtype import resolve_kv_cache_dtype
        cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, model.dtype, torch.device("cpu"), False)
    flops, kv_bytes = decode_step_work(model, args.batch, args.context, cache_dtype.itemsize)
    steps = Steps(model, args.batch, args.context, block_size=args.block_size, cache_dtype=cache_dtype,
                  prefill_tokens=args.prefill_tokens, table_order=args.table_order)
    with torch.inference_mode():
        for i in range(3):
            steps.decode(i)  # warm-up: kernel build/load, allocator, oneDNN primitives
        steps.prefill(args.prefill_tokens)
        bw_copy = copy_bandwidth()
        decode_s, decode_min_s = timed(steps.decode, args.repeats)
        prefill_s, prefill_min_s = timed(lambda i: steps.prefill(args.prefill_tokens), max(3, args.repeats // 3))
        bw_read = read_bandwidth()
        peak = peak_matmul_flops(model)
        whole_rows = kernel_reads_whole_rows(model, cache_dtype, args.batch, torch.get_num_threads())
        bw_scattered = scattered_read_bandwidth(model, steps.block_size, torch.get_num_threads(),
                                                cache_dtype.itemsize, whole_rows)
        bw = max(bw_copy, bw_read)
        floor_s = wbytes / bw
        memory_s, compute_s = (wbytes + kv_bytes) / bw, flops / peak
        roofline_s = max(memory_s, compute_s)
        result = {
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(cache_dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "cpu": cpu_description(), "batch": args.batch, "context": args.context,
            "block_size": args.block_size, "table_order": args.table_order,
            "weight_mb": round(wbytes / 2**20, 1),
            "copy_bw_gb_s": round(bw_copy / 1e9, 2), "read_bw_gb_s": round(bw_read / 1e9, 2),
            "weight_read_floor_ms": round(floor_s * 1e3, 2),
            "decode_step_ms": round(decode_s * 1e3, 2),
            "decode_over_floor": round(decode_s / floor_s, 2),
            "decode_step_min_ms": round(decode_min_s * 1e3, 2),
            "decode_min_over_floor": round(decode_min_s / floor_s, 2),
            "decode_tok_s": round(args.batch / decode_s, 1),
            "peak_matmul_gflop_s": round(peak / 1e9, 1), "decode_gflop": round(flops / 1e9, 2),
            "kv_read_mb": round(kv_bytes / 2**20, 1),
            "memory_floor_ms": round(memory_s * 1e3, 2), "compute_floor_ms": round(compute_s * 1e3, 2),
            "roofline_floor_ms": round(roofline_s * 1e3, 2),
            "roofline_over_weight_floor": round(roofline_s / floor_s, 2),
            "decode_over_roofline": round(decode_s / roofline_s, 2),
        }
        if bw_scattered:
            serial_s = compute_s + kv_bytes / bw_scattered
            result |= {
                "scattered_read_bw_gb_s": round(bw_scattered / 1e9, 2),
                "scattered_read_of": "whole rows" if whole_rows else "one head's row slices",
                "serial_floor_ms": round(serial_s * 1e3, 2),
                "serial_floor_over_weight_floor": round(serial_s / floor_s, 2),
                "decode_over_serial_floor": round(decode_s / serial_s, 2),
            }
        result |= {
            "prefill_tokens": args.prefill_tokens, "prefill_step_ms": round(prefill_s * 1e3, 1),
            "prefill_tok_s": round(args.prefill_tokens / prefill_s, 1),
            "prefill_best_tok_s": round(args.prefill_tokens / prefill_min_s, 1),
        }
        print(json.dumps(result, indent=2), flush=True)
        if args.profile:
            profile(steps.decode, f"decode batch {args.batch}", args.profile_rows)
            profile(lambda i: steps.prefill(args.prefill_tokens), f"prefill {args.prefill_tokens} tokens",
                    args.profile_rows)


if __name__ == "__main__":
    main()
