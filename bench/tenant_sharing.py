"""Two figures of the tenant policy, each measured side by side in one run.

``public``: a ~2,000-token system prompt shared by 3 tenants. For each round a
fresh system prompt is sent by tenant 1, then tenant 2, then tenant 3 (one
token each, so TTFT is the prefill). Server P declares the prompt public
(``POST /v1/kv/public_prefixes`` before the round): tenants 2 and 3 hit
tenant 1's blocks. Server I has the same keys and no public prefix: every
tenant computes the prompt itself. Reports TTFT per tenant position and the
ratio I / P for tenants 2 and 3 (target >= 5x).

``cost``: the policy's price on a workload with no sharing. Server S runs
one tenant (no flags); server T runs --api-keys (3 tenants, requests spread
over them), a cache secret and a public-prefix file that no prompt matches.
Each round sends the same unique prompts at a fixed concurrency to S and T
in turn (alternating which goes first); reports output tokens/s, the
ratio T / S of the medians and the median of the per-round ratios
(target >= 0.97).

    python bench/tenant_sharing.py public --rounds 5
    python bench/tenant_sharing.py cost --rounds 4 --concurrency 8 --num-requests 32 --max-tokens 32
    python bench/tenant_sharing.py both --output out.json

Starts its own servers (``kvferry serve``, the embedded default model unless
--model is given) on free loopback ports and stops them at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx
from _servers import served

KEYS = {f"sk-bench-{i}": {"tenant": f"tenant{i}", "publish": True} for i in (1, 2, 3)}


# ---- servers ----------------------------------------------------------------

@contextmanager
def server(workdir: Path, name: str, args: list[str], common: list[str]):
    with served([*common, *args], workdir / f"{name}.log") as url:
        yield url + "/v1"


# ---- requests ---------------------------------------------------------------

async def completion(client: httpx.AsyncClient, url: str, key: str | None, prompt: str,
                     max_tokens: int) -> tuple[float, int]:
    """(TTFT seconds, output tokens) of one streamed completion."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.monotonic()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{url}/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft is None:
                ttft = time.monotonic() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (ttft if ttft is not None else float("nan")), tokens


def system_prompt(tag: str, num_words: int) -> str:
    """A system prompt of about ``num_words`` * 1.3 tokens; ends in a newline
    so the question after it starts a new token."""
    sentences = [f"Rule {i} of policy {tag}: answer the customer politely and check the order number first."
                 for i in range(num_words // 14)]
    return " ".join(sentences) + "\n"


# ---- figure (a): public prefix pooled vs private ------------------------------

async def run_public(url: str, pooled: bool, rounds: int, prefix_words: int) -> list[list[float]]:
    """TTFT per round per tenant position (1, 2, 3)."""
    keys = list(KEYS)
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(rounds):
            prefix = system_prompt(uuid.uuid4().hex[:8], prefix_words)
            if pooled:
                r = await client.post(f"{url}/kv/public_prefixes", json={"prefix": prefix},
                                      headers={"Authorization": f"Bearer {keys[0]}"})
                r.raise_for_status()
            row = []
            for key in keys:
                ttft, _ = await completion(client, url, key, prefix + f"Question {uuid.uuid4().hex}: where is it?", 1)
                row.append(ttft)
            out.append(row)
    return out


def figure_public(args, workdir: Path, common: list[str]) -> dict:
    keys = workdir / "keys.json"
    keys.write_text(json.dumps(KEYS))
    flags = ["--api-keys", str(keys), "--max-model-len", "4096"]
    result = {}
    with server(workdir, "pooled", flags, common) as pooled_url, server(workdir, "private", flags, common) as private_url:
        # Warm both (first-request costs), then alternate the servers per round.
        for url, pooled in ((pooled_url, True), (private_url, False)):
            asyncio.run(run_public(url, pooled, 1, args.prefix_words))
        rows = {"pooled": [], "private": []}
        for i in range(args.rounds):
            order = [("pooled", pooled_url), ("private", private_url)]
            for name, url in (order if i % 2 == 0 else order[::-1]):
                rows[name] += asyncio.run(run_public(url, name == "pooled", 1, args.prefix_words))
    for name, table in rows.items():
        result[name] = {f"tenant{p + 1}_ttft_s": statistics.median(r[p] for r in table) for p in range(3)}
    for p in (2, 3):
        k = f"tenant{p}_ttft_s"
        result[f"tenant{p}_speedup"] = result["private"][k] / result["pooled"][k]
    result["prefix_words"] = args.prefix_words
    return result


# ---- figure (b): the policy's cost on a workload with no sharing ----------------

async def run_load(url: str, keys: list[str | None], prompts: list[str], concurrency: int,
                   max_tokens: int) -> float:
    """Output tokens/s of ``prompts`` sent at ``concurrency``, keys round-robin."""
    queue = list(enumerate(prompts))
    total = 0

    async def worker(client):
        nonlocal total
        while queue:
            i, prompt = queue.pop(0)
            _, n = await completion(client, url, keys[i % len(keys)], prompt, max_tokens)
            total += n

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return total / (time.monotonic() - start)


def figure_cost(args, workdir: Path, common: list[str]) -> dict:
    keys = workdir / "keys.json"
    keys.write_text(json.dumps(KEYS))
    (workdir / "secret").write_bytes(os.urandom(32).hex().encode())
    (workdir / "public.json").write_text(json.dumps([system_prompt("never-sent", 200)]))
    tenant_flags = ["--api-keys", str(keys), "--cache-secret-file", str(workdir / "secret"),
                    "--public-prefixes", str(workdir / "public.json")]
    rates: dict[str, list[float]] = {"single": [], "tenants": []}
    with server(workdir, "single", [], common) as single_url, server(workdir, "tenants", tenant_flags, common) as t_url:
        setups = {"single": (single_url, [None]), "tenants": (t_url, list(KEYS))}
        for url, k in setups.values():  # warm-up
            asyncio.run(run_load(url, k, [f"Warm {uuid.uuid4().hex}"] * args.concurrency, args.concurrency, 4))
        for i in range(args.rounds):
            # The same unique prompts for both servers in a round (no cross-request sharing).
            prompts = [f"Request {uuid.uuid4().hex}: " + " ".join(f"word{j}-{uuid.uuid4().hex[:4]}" for j in range(40))
                       for _ in range(args.num_requests)]
            order = ["single", "tenants"] if i % 2 == 0 else ["tenants", "single"]
            for name in order:
                url, k = setups[name]
                rates[name].append(asyncio.run(run_load(url, k, prompts, args.concurrency, args.max_tokens)))
    single, tenants = statistics.median(rates["single"]), statistics.median(rates["tenants"])
    # Per-round ratios pair the two servers under the same machine load.
    paired = statistics.median(t / s for s, t in zip(rates["single"], rates["tenants"]))
    return {"single_tok_s": single, "tenants_tok_s": tenants, "ratio": tenants / single,
            "paired_ratio_median": paired, "rounds": rates}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("figure", choices=["public", "cost", "both"])
    p.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prefix-words", type=int, default=1500, help="public prompt size (~1.3 tokens a word)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    common = ["--dtype", "float32", "--kv-cache-memory-gb", "1", "--disable-uvicorn-access-log",
              "--log-level", "warning", *(["--model", args.model] if args.model else [])]
    results = {}
    with tempfile.TemporaryDirectory() as d:
        if args.figure in ("public", "both"):
            results["public"] = figure_public(args, Path(d), common)
            print(json.dumps(results["public"], indent=2))
        if args.figure in ("cost", "both"):
            results["cost"] = figure_cost(args, Path(d), common)
            print(json.dumps(results["cost"], indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
