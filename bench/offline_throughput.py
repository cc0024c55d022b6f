"""Offline throughput: kvferry LLM.generate vs HF transformers generate.

32 requests, prompts of 128-512 tokens, 128 output tokens each, greedy,
ignore_eos, on the embedded SmolLM2-135M-Instruct. Each system runs in its
own subprocess with the same torch thread count; the figure that matters is
the ratio of output tokens/s measured in the same run.

    python bench/offline_throughput.py [--runs 3] [--threads 2] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def make_prompts(vocab_size: int, num: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids (special tokens in SmolLM2's vocabulary).
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def run_kvferry(args, prompts) -> dict:
    from kvferry import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return {"elapsed": elapsed, "output_tokens": sum(len(o.token_ids) for o in outs)}


def run_hf(args, prompts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from kvferry.model.loader import load_model

    folder = load_model(None).model_path  # the embedded default, converted to an HF folder
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype).eval()
    pad = 0
    t0 = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch_size):
            batch = prompts[i : i + args.hf_batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                do_sample=False, pad_token_id=pad,
            )
            produced += (out.shape[1] - width) * len(batch)
    return {"elapsed": time.perf_counter() - t0, "output_tokens": produced}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from kvferry.model.loader import load_model

    vocab = load_model(None).config.vocab_size
    prompts = make_prompts(vocab, args.num_requests, args.min_prompt, args.max_prompt, args.seed)
    result = run_kvferry(args, prompts) if args.system == "kvferry" else run_hf(args, prompts)
    result["threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(result))


def spawn(args, system: str, extra: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--child", system, "--threads", str(args.threads), "--dtype", args.dtype,
           "--num-requests", str(args.num_requests), "--output-len", str(args.output_len),
           "--min-prompt", str(args.min_prompt), "--max-prompt", str(args.max_prompt), "--seed", str(args.seed),
           "--hf-batch-size", str(args.hf_batch_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", dest="system", default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = p.parse_args()
    if args.system:
        return child(args)
    ratios, rows = [], []
    for run in range(args.runs):
        ours = spawn(args, "kvferry", [])
        hf = spawn(args, "hf", [])
        r_ours = ours["output_tokens"] / ours["elapsed"]
        r_hf = hf["output_tokens"] / hf["elapsed"]
        ratios.append(r_ours / r_hf)
        rows.append((r_ours, r_hf))
        print(f"run {run}: kvferry {r_ours:.1f} tok/s, HF (batch {args.hf_batch_size}) {r_hf:.1f} tok/s, "
              f"ratio {r_ours / r_hf:.2f}x  [threads {ours['threads']}/{hf['threads']}]", flush=True)
    print(json.dumps({
        "median_kvferry_tok_s": statistics.median(r for r, _ in rows),
        "median_hf_tok_s": statistics.median(h for _, h in rows),
        "median_ratio": statistics.median(ratios),
        "runs": args.runs, "threads": args.threads, "dtype": args.dtype, "hf_batch_size": args.hf_batch_size,
    }, indent=2))


if __name__ == "__main__":
    main()
