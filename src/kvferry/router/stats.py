"""One SchedulerStats for /metrics from several cores: every field summed
(per-owner and per-position lists element-wise), except the KV store's
per-tier counters: the cores of one node share one store, so each reports
the same store totals; they are taken once per store (``kv_store_id``) and
the stores' added up (on a Ray cluster, one store per node)."""
from __future__ import annotations

from dataclasses import fields

from kvferry.types.stats import SchedulerStats


def merge_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    if len(stats) == 1:
        return stats[0]
    total = SchedulerStats()
    stores_seen: set[str] = set()
    for s in stats:
        if s.kv_tiers and s.kv_store_id not in stores_seen:
            stores_seen.add(s.kv_store_id)
            _add_store(total, s)
        for f in fields(SchedulerStats):
            value = getattr(s, f.name)
            if f.name in _SHARED_STORE_FIELDS:
                continue
            if isinstance(value, (int, float)):
                setattr(total, f.name, getattr(total, f.name) + value)
            elif isinstance(value, list):
                setattr(total, f.name, _add_lists(getattr(total, f.name), value))
            elif isinstance(value, dict):
                merged = getattr(total, f.name)
                for key, counts in value.items():
                    merged[key] = _add_lists(merged.get(key, []), counts)
    return total


_SHARED_STORE_FIELDS = ("kv_tiers", "kv_tier_tenants", "kv_store_id")


def _add_store(total: SchedulerStats, s: SchedulerStats) -> None:
    """One store's per-tier counters added to ``total``'s."""
    for tier, values in s.kv_tiers.items():
        merged = total.kv_tiers.setdefault(tier, {})
        for key, value in values.items():
            merged[key] = merged.get(key, 0) + value
    for tier, tenants in s.kv_tier_tenants.items():
        merged_tenants = total.kv_tier_tenants.setdefault(tier, {})
        for tenant, counts in tenants.items():
            merged_tenants[tenant] = _add_lists(merged_tenants.get(tenant, []), counts)


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
