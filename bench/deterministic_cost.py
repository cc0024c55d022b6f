"""What --deterministic costs: in-process prefill and decode tokens/s of the
same engine with and without batch-invariant kernels, runs alternating.

A Llama-3.2-1B-shaped bf16 model (hidden 2048, MLP 8192, 32 heads, 8 KV
heads) with random weights and 2 decoder layers: each layer costs what a
1B's layer costs, in a fraction of the load time. Prefill: 8 prompts of
512 tokens, one output token each. Decode: 8 sequences of 32-token prompts,
64 more tokens each (the step's time with the prefill step taken out).
Each mode runs in its own process, so one mode's kernel choices never leak
into the other's.

    python bench/deterministic_cost.py [--runs 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(mode: str, checkpoint: str) -> None:
    from kvferry import LLM, SamplingParams

    llm = LLM(model=checkpoint, dtype="bfloat16", deterministic=(mode == "deterministic"), num_kv_blocks=1024,
              block_size=16, enable_prefix_caching=False)
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        # ids the tiny tokenizer can detokenize (the model itself has 32,000)
        return [[rng.randrange(3, 380) for _ in range(length)] for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(2, 64), one)  # warm
    t0 = time.perf_counter()
    llm.generate(prompts(8, 512), one)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts(8, 32), one)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts(8, 32), SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True))
    decode_s = time.perf_counter() - t0 - first_s
    print(json.dumps({"mode": mode, "prefill_tok_s": 8 * 512 / prefill_s, "decode_tok_s": 8 * 64 / decode_s}))


def make_checkpoint(root: Path) -> str:
    sys.path.insert(0, str(REPO))
    from tests.tiny_models import make_tiny_checkpoint

    return str(make_tiny_checkpoint(root, "llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                                    vocab_size=32000, initializer_range=0.02))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", nargs=2, metavar=("MODE", "CHECKPOINT"))
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return
    from kvferry.model.cpu_features import cpu_features

    results: dict[str, list[dict]] = {"default": [], "deterministic": []}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_checkpoint(Path(tmp))
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO / "src"))
        for run in range(args.runs):
            for mode in results:
                out = subprocess.run([sys.executable, __file__, "--child", mode, checkpoint], env=env,
                                     capture_output=True, text=True, check=True).stdout
                figure = json.loads(out.strip().splitlines()[-1])
                results[mode].append(figure)
                print(f"run {run + 1} {mode}: {figure}", flush=True)
    summary = {"cpu": cpu_features().describe(), "threads": args.threads, "runs": args.runs}
    for key in ("prefill_tok_s", "decode_tok_s"):
        base = statistics.median(r[key] for r in results["default"])
        det = statistics.median(r[key] for r in results["deterministic"])
        summary[key] = {"default": round(base, 1), "deterministic": round(det, 1), "ratio": round(det / base, 3)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
