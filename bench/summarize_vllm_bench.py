"""Summarize `vllm bench serve` result files written by bench/vllm_bench_serve.sh.

Prints a markdown table: per concurrency, the median over runs of each
metric for kvferry and vLLM, and the ratio kvferry / vLLM (> 1 is better for
throughput and goodput, < 1 is better for latency).

    python bench/summarize_vllm_bench.py bench/results/vllm_bench_serve
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

METRICS = [
    ("output_throughput", "output tok/s"),
    ("request_goodput", "goodput req/s"),
    ("p50_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("p50_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
    ("p50_itl_ms", "ITL p50 ms"),
]
_NAME = re.compile(r"(?P<system>kvferry|vllm)_c(?P<c>\d+)_run(?P<run>\d+)\.json$")


def load(folder: Path) -> dict[tuple[int, str], list[dict]]:
    runs: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for path in sorted(folder.glob("*.json")):
        m = _NAME.search(path.name)
        if m:
            runs[(int(m["c"]), m["system"])].append(json.loads(path.read_text()))
    return runs


def main(folder: str) -> int:
    runs = load(Path(folder))
    if not runs:
        print(f"no result files in {folder}", file=sys.stderr)
        return 2
    print("| concurrency | metric | kvferry | vLLM | ratio | runs (kvferry / vLLM) |")
    print("|---|---|---|---|---|---|")
    for c in sorted({c for c, _ in runs}):
        ours, theirs = runs.get((c, "kvferry"), []), runs.get((c, "vllm"), [])
        for key, label in METRICS:
            a = [r[key] for r in ours if key in r]
            b = [r[key] for r in theirs if key in r]
            if not a or not b:
                continue
            ma, mb = statistics.median(a), statistics.median(b)
            ratio = ma / mb if mb else float("inf")
            each = ", ".join(f"{x:.3g}" for x in a) + " / " + ", ".join(f"{x:.3g}" for x in b)
            print(f"| {c} | {label} | {ma:.3g} | {mb:.3g} | {ratio:.2f}x | {each} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/vllm_bench_serve"))
