"""Summarize `vllm bench serve` result files, named ``SYSTEM_cN_runR.json``
(bench/vllm_bench_serve.sh writes ``kvferry_*`` and ``vllm_*``;
bench/tp_vs_vllm.py and bench/moe_vs_vllm.py name a configuration each,
e.g. ``kvferry-tp2_c16_run1.json``).

Prints a markdown table: per concurrency, the median over runs of each
metric for two systems, and the ratio first / second (> 1 is better for
throughput and goodput, < 1 is better for latency).

    python bench/summarize_vllm_bench.py bench/results/vllm_bench_serve [FIRST SECOND]
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
    ("p99_itl_ms", "ITL p99 ms"),
    ("p99_e2el_ms", "E2E p99 ms"),
]
_NAME = re.compile(r"(?:^|/)(?P<system>[A-Za-z0-9.-]+)_c(?P<c>\d+)_run(?P<run>\d+)\.json$")

Runs = dict[tuple[int, str], list[dict]]


def load(folder: Path) -> Runs:
    """(concurrency, system) -> the result of each run, in run order."""
    runs: Runs = defaultdict(list)
    for path in sorted(folder.glob("*.json"), key=lambda p: (p.name.rsplit("_run", 1)[0], _run_number(p))):
        m = _NAME.search(path.name)
        if m:
            runs[(int(m["c"]), m["system"])].append(json.loads(path.read_text()))
    return runs


def _run_number(path: Path) -> int:
    m = _NAME.search(path.name)
    return int(m["run"]) if m else 0


def median(runs: Runs, c: int, system: str, key: str) -> float | None:
    values = [r[key] for r in runs.get((c, system), []) if r.get(key) is not None]
    return statistics.median(values) if values else None


def table(runs: Runs, first: str, second: str, labels: tuple[str, str] | None = None) -> list[str]:
    """Markdown lines comparing ``first`` with ``second`` at every
    concurrency both have."""
    a_label, b_label = labels or (first, second)
    lines = [f"| concurrency | metric | {a_label} | {b_label} | ratio | runs ({a_label} / {b_label}) |",
             "|---|---|---|---|---|---|"]
    for c in sorted({c for c, s in runs if s == first} & {c for c, s in runs if s == second}):
        for key, label in METRICS:
            a = [r[key] for r in runs[(c, first)] if r.get(key) is not None]
            b = [r[key] for r in runs[(c, second)] if r.get(key) is not None]
            if not a or not b:
                continue
            ma, mb = statistics.median(a), statistics.median(b)
            ratio = ma / mb if mb else float("inf")
            each = ", ".join(f"{x:.3g}" for x in a) + " / " + ", ".join(f"{x:.3g}" for x in b)
            lines.append(f"| {c} | {label} | {ma:.3g} | {mb:.3g} | {ratio:.2f}x | {each} |")
    return lines


def main(folder: str, first: str = "kvferry", second: str = "vllm") -> int:
    runs = load(Path(folder))
    if not runs:
        print(f"no result files in {folder}", file=sys.stderr)
        return 2
    labels = ("kvferry", "vLLM") if (first, second) == ("kvferry", "vllm") else None
    print("\n".join(table(runs, first, second, labels)))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]) if len(sys.argv) > 1 else main("bench/results/vllm_bench_serve"))
