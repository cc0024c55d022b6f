"""A mixture of experts against vLLM-CPU (issue 48), side by side in one
run, with vLLM's own client (``vllm bench serve``, random dataset), at c16
and c64.

The checkpoint: OLMoE-1B-7B-0924's shape (16 layers, hidden 2048, 64
experts of width 1024, top-8, vocabulary 50304: 6.9B parameters, 1.3B
active a token) as Qwen3-MoE, the MoE architecture both systems run
(kvferry runs no OlmoeForCausalLM), random bf16 weights, made once under
/tmp/kvferry-peer-models (bench/_peer_models.py): 13 GiB at 16 layers,
so the servers run one after the other, never both at once. ``--layers``
makes it smaller (each layer is 0.8 GiB of experts).

Servers, each on the same 2 CPUs: ``kvferry`` (one process, 2 threads) and
``vllm`` (``VLLM_CPU_OMP_THREADS_BIND=0-1``); ``--configs`` adds
``kvferry-ep2`` (``-tp 2 --enable-expert-parallel``, 1 thread per rank),
``kvferry-afd`` (``--mode afd --attention 1 --ffn 1``: the attention core
and the FFN worker 1 thread each, on the same 2 CPUs) and ``vllm-tp2``
(``--tensor-parallel-size 2``).

Target: kvferry / vllm >= 1.3x output tok/s, p99 TTFT, TPOT and ITL no
worse (ratio <= 1).

    python bench/moe_vs_vllm.py [--runs 2] [--layers 16] [--concurrency 16 64]
        [--input-len 256 --output-len 128] [--configs kvferry vllm]

Duration on a quiet 2-core host, estimated: making the 16-layer checkpoint
the first time 3-5 min (10 min on a loaded host); per server 1-2 min to
load (kvferry) or 3-5 min (vLLM: load, repack the experts for AMX,
compile); c16 (32 requests of 256 + 128 tokens) 3-5 min and c64 (128
requests) 6-10 min where a step reads nearly every expert (~13 GiB):
about 25-50 min a run of the two servers (the top of that if kvferry's MoE
step is as far behind vLLM's as in the loaded smoke runs), 50-100 min at
--runs 2; ``--configs`` with all four: twice that. Memory:
13 GiB of weights + --kv-cache-gb 4 per server (c64 x 384 tokens needs
3 GiB at 128 KiB a token): one server at a time fits a 23 GiB host with
little else running. ``--layers 8`` halves weights and time.

kvferry against itself, without vLLM's servers (vLLM's client still
measures): EP 2 (1 thread per rank) against EP 1 (2 threads), and AFD 1+1
against colocated, each at c16 and c64. Small (2 layers of the OLMoE
shape, all 64 experts: 1.6 GiB of experts; a few minutes on a quiet
2-core host, the checkpoint made once)::

    python bench/moe_vs_vllm.py --configs kvferry kvferry-ep2 --layers 2 --runs 1 \
        --prompts-per-slot 1 --min-prompts 16 --input-len 64 --output-len 32 --kv-cache-gb 1 \
        --out bench/results/moe_ep2
    python bench/moe_vs_vllm.py --configs kvferry kvferry-afd --layers 2 --runs 1 \
        --prompts-per-slot 1 --min-prompts 16 --input-len 64 --output-len 32 --kv-cache-gb 1 \
        --out bench/results/moe_afd

(``--layers 16 --runs 2`` with the default lengths: the full model.
bench/moe_ep.py times EP 2 against EP 1 offline, decode steps only.)

Smoke run (~15 min on a loaded host): --layers 2 --experts 8 --runs 1
--concurrency 2 4 --prompts-per-slot 1 --min-prompts 2 --output-len 8
--input-len 64.
Results: bench/results/moe_vs_vllm/ (summary.md, summary.json, each run's
``vllm bench serve`` JSON and the server logs).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer_models import OLMOE_7B, parameter_count, random_checkpoint  # noqa: E402
from _vllm_peer import Config, Target, add_common_args, run  # noqa: E402

CONFIGS = {c.name: c for c in (Config("kvferry", "kvferry"), Config("vllm", "vllm"),
                               Config("kvferry-ep2", "kvferry", 2, expert_parallel=True),
                               Config("kvferry-afd", "kvferry", afd="1+1"), Config("vllm-tp2", "vllm", 2))}
TARGETS = [Target("kvferry", "vllm", goal=1.3)] + [
    Target("kvferry", "vllm", metric=m, goal=1.0, higher=False) for m in ("p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms")
] + [Target("kvferry-ep2", "kvferry"), Target("kvferry-ep2", "vllm-tp2"), Target("kvferry-afd", "kvferry")] + [
    Target(first, "kvferry", metric=m, higher=False) for first in ("kvferry-ep2", "kvferry-afd")
    for m in ("p99_tpot_ms", "p99_ttft_ms")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, concurrency=[16, 64], prompts_per_slot=2, input_len=256, output_len=128, kv_gb=4,
                    out="bench/results/moe_vs_vllm")
    p.add_argument("--layers", type=int, default=OLMOE_7B["num_hidden_layers"])
    p.add_argument("--experts", type=int, default=OLMOE_7B["num_experts"])
    p.add_argument("--configs", nargs="+", default=["kvferry", "vllm"], choices=list(CONFIGS))
    args = p.parse_args()
    overrides = {"num_hidden_layers": args.layers, "num_experts": args.experts}
    model = random_checkpoint("olmoe-7b", OLMOE_7B, **overrides)
    total, active = parameter_count({**OLMOE_7B, **overrides})
    configs = [CONFIGS[n] for n in args.configs]
    names = set(args.configs)
    targets = [t for t in TARGETS if {t.first, t.second} <= names]
    return run(args, str(model), configs, targets, {"folder": str(model), "shape": "OLMoE-1B-7B as Qwen3-MoE",
                                                    **overrides, "parameters": total, "active_parameters": active})


if __name__ == "__main__":
    raise SystemExit(main())
