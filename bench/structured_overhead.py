"""Decode throughput with a JSON schema against without, in one process.

A batch of requests decodes a fixed number of tokens, either free (greedy,
ignore_eos) or constrained by a JSON schema whose shortest valid output is
longer than the budget (so both run to max_tokens and emit equal token
counts). Decode time is the time of an N-token run minus a 1-token run (the
prefill), both measured per repetition, with the two modes interleaved so
that the noise of a shared machine falls on both alike.

    python bench/structured_overhead.py [--batch 8] [--tokens 64] [--reps 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvferry import LLM, SamplingParams
from kvferry.sampling import StructuredOutputsParams

# At least 64 strings in an array: no valid output ends within the budget.
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 64,
                                                     "items": {"type": "string", "maxLength": 12}}},
          "required": ["items"], "additionalProperties": False}
PROMPT = "List sixty-four fruits as JSON: "


def params(max_tokens: int, constrained: bool) -> SamplingParams:
    structured = StructuredOutputsParams(json=SCHEMA) if constrained else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not constrained,
                          structured_outputs=structured)


def timed(llm: LLM, batch: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate([PROMPT + str(i) for i in range(batch)], params(max_tokens, constrained))
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype="float32", max_num_seqs=args.batch)
    for constrained in (False, True):  # warm up: compile the grammar, touch every kernel once
        timed(llm, args.batch, 4, constrained)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(args.reps):
        for constrained in ((False, True) if rep % 2 == 0 else (True, False)):
            prefill, _ = timed(llm, args.batch, 1, constrained)
            total, num_tokens = timed(llm, args.batch, args.tokens, constrained)
            assert num_tokens == args.batch * args.tokens, "a request ended early"
            rates[constrained].append(args.batch * (args.tokens - 1) / (total - prefill))
    free, schema = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"decode tok/s (median of {args.reps}, batch {args.batch}, {args.tokens} tokens): "
          f"free {free:.1f}  json_schema {schema:.1f}  ratio {schema / free:.3f}")
    print(f"  free:        {[round(r, 1) for r in rates[False]]}")
    print(f"  json_schema: {[round(r, 1) for r in rates[True]]}")


if __name__ == "__main__":
    main()
