"""The numbers of a simulated run: latency percentiles, goodput under the
SLOs (as ``kvferry bench`` defines them) and per-instance prefix-cache hits."""
from __future__ import annotations

import math

from kvferry.bench.metrics import stats_ms
from kvferry.plan.simulator import RequestResult


def slo_values(r: RequestResult) -> dict[str, float]:
    """A request's value (s) of each SLO metric; inf for all when it failed."""
    if r.failed or r.finish_s is None:
        return {k: float("inf") for k in ("ttft", "tpot", "e2e", "itl")}
    return {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2e": r.finish_s - r.request.arrival_s,
            "itl": r.tpot_s or 0.0}  # a simulated decode has even gaps


def meets(r: RequestResult, slo: dict[str, float]) -> bool:
    values = slo_values(r)
    return all(values[k] <= limit for k, limit in slo.items())


def at_percentile_ms(results: list[RequestResult], slo: dict[str, float], pct: float) -> dict[str, float | None]:
    """Each SLO metric's ``pct``-th percentile (nearest rank) over the
    requests, in ms (None: beyond every finite value, i.e. that share of the
    requests failed): what a placement must bring under the limit for ``pct``
    percent of its requests to meet that metric."""
    out: dict[str, float | None] = {}
    for k in slo:
        values = sorted(slo_values(r)[k] for r in results)
        if not values:
            out[k] = None
            continue
        v = values[min(len(values) - 1, max(0, math.ceil(len(values) * pct / 100) - 1))]
        out[k] = None if v == float("inf") else 1000.0 * v
    return out


def summarize(results: list[RequestResult], slo: dict[str, float]) -> dict:
    done = [r for r in results if not r.failed and r.finish_s is not None]
    start = min((r.request.arrival_s for r in results), default=0.0)
    end = max((r.finish_s for r in done), default=start)
    duration = max(end - start, 1e-9)
    good = sum(meets(r, slo) for r in results)
    return {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": sum(r.num_output_tokens for r in done) / duration,
        "slo_ms": {k: v * 1000.0 for k, v in slo.items()},
        "goodput": good / duration if slo else None,
        "slo_attainment_pct": 100.0 * good / len(results) if slo and results else None,
        "ttft_ms": stats_ms([r.ttft_s for r in done]),
        "tpot_ms": stats_ms([t for r in done if (t := r.tpot_s) is not None]),
        "e2e_ms": stats_ms([r.finish_s - r.request.arrival_s for r in done]),
    }


def mean_summary(summaries: list[dict]) -> dict:
    """The mean of several seeded runs' summaries, number by number (nested
    dicts such as ``ttft_ms`` too); a value missing from any run stays None."""
    out = {}
    for key, first in summaries[0].items():
        values = [s.get(key) for s in summaries]
        if isinstance(first, dict):
            out[key] = mean_summary(values)
        elif all(v == first for v in values):
            out[key] = first
        elif isinstance(first, (int, float)) and all(isinstance(v, (int, float)) for v in values):
            out[key] = sum(values) / len(values)
        else:
            out[key] = None
    return out


def instance_stats(instances: list, duration_s: float) -> list[dict]:
    out = []
    for inst in instances:
        queries, hits = inst.cache_stats()
        out.append({"name": inst.name, "role": inst.role,
                    "block_hit_ratio": hits / queries if queries else None,
                    "busy_fraction": min(inst.busy_time / duration_s, 1.0) if duration_s > 0 else None})
    return out
