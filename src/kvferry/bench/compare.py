"""``kvferry bench compare A.json B.json``: the headline numbers of two runs
side by side with B / A."""
from __future__ import annotations

import json
from pathlib import Path

from kvferry.bench.workloads import BenchError

# (label, path into the summary, higher is better)
ROWS = [
    ("completed requests", ("completed",), True),
    ("failed requests", ("failed",), False),
    ("request throughput (req/s)", ("request_throughput",), True),
    ("goodput (req/s)", ("goodput",), True),
    ("SLO attainment (%)", ("slo_attainment_pct",), True),
    ("output tok/s", ("output_token_throughput",), True),
    ("total tok/s", ("total_token_throughput",), True),
    ("prefix hit rate (server)", ("server", "prefix_cache_hit_rate"), True),
] + [(f"{m.upper()} {s} (ms)", (f"{m}_ms", s), False)
     for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p90", "p99")]


def load_summary(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise BenchError(f"compare: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if "sweep" in data:  # a sweep: compare its last (highest-rate) point
        data = data["sweep"][-1]
    if "summary" not in data:
        raise BenchError(f"compare: {path} is not a kvferry bench result")
    return {**data["summary"], "server": data.get("server") or {}}


def _get(summary: dict, keys: tuple[str, ...]):
    for k in keys:
        summary = summary.get(k) if isinstance(summary, dict) else None
    return summary


def compare_table(a_path: str, b_path: str) -> str:
    a, b = load_summary(a_path), load_summary(b_path)
    lines = [f"{'metric':<28} {'A':>12} {'B':>12} {'B/A':>8}",
             f"{'':<28} {Path(a_path).name[:12]:>12} {Path(b_path).name[:12]:>12}"]
    for label, keys, higher_better in ROWS:
        va, vb = _get(a, keys), _get(b, keys)
        if va is None and vb is None:
            continue
        ratio = f"{vb / va:.2f}x" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else "-"
        mark = ""
        if ratio != "-" and vb != va:
            mark = " better" if (vb > va) == higher_better else " worse"
        lines.append(f"{label:<28} {_fmt(va):>12} {_fmt(vb):>12} {ratio:>8}{mark}")
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if isinstance(v, int) or abs(v) >= 100 else f"{v:.3g}"
