"""Served speculation over tensor-parallel ranks, side by side in one run:
kvferry TP 1 (2 threads) and TP 2 (1 thread a rank), each with its
defaults and/or ``--speculative-config off``, all up at once and driven at
concurrency 1 in turns (the order rotating each round), so that every
server sees the same prompts under the same load.

Per server: output tok/s over its own requests' wall time, the median
time between stream chunks, and from its ``/metrics`` the drafts it
verified and accepted (whether speculation drafted at all), and the CPU
seconds its process tree (front end, engine core, ranks) spent per output
token (/proc; what other processes' load changes least).

    python bench/tp_spec_served.py [--layers 16] [--rounds 4] [--output-len 64]
        [--configs tp1 tp2 tp1-off tp2-off] [--prompts random|repeat|FILE.json]

``random``: vLLM's random dataset's kind of prompt (random token ids
decoded to text, 256 tokens); ``repeat``: a passage repeated, where
speculation's drafts hold; a JSON list of strings: those prompts (e.g.
vLLM's random dataset's, saved from ``vllm.benchmarks.datasets.RandomDataset``).

Memory: every server holds the whole checkpoint (TP 2: half a rank), about
2.6 GiB each at 16 layers; four at once need ~11 GiB (on a 23 GiB host
shared with other work the kernel killed an engine core for it: run two
configs at a time there, or fewer layers).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer_models import LLAMA_1B, random_checkpoint  # noqa: E402
from _servers import start_server, stop_server  # noqa: E402

CONFIGS = {"tp1": (1, ""), "tp2": (2, ""), "tp1-off": (1, "off"), "tp2-off": (2, "off")}


def tree_cpu_seconds(root: int) -> float:
    """utime + stime of ``root`` and its descendants (clock ticks -> s)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        pid, ppid = int(entry), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        stats[pid] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total


def spec_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    got = {}
    for line in text.splitlines():
        for name in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
            if line.startswith(f"kvferry:{name}_total") or line.startswith(f"kvferry:{name}{{"):
                got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return got.get("spec_decode_num_draft_tokens", 0.0), got.get("spec_decode_num_accepted_tokens", 0.0)


def one_request(url: str, prompt: str, max_tokens: int) -> tuple[int, float, list[float]]:
    """Output tokens, wall seconds, gaps between stream chunks."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    last, gaps, tokens = None, [], 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return tokens, time.monotonic() - start, gaps


def prompts(kind: str, model: Path, n: int, length: int, seed: int) -> list[str]:
    if kind not in ("random", "repeat"):
        return json.loads(Path(kind).read_text())[:n]
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    rng = random.Random(seed)
    vocab = tok.get_vocab_size()
    if kind == "random":
        return [tok.decode([rng.randrange(vocab) for _ in range(length)]) for _ in range(n)]
    return [tok.decode([rng.randrange(vocab) for _ in range(24)] * (length // 24)) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--configs", nargs="+", default=["tp1", "tp2"], choices=sorted(CONFIGS))
    ap.add_argument("--prompts", default="random")
    ap.add_argument("--kvferry-args", default="", help="more flags for every server")
    ap.add_argument("--logs", default="/tmp/tp_spec_served")
    a = ap.parse_args()
    model = random_checkpoint("llama-1b", LLAMA_1B, num_hidden_layers=a.layers)
    texts = prompts(a.prompts, model, a.rounds + 1, a.input_len, seed=1)
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for name in a.configs:
            tp, spec = CONFIGS[name]
            flags = ["--model", str(model), "--dtype", "bfloat16", "--max-model-len", "2048",
                     "--kv-cache-memory-gb", "0.25", "--max-num-seqs", "4", "--disable-uvicorn-access-log", "--served-model-name", "m"]
            if tp > 1:
                flags += ["--tensor-parallel-size", str(tp), "--cpu-threads-per-rank", "1"]
            if spec:
                flags += ["--speculative-config", spec]
            flags += a.kvferry_args.split()
            env = {"OMP_NUM_THREADS": str(2 // tp), "KVFERRY_CPU_BIND": "1"}
            servers[name] = start_server(flags, logs / f"{name}.log", env=env)
            print(f"{name}: ready", flush=True)
        for name, (_, url) in servers.items():  # a first request each: the warm-up's steps out of the figures
            one_request(url, texts[-1], 8)
        before = {name: (tree_cpu_seconds(p.pid), *spec_counters(url)) for name, (p, url) in servers.items()}
        tokens = {name: 0 for name in servers}
        wall = {name: 0.0 for name in servers}
        gaps: dict[str, list[float]] = {name: [] for name in servers}
        names = list(servers)
        for i in range(a.rounds):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                n, s, g = one_request(servers[name][1], texts[i], a.output_len)
                tokens[name] += n
                wall[name] += s
                gaps[name] += g
            print(f"round {i}: load {os.getloadavg()[0]:.1f}", flush=True)
        rows = {}
        for name, (p, url) in servers.items():
            cpu0, d0, acc0 = before[name]
            drafted, accepted = spec_counters(url)
            rows[name] = {"tok_s": round(tokens[name] / wall[name], 2),
                          "chunk_gap_p50_ms": round(statistics.median(gaps[name]) * 1e3, 1),
                          "cpu_ms_per_token": round((tree_cpu_seconds(p.pid) - cpu0) * 1e3 / tokens[name], 1),
                          "drafted": int(drafted - d0), "accepted": int(accepted - acc0)}
            print(name, json.dumps(rows[name]), flush=True)
        print("load average", os.getloadavg())
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
