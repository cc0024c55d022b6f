"""What pipeline parallelism costs and buys on one host: decode tokens/s of
PP 2 at 1 thread per stage against PP 1 at 2 threads, at concurrency 1 and
16, and how much of a decode step the two stages spend running at once.

A Llama-3.2-1B-shaped model (hidden 2048, MLP 8192, 32 heads, 8 KV heads,
vocabulary 32000) with random weights and ``--layers`` decoder layers (16
is the whole 1B). Each sequence has a 32-token prompt and decodes
``--tokens`` more; the decode steps are timed apart from the prompts'
step (at c16 one 512-token prefill step, reported as prefill tok/s). Each mode runs in its own process; the
modes alternate over ``--runs``.

    pp1        one process, 2 threads
    pp2        2 stages of 1 thread, the default micro-batches: a decode step of
               fewer than 128 tokens is one (the stages take turns)
    pp2-mb1    2 stages of 1 thread, never micro-batches (--pp-micro-batches 1)
    pp2-mb2    2 stages of 1 thread, every step in 2 micro-batches (--pp-micro-batches 2)
    pp2-mb4    2 stages of 1 thread, 4 micro-batches (at c16: 4 requests each)

For the PP modes, "overlap" is the share of the decode time in which both
stages ran a micro-batch (from rank 0's record of both stages' micro-batch
times, engine/pp_stages.py ``PPLeader.timelines``).

    python bench/pp_decode.py [--runs 1] [--layers 4] [--tokens 32] [--modes pp1,pp2,pp2-mb1,pp2-mb2,pp2-mb4]
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
MODES = {  # name -> (pipeline_parallel_size, threads per stage, micro-batches)
    "pp1": (1, 2, None),
    "pp2": (2, 1, None),
    "pp2-mb1": (2, 1, 1),
    "pp2-mb2": (2, 1, 2),
    "pp2-mb4": (2, 1, 4),
}


def _busy_together(first: list, last: list) -> float:
    """Seconds in which a micro-batch of each stage ran at once."""
    return sum(max(0.0, min(e0, e1) - max(s0, s1)) for _, s0, e0 in first for _, s1, e1 in last)


def child(mode: str, checkpoint: str, tokens: int) -> None:
    from kvferry import LLM, SamplingParams

    pp, threads, micro = MODES[mode]
    if pp == 1:
        import torch
        torch.set_num_threads(threads)
    llm = LLM(model=checkpoint, pipeline_parallel_size=pp, cpu_threads_per_rank=threads, pp_micro_batches=micro,
              num_kv_blocks=512, block_size=16, enable_prefix_caching=False, max_num_seqs=16)
    leader = llm.engine.core.tp if pp > 1 else None
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(3, 380) for _ in range(32)] for _ in range(n)]  # ids the test tokenizer knows

    out: dict = {"mode": mode}
    llm.generate(prompts(2), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm
    engine = llm.engine
    for conc in (1, 16):
        params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts(conc)):
            engine.add_request(f"c{conc}-{i}", prompt, params)
        t0 = time.perf_counter()
        engine.step()  # every prompt in one prefill step
        out[f"c{conc}_prefill_tok_s"] = conc * 32 / (time.perf_counter() - t0)
        if leader is not None:
            leader.timelines.clear()
        decode_s, steps = 0.0, 0
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            decode_s += time.perf_counter() - t0
            steps += 1
        out[f"c{conc}_tok_s"] = conc * tokens / decode_s
        out[f"c{conc}_step_ms"] = 1000 * decode_s / steps
        if leader is not None:
            timed = list(leader.timelines)  # the last 64 steps: all of them at --tokens <= 63
            out[f"c{conc}_overlap"] = sum(_busy_together(f, l) for _, f, l in timed) / decode_s
    llm.engine.core.close()
    print(json.dumps(out), flush=True)


def make_checkpoint(root: Path, layers: int) -> str:
    sys.path.insert(0, str(REPO))
    from tests.tiny_models import make_tiny_checkpoint

    return str(make_tiny_checkpoint(root, "llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                                    vocab_size=32000, initializer_range=0.02))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--child", nargs=3, metavar=("MODE", "CHECKPOINT", "TOKENS"))
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_checkpoint(Path(tmp), args.layers)
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        for _ in range(args.runs):
            for mode in modes:
                proc = subprocess.run([sys.executable, __file__, "--child", mode, checkpoint, str(args.tokens)],
                                      env=env, capture_output=True, text=True, check=True)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
                results[mode].append(json.loads(line))
                print(line, flush=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"load {' '.join(load_before)} before, {' '.join(load)} after")
    base = {c: statistics.median(r[f"{c}_tok_s"] for r in results[modes[0]]) for c in ("c1", "c16")}
    for mode in modes:
        row = [mode]
        for c in ("c1", "c16"):
            v = statistics.median(r[f"{c}_tok_s"] for r in results[mode])
            row.append(f"{c} {v:.1f} tok/s ({v / base[c]:.2f}x)")
            shares = [r[f"{c}_overlap"] for r in results[mode] if f"{c}_overlap" in r]
            if shares:
                row.append(f"{c} overlap {100 * statistics.median(shares):.0f}%")
        prefill = statistics.median(r["c16_prefill_tok_s"] for r in results[mode])
        base_prefill = statistics.median(r["c16_prefill_tok_s"] for r in results[modes[0]])
        row.append(f"c16 prefill {prefill:.0f} tok/s ({prefill / base_prefill:.2f}x)")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
