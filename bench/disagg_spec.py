"""Decode speed of a disaggregated pair (``kvferry serve --mode disagg``,
one prefill and one decode core) with and without speculative decoding on
the decode core, at batch 1 over the real OpenAI API.

Each configuration gets its own server, started one after the other; each
request streams, and its decode rate is (tokens - 1) / (last token time -
first token time): the first token is the prefill core's, so this is the
decode core's speed alone (colocated: the core's decode speed). The server's admin view then gives the decode
core's acceptance and the prompt positions it computed (0: nothing was
recomputed there).

    python bench/disagg_spec.py --methods none head ngram --requests 6 --max-tokens 96
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import openai

from _servers import served

PROMPTS = [
    "Repeat this sentence exactly, three times: The quick brown fox jumps over the lazy dog.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works, step by step.",
    "Copy the list: apples, pears, plums, cherries, apples, pears, plums, cherries, apples,",
    "What are the main causes of the French Revolution?",
    "Translate to French and then back to English: I would like a cup of coffee, please.",
]


def spec_flags(method: str, k: int, fixed_k: bool) -> list[str]:
    if method == "none":
        return []
    spec = {"method": method, "num_speculative_tokens": k}
    if fixed_k:
        spec.update(adaptive=False, cost_aware=False)
    return ["--speculative-config", json.dumps(spec)]


def decode_rate(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(decode tokens/s after the first token, tokens) of one streamed request."""
    times, text = [], []
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
    tokens = usage.completion_tokens if usage else len(times)
    if len(times) < 2:
        return 0.0, tokens
    return (tokens - 1) / (times[-1] - times[0]), tokens


def run_method(method: str, args: argparse.Namespace, log_dir: Path, mode: str = "disagg") -> dict:
    flags = ["--dtype", args.dtype, "--max-model-len", "2048", "--log-level", "warning",
             *spec_flags(method, args.k, args.fixed_k)]
    if mode == "disagg":
        flags += ["--mode", "disagg", "--prefill", "1", "--decode", "1"]
        if args.prefill_cpus:
            flags += ["--prefill-cpus", args.prefill_cpus, "--decode-cpus", args.decode_cpus]
    with served(flags, log_dir / f"{mode}-{method}.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        decode_rate(client, model, "Hello", 8)  # warm up both cores
        rates = []
        for i in range(args.requests):
            rate, _ = decode_rate(client, model, PROMPTS[i % len(PROMPTS)], args.max_tokens)
            rates.append(rate)
        workers = {w["name"]: w for w in httpx.get(f"{url}/v1/admin/workers", timeout=10).json()["data"]}
    dec = workers["decode-0" if mode == "disagg" else "engine-0"]
    return {
        "mode": mode, "method": method, "decode_tok_s_median": statistics.median(rates), "decode_tok_s": rates,
        "decode_drafts": dec["num_drafts"], "decode_draft_tokens": dec["num_draft_tokens"],
        "decode_accepted_tokens": dec["num_accepted_tokens"],
        "decode_prompt_tokens_computed": dec["prompt_tokens_computed"],
        "decode_draft_prompt_tokens_computed": dec["draft_prompt_tokens_computed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["none", "head"], choices=["none", "ngram", "head"],
                        help="speculative methods to compare (none: plain decoding); the embedded model has a head")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--fixed-k", action="store_true",
                        help="always k drafts (no adaptive or cost-aware backoff): the drafter's own effect")
    parser.add_argument("--also-colocated", action="store_true",
                        help="run each method on one colocated core too (its acceptance is what disagg must match)")
    parser.add_argument("--requests", type=int, default=6, help="requests per method, one at a time")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefill-cpus", default=None, help='e.g. "0" (then also --decode-cpus)')
    parser.add_argument("--decode-cpus", default=None, help='e.g. "1"')
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="disagg-spec-"))
    results = [run_method(m, args, log_dir) for m in args.methods]
    if args.also_colocated:  # the same drafter on one colocated core: the acceptance to match
        results += [run_method(m, args, log_dir, "colocated") for m in args.methods]
    base = results[0]["decode_tok_s_median"]
    for r in results:
        acc = r["decode_accepted_tokens"] / max(r["decode_draft_tokens"], 1)
        print(f"{r['mode']:>9} {r['method']:>6}: decode {r['decode_tok_s_median']:6.1f} tok/s ({r['decode_tok_s_median'] / base:4.2f}x)"
              f"  drafts {r['decode_drafts']}  acceptance {acc:.2f}"
              f"  decode-core prompt tokens computed {r['decode_prompt_tokens_computed']}"
              f" (draft {r['decode_draft_prompt_tokens_computed']})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
