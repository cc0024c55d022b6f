"""Prefill tokens per second of a GGUF file through the offline engine, in
CPU time and wall time, at several prompt lengths: the figure to hold against
``llama-bench -p N -n 0`` on the same file.

One fresh prompt of random token ids per run (no prefix-cache hit), max_tokens
1, so a run is one prefill step (``max_num_batched_tokens`` at least the
longest prompt) and one lm_head row. The lengths are alternated run by run
(``--runs`` each, after one warm-up of each); reported: the medians of the
process's CPU time (``time.process_time``, all threads) and of the wall time,
and the load average. ``--profile`` adds torch.profiler's op table of one
prefill of the first length (self CPU time; a layer run in one C++ call is
one row).

    PYTHONPATH=src python bench/gguf_prefill_tokens.py --model FILE.gguf [--tokens 128 512] [--threads 2] [--runs 3]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    import torch

    from kvferry import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, quantization="gguf", max_num_seqs=2, kv_cache_memory_gb=0.5,
              max_num_batched_tokens=max(2048, max(args.tokens)))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)

    def prefill(n: int) -> tuple[float, float]:
        prompt = [rng.randrange(1000, 20000) for _ in range(n)]
        c0, w0 = time.process_time(), time.perf_counter()
        out = llm.generate(prompt, params)[0]
        assert len(out.prompt_token_ids) == n
        return time.process_time() - c0, time.perf_counter() - w0

    for n in args.tokens:
        prefill(n)  # warm-up
    cpu: dict[int, list[float]] = {n: [] for n in args.tokens}
    wall: dict[int, list[float]] = {n: [] for n in args.tokens}
    for r in range(args.runs):
        for n in args.tokens if r % 2 == 0 else reversed(args.tokens):
            c, w = prefill(n)
            cpu[n].append(c)
            wall[n].append(w)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"{args.model}, {args.threads} threads, {args.runs} runs each, load {load}")
    for n in args.tokens:
        c, w = statistics.median(cpu[n]), statistics.median(wall[n])
        print(f"  {n:5d} tokens: CPU {c:7.2f} s ({n / c:6.1f} tok/s of CPU, x{args.threads} threads "
              f"{args.threads * n / c:6.1f})  wall {w:7.2f} s ({n / w:6.1f} tok/s)  "
              f"[cpu {' '.join(f'{x:.2f}' for x in cpu[n])}]")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            prefill(args.tokens[0])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
