"""Tensor parallelism against vLLM-CPU's (issue 47), side by side in one
run, with vLLM's own client (``vllm bench serve``, random dataset).

Four servers on the same Llama-3.2-1B-shaped checkpoint (random bf16
weights, made once under /tmp/kvferry-peer-models: bench/_peer_models.py),
each on the same 2 CPUs:

- ``kvferry-tp1``: one process, 2 threads;
- ``kvferry-tp2``: ``-tp 2 --cpu-threads-per-rank 1`` (shared-memory all-reduce);
- ``vllm-tp1``: ``vllm serve``, ``VLLM_CPU_OMP_THREADS_BIND=0-1``;
- ``vllm-tp2``: ``--tensor-parallel-size 2``, ``VLLM_CPU_OMP_THREADS_BIND=0|1``
  (its CPU SHM all-reduce; summary.json's vllm_log_notes says whether vLLM
  turned it off).

Targets: kvferry-tp2 / vllm-tp2 >= 1.2x output tok/s, and kvferry-tp2 /
kvferry-tp1 >= 0.9x, at c1 and c16.

    python bench/tp_vs_vllm.py [--runs 2] [--layers 16] [--concurrency 1 16]
        [--input-len 256 --output-len 128] [--configs kvferry-tp1 kvferry-tp2 vllm-tp1 vllm-tp2]

Duration on a quiet 2-core host, estimated from the smoke runs and the
quiet bench/tp_decode.py figures: per server about 0.5 min to start
(kvferry) or 2-3 min (vLLM compiles its graph), 2 min at c1 (8 requests
of 128 tokens at ~10 tok/s), 1.5 min at c16 (64 requests): about 20-25 min
a run of the four, 40-50 min at --runs 2. The checkpoint takes ~1 min to
make the first time (2 GiB).

Smoke run (~15 min on a loaded host): --layers 2 --runs 1 --concurrency
1 4 --prompts-per-slot 1 --min-prompts 2 --output-len 8 --input-len 64.
Results: bench/results/tp_vs_vllm/ (summary.md, summary.json, each run's
``vllm bench serve`` JSON and the server logs). Compare ratios only from a
quiet machine: the load average is printed before and after each step.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer_models import LLAMA_1B, parameter_count, random_checkpoint  # noqa: E402
from _vllm_peer import Config, Target, add_common_args, run  # noqa: E402

CONFIGS = {c.name: c for c in (Config("kvferry-tp1", "kvferry", 1), Config("kvferry-tp2", "kvferry", 2),
                               Config("vllm-tp1", "vllm", 1), Config("vllm-tp2", "vllm", 2))}
TARGETS = [Target("kvferry-tp2", "vllm-tp2", goal=1.2), Target("kvferry-tp2", "kvferry-tp1", goal=0.9),
           Target("kvferry-tp1", "vllm-tp1"), Target("vllm-tp2", "vllm-tp1")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, concurrency=[1, 16], prompts_per_slot=4, input_len=256, output_len=128, kv_gb=2,
                    out="bench/results/tp_vs_vllm")
    p.add_argument("--layers", type=int, default=LLAMA_1B["num_hidden_layers"])
    p.add_argument("--vocab", type=int, default=LLAMA_1B["vocab_size"],
                   help="vocabulary (default the tokenizer's 49152; 128256 is Llama-3.2-1B's, padded tokenizer)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = p.parse_args()
    overrides = {"num_hidden_layers": args.layers, "vocab_size": args.vocab}
    model = random_checkpoint("llama-1b", LLAMA_1B, **overrides)
    total, _ = parameter_count({**LLAMA_1B, **overrides})
    configs = [CONFIGS[n] for n in args.configs]
    names = set(args.configs)
    targets = [t for t in TARGETS if {t.first, t.second} <= names]
    return run(args, str(model), configs, targets,
               {"folder": str(model), "shape": "Llama-3.2-1B", **overrides, "parameters": total})


if __name__ == "__main__":
    raise SystemExit(main())
