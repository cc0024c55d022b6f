"""One SchedulerStats for /metrics from several cores: every field summed
(per-owner and per-position lists element-wise), except the KV store's
per-tier counters: the cores of one node share one store, so each reports
the same store totals and they are taken once."""
from __future__ import annotations

from dataclasses import fields

from kvferry.core.stats import SchedulerStats


def merge_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    if len(stats) == 1:
        return stats[0]
    total = SchedulerStats()
    for s in stats:
        for f in fields(SchedulerStats):
            value = getattr(s, f.name)
            if f.name in _SHARED_STORE_FIELDS:
                if value and not getattr(total, f.name):
                    setattr(total, f.name, value)
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


_SHARED_STORE_FIELDS = ("kv_tiers", "kv_tier_tenants")


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
