"""What tensor parallelism costs on one host: decode tokens/s of TP 2 at 1
thread per rank against TP 1 at 2 threads, at concurrency 1 and 16, and the
all-reduce's share of a decode step (rank 0's time inside it: the copy, the
sum and the wait for the slower rank).

A Llama-3.2-1B-shaped model (hidden 2048, MLP 8192, 32 heads, 8 KV heads,
vocabulary 32000) with random weights and ``--layers`` decoder layers (each
costs what a 1B's layer costs; 16 is the whole 1B). Each sequence has a
32-token prompt and decodes ``--tokens`` more; only the decode steps are
timed (the prompts are prefilled in one untimed step). Each mode runs in its own process; the modes alternate
over ``--runs``.

    python bench/tp_decode.py [--runs 2] [--layers 4] [--tokens 32] [--modes tp1,tp2-shm,tp2-gloo]
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
MODES = {  # name -> (tensor_parallel_size, threads per rank, all-reduce)
    "tp1": (1, 2, "shm"),
    "tp2-shm": (2, 1, "shm"),
    "tp2-gloo": (2, 1, "gloo"),
}


class TimedGroup:
    """A shard's collectives, with the time rank 0 spends in all_reduce."""

    def __init__(self, group) -> None:  # noqa: ANN001
        self.group, self.seconds, self.calls = group, 0.0, 0

    def all_reduce(self, tensor, op: str = "sum"):  # noqa: ANN001, ANN201
        t0 = time.perf_counter()
        out = self.group.all_reduce(tensor, op)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def all_gather(self, tensor, dim: int = 0):  # noqa: ANN001, ANN201
        return self.group.all_gather(tensor, dim)


def child(mode: str, checkpoint: str, tokens: int) -> None:
    from kvferry import LLM, SamplingParams

    tp, threads, reduce = MODES[mode]
    if tp == 1:
        import torch
        torch.set_num_threads(threads)
    llm = LLM(model=checkpoint, tensor_parallel_size=tp, cpu_threads_per_rank=threads, tp_all_reduce=reduce,
              num_kv_blocks=512, block_size=16, enable_prefix_caching=False, max_num_seqs=16)
    shard = llm.engine.core.runner.model.shard
    timed = TimedGroup(shard.group) if shard.group is not None else None
    if timed is not None:
        shard.group = timed
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
        engine.step()  # every prompt in one prefill step: not timed
        if timed is not None:
            timed.seconds = 0.0
        decode_s, steps = 0.0, 0
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            decode_s += time.perf_counter() - t0
            steps += 1
        out[f"c{conc}_tok_s"] = conc * tokens / decode_s
        out[f"c{conc}_step_ms"] = 1000 * decode_s / steps
        if timed is not None:
            out[f"c{conc}_all_reduce_share"] = timed.seconds / decode_s
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
    p.add_argument("--runs", type=int, default=2)
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
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load {' '.join(load)}")
    base = {c: statistics.median(r[f"{c}_tok_s"] for r in results[modes[0]]) for c in ("c1", "c16")}
    for mode in modes:
        row = [mode]
        for c in ("c1", "c16"):
            v = statistics.median(r[f"{c}_tok_s"] for r in results[mode])
            row.append(f"{c} {v:.1f} tok/s ({v / base[c]:.2f}x)")
            shares = [r[f"{c}_all_reduce_share"] for r in results[mode] if f"{c}_all_reduce_share" in r]
            if shares:
                row.append(f"{c} all-reduce {100 * statistics.median(shares):.0f}%")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
