"""Online serving throughput and latency against any OpenAI-compatible server.

N concurrent streaming clients send chat requests that share a ~200-token
system prompt (a prefix cache can reuse it) followed by varied user turns
from the ``chitchat-dataset`` package (a seeded generator when it is not
installed). Every request asks for a fixed number of tokens, with
``ignore_eos`` (a vLLM extension, sent in the body) so that every server
does the same work. Reports output tokens/s, TTFT and ITL percentiles, as a
table and as JSON.

    python bench/serve_throughput.py --base-url http://127.0.0.1:8000/v1 \\
        --concurrency 16 64 --num-requests 128 --max-tokens 64 [--output out.json]

Bounded: each level sends at most --num-requests requests and stops after
--time-limit seconds (requests still running then are cancelled and counted
as incomplete).

TTFT is the time from sending a request to its first chunk with content;
ITL is the gap between successive content chunks (a chunk holding several
tokens counts once, as in vLLM's benchmark_serving); TPOT is per request
(e2e - ttft) / (output tokens - 1).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

SYSTEM_PROMPT = (
    "You are Ferry, the customer assistant of a regional ferry company that links six islands to the "
    "mainland. Be friendly, concise and concrete. Timetables: boats leave the mainland port every hour from "
    "six in the morning to ten at night in summer, and every two hours in winter; the crossing to the nearest "
    "island takes forty minutes and to the farthest two hours and a quarter. Tickets can be bought online, "
    "at the port office, or on board for a small surcharge; children under six travel free, students and "
    "seniors get a third off, and bicycles cost three euros. Cars must be booked at least a day ahead in July "
    "and August. Dogs are welcome on the outer deck if kept on a leash. In storms, sailings may be cancelled "
    "at short notice; passengers are then rebooked on the next departure or refunded in full. Lost items are "
    "kept at the mainland office for thirty days. Never invent timetables or prices that are not stated here; "
    "if you do not know, say so and suggest calling the port office. Keep every answer under a hundred words."
)

_FALLBACK_WORDS = (
    "ticket boat island summer winter price dog bike car storm refund child student morning evening "
    "port office weather delay booking family weekend luggage cabin coffee sunset harbour crossing"
).split()


def user_turns(num: int, seed: int) -> list[str]:
    """User messages from the Chit Chat Challenge dataset, shuffled with a fixed seed."""
    rng = random.Random(seed)
    try:
        import chitchat_dataset

        turns = [m for conv in chitchat_dataset.ConversationDataset() for m in conv]
        turns = [t.strip() for t in turns if 3 <= len(t.split()) <= 60]
        rng.shuffle(turns)
        return [turns[i % len(turns)] for i in range(num)]
    except ImportError:
        print("chitchat-dataset not installed: using generated user turns", file=sys.stderr)
        return [
            " ".join(rng.choice(_FALLBACK_WORDS) for _ in range(rng.randint(5, 25))).capitalize() + "?"
            for _ in range(num)
        ]


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)


async def run_request(http: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    last = None
    num_chunks = 0
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    num_chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or num_chunks  # server without usage: chunks ~ tokens
        result.ok = last is not None
        if not result.ok:
            result.error = "no content received"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def run_level(args: argparse.Namespace, model: str, concurrency: int, turns: list[str]) -> dict:
    url = args.base_url.rstrip("/") + "/chat/completions"
    bodies = [
        {
            "model": model,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": turn}],
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            **({"ignore_eos": True} if args.ignore_eos else {}),
        }
        for turn in turns
    ]
    queue: asyncio.Queue[dict] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.time_limit), limits=limits) as http:
        async def worker() -> None:
            while not queue.empty():
                results.append(await run_request(http, url, queue.get_nowait()))

        start = time.perf_counter()
        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        done, pending = await asyncio.wait(workers, timeout=args.time_limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - start
    return summarize(concurrency, results, len(bodies), elapsed)


def summarize(concurrency: int, results: list[RequestResult], num_sent: int, elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in ok)
    ms = 1000.0
    return {
        "concurrency": concurrency,
        "requests": num_sent,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "incomplete": num_sent - len(results),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(elapsed, 3),
        "mean_prompt_tokens": round(statistics.mean(r.prompt_tokens for r in ok), 1) if ok else 0,
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / elapsed, 2) if elapsed else 0.0,
        "requests_per_s": round(len(ok) / elapsed, 3) if elapsed else 0.0,
        "ttft_ms_p50": round(percentile([r.ttft for r in ok], 50) * ms, 1),
        "ttft_ms_p99": round(percentile([r.ttft for r in ok], 99) * ms, 1),
        "itl_ms_p50": round(percentile(itls, 50) * ms, 1),
        "itl_ms_p99": round(percentile(itls, 99) * ms, 1),
        "tpot_ms_mean": round(statistics.mean(tpots) * ms, 1) if tpots else float("nan"),
        "e2e_ms_p50": round(percentile([r.e2e for r in ok], 50) * ms, 1),
    }


COLUMNS = [
    ("concurrency", "conc"), ("completed", "done"), ("failed", "fail"), ("output_tokens_per_s", "out tok/s"),
    ("ttft_ms_p50", "TTFT p50 ms"), ("ttft_ms_p99", "TTFT p99 ms"), ("itl_ms_p50", "ITL p50 ms"),
    ("itl_ms_p99", "ITL p99 ms"), ("tpot_ms_mean", "TPOT ms"), ("duration_s", "time s"),
]


def table(rows: list[dict]) -> str:
    cells = [[h for _, h in COLUMNS]] + [[str(row[k]) for k, _ in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


async def discover_model(base_url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.get(base_url.rstrip("/") + "/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def main_async(args: argparse.Namespace) -> dict:
    model = args.model or await discover_model(args.base_url)
    turns = user_turns(args.num_requests + args.warmup, args.seed)
    if args.warmup:
        await run_level(args, model, min(args.warmup, max(args.concurrency)), turns[: args.warmup])
    levels = [await run_level(args, model, c, turns[args.warmup:]) for c in args.concurrency]
    return {
        "base_url": args.base_url, "model": model, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
        "temperature": args.temperature, "num_requests": args.num_requests, "levels": levels,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--num-requests", type=int, default=128, help="per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that reject it)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) before the levels")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds per level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the JSON here too")
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.num_requests < 1 or args.max_tokens < 1:
        p.error("--concurrency, --num-requests and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(main_async(args))
    print(table(report["levels"]))
    print(json.dumps(report, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(level["completed"] for level in report["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
