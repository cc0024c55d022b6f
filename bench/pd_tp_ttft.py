"""Heterogeneous P/D (prefill TP 2, decode TP 1) against homogeneous, on a
long-prompt workload: what the KV transfer adds to TTFT, side by side in
one run.

Each layout is a real ``kvferry serve`` (one core per pool); requests go one
at a time (c1), each a distinct long prompt of token ids, streamed through
the openai client. Per request: TTFT (the prefill core's first token: the
KV streams layer by layer during its forward pass, so the transfer reaches
TTFT only through the CPU its copies take from the forward), and the
hand-over, first token to second (the decode core waits for the last
layer, verifies it and runs its first step: the transfer's tail plus one
TPOT). The colocated layouts at the prefill pool's TP size give the TTFT
without any transfer; the transfer's share of TTFT is
``(TTFT_pd - TTFT_colocated) / TTFT_pd``.

    python bench/pd_tp_ttft.py [--model PATH] [--prompt-tokens 1536] [--requests 5] [--json]

Without --model, a random-weight Llama of 8 layers, hidden 512, 8 query and
8 KV heads (tests/tiny_models.py) is written to a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the tiny model, the server helper)
from tests.serve.server_process import start_server  # noqa: E402
from tests.tiny_models import make_tiny_checkpoint  # noqa: E402

# (name, extra serve args)
LAYOUTS = [
    ("colocated tp1", ["-tp", "1"]),
    ("colocated tp2", ["-tp", "2"]),
    ("P/D p1 d1", ["--mode", "disagg", "--prefill-tp", "1", "--decode-tp", "1"]),
    ("P/D p2 d1", ["--mode", "disagg", "--prefill-tp", "2", "--decode-tp", "1"]),
    ("P/D p2 d2", ["--mode", "disagg", "--prefill-tp", "2", "--decode-tp", "2"]),
]


def one(client: openai.OpenAI, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
    """(TTFT, first-to-second token, mean of the later gaps), seconds."""
    start = time.perf_counter()
    times = []
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text is not None:
            times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times[1:], times[2:])]
    return times[0] - start, times[1] - times[0], statistics.mean(gaps) if gaps else 0.0


def run_layout(name: str, extra: list[str], args, log_dir: Path) -> dict:
    threads = ["--cpu-threads-per-rank", str(args.threads)]
    srv = start_server(log_dir / f"{name.replace(' ', '_').replace('/', '')}.log",
                       ["--model", args.model, "--max-model-len", "4096",
                        "--max-num-batched-tokens", str(args.prompt_tokens + 64), *threads,
                        *extra])
    try:
        with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=600) as client:
            model = client.models.list().data[0].id
            rows = []
            for i in range(args.requests + 1):  # the first warms up (not counted)
                prompt = [(j * (7 + 2 * i) + 13 * i) % 300 + 3 for j in range(args.prompt_tokens)]
                r = one(client, model, prompt, args.max_tokens)
                if i:
                    rows.append(r)
    finally:
        srv.stop()
    ttft, handover, tpot = (statistics.median(col) for col in zip(*rows))
    return {"layout": name, "ttft_ms": 1000 * ttft, "handover_ms": 1000 * handover, "tpot_ms": 1000 * tpot}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompt-tokens", type=int, default=1536)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each rank")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvferry-pd-tp-") as tmp:
        if args.model is None:
            args.model = str(make_tiny_checkpoint(tmp, arch="llama", hidden_size=512, intermediate_size=1024,
                                                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                                                  vocab_size=387, max_position_embeddings=4096))
        load_before = os.getloadavg()
        results = [run_layout(name, extra, args, Path(tmp)) for name, extra in LAYOUTS]
        load_after = os.getloadavg()
    colocated = {r["layout"].split()[-1]: r["ttft_ms"] for r in results if r["layout"].startswith("colocated")}
    for r in results:
        if r["layout"].startswith("P/D"):
            base = colocated[f"tp{r['layout'].split()[1][1:]}"]
            r["transfer_share_of_ttft"] = (r["ttft_ms"] - base) / r["ttft_ms"]
    if args.json:
        print(json.dumps({"results": results, "loadavg_before": load_before, "loadavg_after": load_after}))
        return
    print(f"{args.prompt_tokens}-token prompts, c1, {args.requests} requests a layout, {args.threads} thread(s) "
          f"a rank; load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    print(f"{'layout':16} {'TTFT ms':>9} {'1st->2nd ms':>12} {'TPOT ms':>9} {'transfer share of TTFT':>24}")
    for r in results:
        share = f"{100 * r['transfer_share_of_ttft']:.1f}%" if "transfer_share_of_ttft" in r else ""
        print(f"{r['layout']:16} {r['ttft_ms']:9.1f} {r['handover_ms']:12.1f} {r['tpot_ms']:9.1f} {share:>24}")


if __name__ == "__main__":
    main()
