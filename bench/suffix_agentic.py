"""Suffix decoding on an agentic-like workload: multi-turn edits of one
file, at batch 1, against plain decoding (and n-gram prompt lookup), in one
process on the embedded SmolLM2-135M-Instruct (or ``--model``).

The conversation: the user hands over a small Python file and asks for an
edit; each later turn asks for another edit of the result, so every answer
re-emits most of the code already in the conversation (its own earlier
answers included). The conversation is built once with plain decoding
(greedy); each engine then serves the same turn prompts in order, turn by
turn, interleaved (plain, suffix, ngram, plain, ...) so that machine noise
hits all alike. A turn's time is its whole request (the new part of the
prompt is prefilled; the rest hits the prefix cache). Greedy outputs must
equal plain decoding's (float32; in bf16 a near-tie may flip, reported).

On a machine others load, ``--threads 1 --cpu-time`` counts this process's
CPU seconds instead of wall seconds (the engine still steers k by wall
time).

    python bench/suffix_agentic.py [--methods suffix ngram auto] [--turns 6] [--k 8] [--max-tokens 320]

``suffix+tree`` and ``auto+tree`` are those methods with ``draft_tree``
(k tokens over all of a tree's branches, kvferry.spec.tree).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kvferry import LLM, SamplingParams

FILE = '''import math


def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


def diagonal(width, height):
    return math.sqrt(width ** 2 + height ** 2)


def scale(width, height, factor):
    return width * factor, height * factor


def describe(width, height):
    return f"{width} x {height}: area {area(width, height)}, perimeter {perimeter(width, height)}"
'''

EDITS = [
    "Here is my file shapes.py:\n\n```python\n" + FILE + "```\n\nRename the function `area` to `rect_area` "
    "everywhere. Reply with the whole updated file only.",
    "Now add a docstring to `perimeter`. Reply with the whole updated file only.",
    "Now make `scale` return a tuple of floats. Reply with the whole updated file only.",
    "Now add type hints to `diagonal`. Reply with the whole updated file only.",
    "Now rename the parameter `factor` to `k` in `scale`. Reply with the whole updated file only.",
    "Now add a function `is_square(width, height)` at the end. Reply with the whole updated file only.",
    "Now remove the import if it is unused. Reply with the whole updated file only.",
    "Now add a module docstring at the top. Reply with the whole updated file only.",
]


METHODS = ["suffix", "ngram", "auto", "suffix+tree", "auto+tree"]


def method_config(method: str, k: int) -> dict:
    method, tree = method.removesuffix("+tree"), method.endswith("+tree")
    spec = {"method": method, "num_speculative_tokens": k, **({"draft_tree": True} if tree else {})}
    if method in ("ngram", "auto"):
        spec.update(prompt_lookup_max=4, prompt_lookup_min=2)
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["suffix", "ngram", "auto"], choices=METHODS)
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--turns", type=int, default=6, help=f"edits in the conversation (at most {len(EDITS)})")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens of every method")
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cpu-time", action="store_true", help="rates per CPU second of this process, not per wall second")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    common = dict(model=args.model, dtype=args.dtype, kv_cache_memory_gb=0.5, max_num_seqs=4)
    engines = {"plain": LLM(**common)}
    for method in args.methods:
        engines[method] = LLM(speculative=method_config(method, args.k), **common)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    clock = time.process_time if args.cpu_time else time.perf_counter
    tok = engines["plain"].tokenizer
    messages: list[dict] = []
    seconds = {name: 0.0 for name in engines}
    tokens = {name: 0 for name in engines}
    identical = {m: True for m in args.methods}
    for turn, edit in enumerate(EDITS[: args.turns]):
        messages.append({"role": "user", "content": edit})
        prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
        outputs, turn_seconds = {}, {}
        for name, llm in engines.items():
            t0 = clock()
            out = llm.generate([prompt], params)[0]
            turn_seconds[name] = clock() - t0
            seconds[name] += turn_seconds[name]
            tokens[name] += len(out.token_ids)
            outputs[name] = out
        for m in args.methods:
            if outputs[m].token_ids != outputs["plain"].token_ids:
                identical[m] = False
                if args.dtype == "float32":
                    raise AssertionError(f"turn {turn}: greedy output changed under {m}")
        messages.append({"role": "assistant", "content": outputs["plain"].text})
        print(json.dumps({"turn": turn, "prompt_tokens": len(prompt), "output_tokens": len(outputs["plain"].token_ids),
                          "seconds": {name: round(t, 2) for name, t in turn_seconds.items()}}), flush=True)
    plain = tokens["plain"] / seconds["plain"]
    result = {"plain_tok_s": round(plain, 1), "turns": args.turns, "k": args.k, "dtype": args.dtype,
              "clock": "cpu" if args.cpu_time else "wall", "threads": args.threads}
    for m in args.methods:
        stats = engines[m].engine.stats()
        rate = tokens[m] / seconds[m]
        result[m] = {"tok_s": round(rate, 1), "speedup": round(rate / plain, 2),
                     "acceptance": round(stats.num_accepted_tokens / max(stats.num_draft_tokens, 1), 2),
                     "mean_accepted_length": round(1 + stats.num_accepted_tokens / max(stats.num_drafts, 1), 2),
                     "greedy_identical": identical[m]}
    print(json.dumps(result), flush=True)
    print("\n| method | tok/s | / plain | acceptance | mean accepted length | identical |")
    print("|---|---|---|---|---|---|")
    print(f"| plain | {result['plain_tok_s']} | 1.00x | - | 1.0 | - |")
    for m in args.methods:
        r = result[m]
        print(f"| {m} | {r['tok_s']} | {r['speedup']:.2f}x | {r['acceptance']} | {r['mean_accepted_length']} | "
              f"{'yes' if r['greedy_identical'] else 'no'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
