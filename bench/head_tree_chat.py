"""The draft head drafting a path against drafting a tree (``draft_tree``,
spec/head_tree.py), on held-out chat at batch 1, in one process on the
embedded SmolLM2-135M-Instruct and its committed head (or ``--model`` and
``--head``).

The prompts are the held-out chitchat conversations (the first ones in
dataset order, which no head training sees), shaped as ``kvferry
train-draft``'s held-out measurement shapes them (1, 3 or 5 turns). Each
engine serves them one at a time (batch 1), interleaved prompt by prompt
(plain, head, head+tree, plain, ...) so that machine noise hits all alike;
replies end at EOS or ``--max-tokens``. Greedy outputs must equal plain
decoding's (float32).

Methods, each at every ``--k``:
- ``head``, ``head+tree``: method head, k drafts every step (no adaptive k,
  no cost model: they would hide acceptance), a path or a tree of k;
- ``default``, ``default+tree``: the serving default (auto with the head,
  the adaptive, cost-aware controller) with paths or trees.

Reports per method: tokens per second of this process's CPU time
(``--cpu-time``, for a machine others load; use ``--threads 1`` then) or of
wall time, the ratio to plain, the acceptance (accepted / drafted tokens)
and the mean accepted length per verify step (bonus token included).

``--width`` sets the trees' width (spec/head_tree.WIDTH: children per
expanded node, nodes expanded per depth).

    python bench/head_tree_chat.py [--methods head head+tree] [--k 4 6] [--prompts 24] --threads 1 --cpu-time
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kvferry import LLM, SamplingParams
from kvferry.config import EMBEDDED_DRAFT_HEAD
from kvferry.spec import head_tree
from kvferry.train.draft_head import held_out_chats

METHODS = ["head", "head+tree", "default", "default+tree"]


def method_config(method: str, k: int, head: str) -> dict:
    method, tree = method.removesuffix("+tree"), method.endswith("+tree")
    spec = {"num_speculative_tokens": k, "model": head, **({"draft_tree": True} if tree else {})}
    if method == "head":
        return {"method": "head", "adaptive": False, "cost_aware": False, "batch_token_threshold": 10**6, **spec}
    return {"method": "auto", **spec}  # the serving default's choice for the embedded model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["head", "head+tree"], choices=METHODS)
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--head", default=str(EMBEDDED_DRAFT_HEAD), help="head file (default: the committed one)")
    ap.add_argument("--k", type=int, nargs="+", default=[4, 6], help="num_speculative_tokens (each its own engines)")
    ap.add_argument("--prompts", type=int, default=24, help="held-out chat prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cpu-time", action="store_true", help="rates per CPU second of this process, not per wall second")
    ap.add_argument("--width", type=int, default=head_tree.WIDTH,
                    help="a tree's children per expanded node and nodes expanded per depth")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    head_tree.WIDTH = args.width
    torch.set_num_threads(args.threads)
    common = dict(model=args.model, dtype=args.dtype, kv_cache_memory_gb=0.25, max_num_seqs=4)
    engines = {"plain": LLM(**common)}
    for k in args.k:
        for method in args.methods:
            engines[f"{method}@{k}"] = LLM(speculative=method_config(method, k, args.head), **common)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    clock = time.process_time if args.cpu_time else time.perf_counter
    prompts = held_out_chats(args.prompts)
    for llm in engines.values():  # first calls' one-time costs, outside the timing
        llm.chat([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
    before = {name: llm.engine.stats() for name, llm in engines.items()}
    seconds = {name: 0.0 for name in engines}
    tokens = {name: 0 for name in engines}
    for i, prompt in enumerate(prompts):
        outputs = {}
        for name, llm in engines.items():
            t0 = clock()
            out = llm.chat([prompt], params)[0]
            seconds[name] += clock() - t0
            tokens[name] += len(out.token_ids)
            outputs[name] = out.token_ids
        for name, ids in outputs.items():
            if ids != outputs["plain"] and args.dtype == "float32":
                raise AssertionError(f"prompt {i}: greedy output changed under {name}")
        print(json.dumps({"prompt": i, "output_tokens": len(outputs["plain"]),
                          "seconds": {n: round(seconds[n], 2) for n in engines}}), flush=True)
    plain = tokens["plain"] / seconds["plain"]
    result = {"plain_tok_s": round(plain, 1), "prompts": len(prompts), "max_tokens": args.max_tokens,
              "width": args.width, "dtype": args.dtype, "clock": "cpu" if args.cpu_time else "wall",
              "threads": args.threads}
    for name, llm in engines.items():
        if name == "plain":
            continue
        s, b = llm.engine.stats(), before[name]
        drafts, drafted = s.num_drafts - b.num_drafts, s.num_draft_tokens - b.num_draft_tokens
        accepted = s.num_accepted_tokens - b.num_accepted_tokens
        rate = tokens[name] / seconds[name]
        result[name] = {"tok_s": round(rate, 1), "speedup": round(rate / plain, 3),
                        "acceptance": round(accepted / max(drafted, 1), 3),
                        "mean_accepted_length": round(1 + accepted / max(drafts, 1), 3),
                        "verify_steps": drafts, "tokens": tokens[name]}
    print(json.dumps(result, indent=1))
    print("\n| method | k | tok/s | / plain | acceptance | mean accepted length |")
    print("|---|---|---|---|---|---|")
    for name, r in result.items():
        if isinstance(r, dict):
            method, k = name.split("@")
            print(f"| {method} | {k} | {r['tok_s']} | {r['speedup']}x | {r['acceptance']} "
                  f"| {r['mean_accepted_length']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
