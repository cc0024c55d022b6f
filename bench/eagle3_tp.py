"""What an EAGLE-3 head costs over tensor-parallel ranks: decode tokens/s and
CPU seconds per token at TP 2 (1 thread a rank), plain against an EAGLE-3
head drafting k tokens every step, at concurrency 1.

The embedded SmolLM2-135M has 9 heads (3 KV heads), which do not split over
2 ranks, so the target is its shape with random weights and hidden 512
(8 heads of 64, 4 KV heads, MLP 1536, 30 layers, vocabulary 49152), and the
head one in a published EAGLE-3 layout with random weights (a draft
vocabulary of 24576, no embedding of its own: rank 0 reads the target's
whole table). A random head's drafts are almost never accepted, so this is
what drafting costs where it buys nothing: rank 0 drafts alone while the
worker waits for the step. Both engines are up at once; their requests
alternate (``--rounds``), and the figures are medians.

    python bench/eagle3_tp.py [--rounds 5] [--tokens 64] [--k 3] [--tp 2]

``--tp 1`` runs the same pair in one process of 2 threads: what the head
costs without ranks, to tell the two apart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer_models import LLAMA_1B, random_checkpoint  # noqa: E402

from kvferry import LLM, SamplingParams  # noqa: E402
from kvferry.spec.eagle3 import Eagle3Config, Eagle3Head  # noqa: E402

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, rope_scaling=None, rope_theta=100000.0)


def write_head(folder: Path, hidden: int, vocab: int, draft_vocab: int) -> Path:
    cfg = Eagle3Config(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=64, vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=hidden)
    torch.manual_seed(0)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.02)
        ids = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
        head.d2t.copy_(ids - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[ids] = True
    head.save(folder)
    return folder


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes (this one's threads included), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    target = str(random_checkpoint("eagle3-tp-target", LLAMA_1B, **SHAPE))
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    head = write_head(Path(tempfile.mkdtemp(prefix="eagle3-head-")), SHAPE["hidden_size"], vocab, vocab // 2)
    parallel = dict(tensor_parallel_size=2, cpu_threads_per_rank=1) if args.tp == 2 else {}
    if args.tp == 1:
        torch.set_num_threads(2)
    common = dict(model=target, dtype="bfloat16", **parallel,
                  kv_cache_memory_gb=0.2, max_model_len=1024)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": args.k, "adaptive": False,
            "cost_aware": False, "batch_token_threshold": 10**6}
    engines = {"plain": LLM(**common), "eagle3": LLM(**common, speculative=spec)}
    prompt = [(7 * i + 3) % vocab for i in range(64)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    try:
        for llm in engines.values():  # first requests pay one-time costs
            llm.generate([prompt], params)
        for r in range(args.rounds):
            for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
                llm = engines[name]
                pids = [os.getpid(), *(p.pid for p in getattr(llm.engine.core.tp, "_procs", []))]
                c0, t0 = cpu_seconds(pids), time.perf_counter()
                out = llm.generate([prompt], params)[0].outputs[0]
                wall, cpu = time.perf_counter() - t0, cpu_seconds(pids) - c0
                results[name].append((len(out.token_ids) / wall, cpu / len(out.token_ids)))
        stats = engines["eagle3"].engine.stats()
    finally:
        for llm in engines.values():
            llm.engine.core.close()
    base = statistics.median(t for t, _ in results["plain"])
    print(f"load average {os.getloadavg()[0]:.1f}; drafts {stats.num_draft_tokens}, "
          f"accepted {stats.num_accepted_tokens}")
    for name, runs in results.items():
        tps = statistics.median(t for t, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"{name:7s} tok/s {tps:7.1f} ({tps / base:.2f}x plain)  CPU ms/token {1000 * cpu:6.1f}  "
              f"runs {[round(t, 1) for t, _ in runs]}")


if __name__ == "__main__":
    main()
