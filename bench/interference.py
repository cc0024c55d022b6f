"""Prefill/decode interference: TPOT of running decode streams while long
prompts arrive, for colocated cores (with and without chunked prefill) and
for a disaggregated prefill + decode pair, each against the same streams
with no arrivals. One run starts every server itself, one after another.

    python bench/interference.py [--configs nochunk chunked disagg] [--num-streams 8] \\
        [--prompt-tokens 2048 4096] [--arrival-interval 3] [--duration 30] [--output out.json]

Each config runs two phases on one server: ``idle`` (the decode streams
alone) and ``arrivals`` (the same streams while a prompt of a random length
in --prompt-tokens arrives every --arrival-interval seconds, asking for one
token; those still running when the phase ends are cancelled). A decode stream asks for --stream-tokens tokens with ignore_eos and
starts again when it ends. TPOT here is the gap between successive content
chunks of the decode streams (p50 / p99 over all gaps of the phase).

CPUs: colocated servers get --colocated-cpus (default "0-1": both phases on
every core); disagg pins its prefill core to --prefill-cpus and its decode
core to --decode-cpus (default "0" and "1"). The target of the design: the
disagg p99 within 1.3x of its idle p99.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _servers
import httpx

CONFIGS = {
    # Without chunking a step must fit the longest prompt.
    "nochunk": ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4608"],
    "chunked": ["--enable-chunked-prefill", "--max-num-batched-tokens", "512"],
    "disagg": ["--mode", "disagg", "--prefill", "1", "--decode", "1"],
}


def start_server(args: argparse.Namespace, config: str, log: Path) -> tuple[subprocess.Popen, str]:
    cpus = (["--prefill-cpus", args.prefill_cpus, "--decode-cpus", args.decode_cpus] if config == "disagg"
            else ["--engine-cpus", args.colocated_cpus])
    flags = ["--max-model-len", str(args.max_model_len), "--dtype", args.dtype, "--kv-cache-memory-gb", "1",
             "--log-level", "warning", "--disable-uvicorn-access-log", *CONFIGS[config], *cpus, *args.server_args]
    return _servers.start_server(flags + (["--model", args.model] if args.model else []), log)


async def decode_stream(client: httpx.AsyncClient, model: str, index: int, stream_tokens: int,
                        stop_at: float, gaps: list[float]) -> None:
    while time.monotonic() < stop_at:
        body = {"model": model, "prompt": f"Stream {index}: tell a long story about ferries.",
                "max_tokens": stream_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        last = None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now


async def arrivals(client: httpx.AsyncClient, model: str, args: argparse.Namespace, stop_at: float,
                   ttfts: list[float], errors: list[str]) -> None:
    rng = random.Random(args.seed)
    lo, hi = args.prompt_tokens
    tasks = []

    async def one(prompt: list[int]) -> None:
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                       "temperature": 0})
        if r.status_code == 200:
            ttfts.append(time.monotonic() - t0)
        else:
            errors.append(f"{r.status_code} {r.text[:200]}")

    await asyncio.sleep(args.arrival_interval / 2)
    while time.monotonic() < stop_at:
        n = rng.randint(lo, hi)
        tasks.append(asyncio.create_task(one([rng.randrange(1000, 20000) for _ in range(n)])))
        await asyncio.sleep(args.arrival_interval)
    # The phase ends with the streams: prompts still running are cancelled
    # (the client leaves; the server aborts them), so a phase stays bounded.
    await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def phase(base_url: str, args: argparse.Namespace, with_arrivals: bool) -> dict:
    limits = httpx.Limits(max_connections=args.num_streams + 32)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gaps: list[float] = []
        ttfts: list[float] = []
        errors: list[str] = []
        stop_at = time.monotonic() + args.duration
        jobs = [decode_stream(client, model, i, args.stream_tokens, stop_at, gaps) for i in range(args.num_streams)]
        if with_arrivals:
            jobs.append(arrivals(client, model, args, stop_at, ttfts, errors))
        await asyncio.gather(*jobs)
    return {"tpot_p50_ms": pct(gaps, 50), "tpot_p99_ms": pct(gaps, 99), "num_gaps": len(gaps),
            "num_prompts": len(ttfts), "prompt_latency_p50_ms": pct(ttfts, 50),
            "num_failed_prompts": len(errors), "first_error": errors[0] if errors else None}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4608)
    parser.add_argument("--num-streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[2048, 4096], metavar=("MIN", "MAX"))
    parser.add_argument("--arrival-interval", type=float, default=3.0, help="seconds between long prompts")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per phase")
    parser.add_argument("--colocated-cpus", default="0-1")
    parser.add_argument("--prefill-cpus", default="0")
    parser.add_argument("--decode-cpus", default="1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="passed to every server")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    # SIGTERM unwinds (stopping the server in `finally`) instead of orphaning it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            proc, url = start_server(args, config, Path(tmp) / f"{config}.log")
            try:
                results[config] = {"idle": asyncio.run(phase(url, args, False)),
                                   "arrivals": asyncio.run(phase(url, args, True))}
            finally:
                _servers.stop_server(proc)
            r = results[config]
            ratio = (r["arrivals"]["tpot_p99_ms"] / r["idle"]["tpot_p99_ms"]
                     if r["idle"]["tpot_p99_ms"] and r["arrivals"]["tpot_p99_ms"] else None)
            r["p99_ratio"] = ratio
            print(f"{config:8s} idle p50 {fmt(r['idle']['tpot_p50_ms'])} p99 {fmt(r['idle']['tpot_p99_ms'])} | "
                  f"arrivals p50 {fmt(r['arrivals']['tpot_p50_ms'])} p99 {fmt(r['arrivals']['tpot_p99_ms'])} ms | "
                  f"p99 x{ratio:.2f} | {r['arrivals']['num_prompts']} prompts" if ratio else f"{config}: {r}",
                  flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


def fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:7.1f}"


if __name__ == "__main__":
    sys.exit(main())
