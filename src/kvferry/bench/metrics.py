"""Per-request records and the summary of a run: latency percentiles,
throughput and goodput. Pure functions of the records; no I/O.

Definitions (as vLLM's ``bench serve``):
- TTFT: request sent -> first chunk with text.
- ITL: the gaps between successive chunks with text (a chunk counts once).
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests with one
  output token have none.
- Goodput (DistServe): completed requests per second that meet every SLO;
  attainment: the share of all requests (failed ones included) that do.
- Useful output tokens: the completion tokens of the requests that meet
  every SLO (all completed requests' without an SLO). Cost per million
  useful tokens: price per hour * run hours / useful tokens * 1e6 (the
  same formula as ``kvferry plan --hardware``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass(slots=True)
class RequestRecord:
    request_id: int
    tenant: str
    start_s: float                       # send time, seconds after the run started
    input_len: int                       # intended prompt length (the workload's)
    max_tokens: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0               # from the server's usage
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.completion_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RequestRecord:
        return cls(**d)


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft:500,tpot:50`` (milliseconds) -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        name, sep, value = part.partition(":")
        name = name.strip().lower().removesuffix("_ms")
        name = "e2e" if name == "e2el" else name
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or name not in SLO_METRICS or ms <= 0:
            raise ValueError(f"--slo: expected NAME:MS[,NAME:MS] with NAME in {'/'.join(SLO_METRICS)} "
                             f"and MS > 0, got {part!r}")
        slo[name] = ms / 1000.0
    return slo


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    """A failed request never meets an SLO; a missing TPOT (one output token) is 0."""
    if not r.ok:
        return False
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2e": r.e2e_s,
              "itl": max(r.itl_s) if r.itl_s else 0.0}
    return all(values[k] is not None and values[k] <= limit for k, limit in slo.items())


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean and percentiles in milliseconds (None when there are no values)."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values_s) * 1000.0
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float]) -> dict:
    """The headline numbers of one run."""
    ok = [r for r in records if r.ok]
    duration_s = max(duration_s, 1e-9)
    good = [r for r in records if meets_slo(r, slo)]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    errors = Counter(r.error for r in records if not r.ok)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(errors.most_common(10)),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "input_token_throughput": prompt / duration_s,
        "output_token_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "total_prompt_tokens": prompt,
        "total_output_tokens": output,
        "useful_output_tokens": sum(r.completion_tokens for r in good),
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "client_prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        "slo_ms": {k: v * 1000.0 for k, v in slo.items()},
        "goodput": len(good) / duration_s if slo else None,
        "slo_attainment_pct": 100.0 * len(good) / len(records) if slo and records else None,
        "ttft_ms": stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": stats_ms([g for r in ok for g in r.itl_s]),
        "e2e_ms": stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


def cost_per_million_useful_tokens(price_per_hour: float | None, run_s: float,
                                   useful_output_tokens: int) -> float | None:
    """(price per hour * run hours) / useful output tokens * 1e6; None when
    unpriced or when no token was useful (an infinite cost: JSON has no inf)."""
    if price_per_hour is None or useful_output_tokens <= 0:
        return None
    return price_per_hour * (run_s / 3600.0) / useful_output_tokens * 1e6


def add_cost(summary: dict, price_per_hour: float) -> dict:
    """A run summary (``summarize``) with its cost: ``price_per_hour`` (of
    the whole served fleet) over the run's wall time and its useful tokens."""
    summary["price_per_hour"] = price_per_hour
    summary["cost_per_million_useful_tokens"] = cost_per_million_useful_tokens(
        price_per_hour, summary["duration_s"], summary["useful_output_tokens"])
    return summary


def cost_of_run(result: dict, price_per_hour: float) -> float | None:
    """The cost per million useful tokens of a recorded run (a ``kvferry
    bench --output`` JSON object: its records, wall time and SLO), priced
    after the fact."""
    records = [RequestRecord.from_json(r) for r in result["records"]]
    summary = result["summary"]
    slo = {k: v / 1000.0 for k, v in (summary.get("slo_ms") or {}).items()}
    useful = sum(r.completion_tokens for r in records if meets_slo(r, slo))
    return cost_per_million_useful_tokens(price_per_hour, summary["duration_s"], useful)


def summarize_by_tenant(records: list[RequestRecord], duration_s: float, slo: dict[str, float]) -> dict:
    """The summary per tenant (only when there is more than one)."""
    tenants = sorted({r.tenant for r in records})
    if len(tenants) < 2:
        return {}
    out = {}
    for t in tenants:
        s = summarize([r for r in records if r.tenant == t], duration_s, slo)
        out[t] = {k: s[k] for k in ("num_requests", "completed", "failed", "request_throughput",
                                    "goodput", "slo_attainment_pct", "client_prefix_hit_rate",
                                    "ttft_ms", "tpot_ms", "e2e_ms")}
    return out
