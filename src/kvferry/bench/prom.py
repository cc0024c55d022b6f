"""The server's own counters from its Prometheus ``/metrics``, scraped before
and after a run: kvferry's (``kvferry:``) or vLLM's (``vllm:``) names."""
from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

# engine_steps / engine_step_seconds: kvferry's busy time per core clock
# (the simulator validation calibrates machine speed from it)
COUNTERS = ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
            "request_success", "engine_steps", "engine_step_seconds")
PREFIXES = ("kvferry:", "vllm:")


@dataclass(slots=True)
class ServerCounters:
    prefix: str                  # "kvferry:" or "vllm:"
    totals: dict[str, float]     # counter name without prefix and _total -> sum over labels


def scrape(base_url: str, timeout_s: float = 10.0, api_key: str | None = None) -> ServerCounters | None:
    """The COUNTERS the server exports; None when it has no Prometheus
    endpoint, exports none of them, or refuses the key (a server with API
    keys serves /metrics to admin keys)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        resp = httpx.get(f"{base_url}/metrics", timeout=timeout_s, headers=headers)
    except httpx.HTTPError:
        return None
    return parse_counters(resp.text) if resp.status_code == 200 else None


def parse_counters(text: str) -> ServerCounters | None:
    """The COUNTERS in a /metrics body (summed over labels); None when it
    holds none of them or is not Prometheus text."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return None
    for prefix in PREFIXES:
        totals: dict[str, float] = {}
        for family in families:
            for s in family.samples:
                # older vLLM names the prefix-cache counters gpu_prefix_cache_*
                name = s.name.removeprefix(prefix).removesuffix("_total").removeprefix("gpu_")
                if s.name.startswith(prefix) and s.name.endswith("_total") and name in COUNTERS:
                    totals[name] = totals.get(name, 0.0) + s.value
        if totals:
            return ServerCounters(prefix, totals)
    return None


def server_delta(before: ServerCounters | None, after: ServerCounters | None) -> dict | None:
    """What the run added to each counter, and the prefix-cache hit rate."""
    if before is None or after is None:
        return None
    delta = {k: after.totals[k] - before.totals.get(k, 0.0) for k in COUNTERS if k in after.totals}
    queries, hits = delta.get("prefix_cache_queries"), delta.get("prefix_cache_hits")
    return {
        "metric_prefix": after.prefix,
        **{f"{k}_delta": v for k, v in delta.items()},
        "prefix_cache_hit_rate": hits / queries if queries else None,
    }
