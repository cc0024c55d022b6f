"""Prometheus metrics, named after vLLM's (``kvferry:`` in place of ``vllm:``);
with ``--metrics-prefix vllm|both`` also under vLLM's own names, labels and
buckets (serve/vllm_metrics.py).

Each app gets its own CollectorRegistry, so tests can build several apps in
one process. Two kinds of source:
- per-request timings and token counts, observed on the event loop as
  outputs arrive (``ServerMetrics`` is the engine client's observer);
- engine state (running / waiting, KV usage, cumulative prefix-cache and
  preemption counts), read at scrape time from the latest stats snapshot
  the engine loop published, so the loop never does metrics work.

With ``--metrics-tenant-labels`` the request, token and prefix-cache
metrics also carry a ``tenant`` label. Tenant names are unbounded input
(one per key file entry), so at most ``--metrics-max-tenants`` keep their
own series (the first seen); the rest share ``tenant="other"``. Off by
default: every label value is another time series per metric.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvferry.core.scheduler import SchedulerStats
from kvferry.outputs import RequestOutput
from kvferry.serve.vllm_metrics import (METRICS_PREFIXES, REQUEST_LATENCY_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS,
                                         VllmMetrics)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets as vLLM's, with a few finer ones at the low end for queue time.
_QUEUE_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1] + REQUEST_LATENCY_BUCKETS


OTHER_TENANTS = "other"
PUBLIC_POOL_LABEL = "(public)"


class TenantLabels:
    """Bounded ``tenant`` label values: the first ``max_tenants`` tenants
    seen keep their names, every later one is ``other``."""

    def __init__(self, max_tenants: int) -> None:
        if max_tenants < 1:
            raise ValueError(f"metrics_max_tenants must be >= 1, got {max_tenants}")
        self.max_tenants = max_tenants
        self._named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.max_tenants:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANTS


class ServerMetrics:
    """Per-request metrics; also the RequestObserver of the engine client.

    ``tenant_labels``: label the per-request and prefix-cache metrics by
    tenant (bounded); None: no tenant label. ``owner_label`` names the core's
    cache owners (tenants, and the public pool's namespace) for labels."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats],
                 tenant_labels: TenantLabels | None = None,
                 owner_label: Callable[[str], str] = lambda owner: owner,
                 prefix: str = "both", max_model_len: int = 2048) -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics_prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self.registry = CollectorRegistry()
        self.prefix = prefix
        self.model_name = model_name
        self.tenant_labels = tenant_labels
        labels = ["model_name"] + (["tenant"] if tenant_labels else [])
        r = self.registry

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        self.ttft = hist("kvferry:time_to_first_token_seconds", "Time to first token, from HTTP arrival.", TTFT_BUCKETS)
        self.itl = hist("kvferry:inter_token_latency_seconds", "Time between successive output tokens of a sequence.",
                        TPOT_BUCKETS)
        self.e2e = hist("kvferry:e2e_request_latency_seconds", "End-to-end latency of finished requests.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("kvferry:request_queue_time_seconds", "Time from engine arrival to first scheduling.",
                               _QUEUE_BUCKETS)
        self.prompt_tokens = counter("kvferry:prompt_tokens", "Prefilled prompt tokens (once per request).")
        self.generation_tokens = counter("kvferry:generation_tokens", "Generated tokens.")
        self._success = Counter("kvferry:request_success", "Finished sequences, by finish reason.",
                                ["model_name", "finished_reason"] + labels[1:], registry=r)
        # The server's node KV store's state ("ok", "restarting", "down"; None:
        # no store of its own). Its tier counters are left out while it is
        # not ok: the cores' last report is a dead store's.
        self.kv_store_health: Callable[[], str] | None = None
        self.registry.register(_EngineStatsCollector(
            model_name, stats, tenant_labels, owner_label,
            store_up=lambda: self.kv_store_health is None or self.kv_store_health() == "ok"))
        # Plain totals over every label, for the periodic stats line (serve/stats_logger.py).
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # vLLM's names (serve/vllm_metrics.py), fed by the same hooks.
        self.vllm = VllmMetrics(r, model_name, stats, max_model_len) if prefix != "kvferry" else None
        if tenant_labels is None:  # expose every series from the start, at 0
            for family in (self.ttft, self.itl, self.e2e, self.queue_time, self.prompt_tokens, self.generation_tokens):
                family.labels(model_name)

    def _of(self, stream) -> list[str]:
        """The label values of a stream's series (after model_name)."""
        return [self.tenant_labels(stream.tenant)] if self.tenant_labels else []

    # -- RequestObserver ------------------------------------------------------
    def on_arrival(self, stream) -> None:
        pass  # counted once it finishes or is aborted

    def on_first_token(self, stream, output: RequestOutput, now: float) -> None:
        labels = [self.model_name, *self._of(stream)]
        self.ttft.labels(*labels).observe(now - stream.arrival_time)
        self.prompt_tokens.labels(*labels).inc(len(output.prompt_token_ids))
        self.prompt_tokens_total += len(output.prompt_token_ids)
        if self.vllm is not None:
            self.vllm.first_token(now - stream.arrival_time, len(output.prompt_token_ids))

    def on_tokens(self, stream, num_tokens: int, gap_s: float | None) -> None:
        labels = [self.model_name, *self._of(stream)]
        self.generation_tokens.labels(*labels).inc(num_tokens)
        self.generation_tokens_total += num_tokens
        if gap_s is not None:
            itl = self.itl.labels(*labels)
            for _ in range(num_tokens):
                itl.observe(gap_s)
        if self.vllm is not None:
            self.vllm.tokens(num_tokens, gap_s)

    def on_sequence_finished(self, stream, output: RequestOutput, now: float) -> None:
        reason = output.outputs[0].finish_reason or "unknown"
        self._success.labels(self.model_name, reason, *self._of(stream)).inc()
        if self.vllm is not None:
            self.vllm.finished(reason)

    def on_request_finished(self, stream, output: RequestOutput, now: float) -> None:
        labels = [self.model_name, *self._of(stream)]
        self.e2e.labels(*labels).observe(now - stream.arrival_time)
        m = output.metrics
        if m is not None and m.first_scheduled_time is not None:
            self.queue_time.labels(*labels).observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if self.vllm is not None:
            self.vllm.request_finished(stream, output, now - stream.arrival_time)

    def on_abort(self, stream) -> None:
        self._success.labels(self.model_name, "abort", *self._of(stream)).inc(stream.n - stream.num_finished)
        if self.vllm is not None:
            self.vllm.finished("abort", stream.n - stream.num_finished)

    def token_totals(self) -> tuple[int, int]:
        """(prompt, generation) tokens seen since start, every tenant together."""
        return self.prompt_tokens_total, self.generation_tokens_total

    def render(self, include_tenants: bool = True) -> bytes:
        """The exposition text; without ``include_tenants``, every sample
        with a ``tenant`` label is left out (for a caller who is not an admin:
        one tenant must not read another's traffic or cache behaviour)."""
        if include_tenants and self.prefix == "both":
            return generate_latest(self.registry)
        return generate_latest(_WithoutTenants(self.registry, include_tenants,
                                               "vllm:" if self.prefix == "kvferry" else
                                               "kvferry:" if self.prefix == "vllm" else None))


class _WithoutTenants:
    """A registry's families, minus their samples labelled by tenant (a
    family left with none is dropped whole), and minus the families named
    with ``drop_prefix`` (--metrics-prefix)."""

    def __init__(self, registry: CollectorRegistry, include_tenants: bool = False,
                 drop_prefix: str | None = None) -> None:
        self.registry = registry
        self.include_tenants = include_tenants
        self.drop_prefix = drop_prefix

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if self.drop_prefix is not None and family.name.startswith(self.drop_prefix):
                continue
            if self.include_tenants:
                yield family
                continue
            samples = [s for s in family.samples if "tenant" not in s.labels]
            if samples:
                kept = Metric(family.name, family.documentation, family.type, family.unit)
                kept.samples = samples
                yield kept


class _EngineStatsCollector(Collector):
    """Gauges and cumulative counters straight from the engine's stats."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats],
                 tenant_labels: TenantLabels | None, owner_label: Callable[[str], str],
                 store_up: Callable[[], bool] = lambda: True) -> None:
        self.model_name = model_name
        self.stats = stats
        self.store_up = store_up
        self.tenant_labels = tenant_labels
        self.owner_label = owner_label

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        yield gauge("kvferry:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("kvferry:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge("kvferry:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                    s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield gauge("kvferry:kv_blocks_used", "KV blocks held by requests.", s.kv_blocks_used)
        yield gauge("kvferry:kv_blocks_total", "KV blocks in the pool.", s.kv_blocks_total)
        if self.tenant_labels is None:
            yield counter("kvferry:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                          s.prefix_queries)
            # Two series whose sum is every hit: "public" in declared public
            # prefixes (shared across tenants), "private" in the caller's own.
            hits = CounterMetricFamily("kvferry:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                       labels=["model_name", "scope"])
            hits.add_metric([self.model_name, "private"], s.prefix_hits - s.prefix_hits_public)
            hits.add_metric([self.model_name, "public"], s.prefix_hits_public)
            yield hits
            yield counter("kvferry:prefix_cache_evictions", "Cached KV blocks evicted to make room.",
                          sum(row[4] for row in s.prefix_by_owner.values()))
        else:
            yield from self._per_tenant_cache_metrics(s)
        yield counter("kvferry:num_preemptions", "Preempted sequences.", s.num_preemptions)
        yield counter("kvferry:engine_steps", "Engine steps that ran a batch, summed over cores.", s.num_steps)
        yield counter("kvferry:engine_step_seconds",
                      "Seconds those steps took on the cores' own clocks (busy time, no HTTP or IPC).",
                      s.step_seconds)
        yield from _kv_tier_metrics(s, label, self.store_up())
        yield from _spec_decode_metrics(s, label)

    def _per_tenant_cache_metrics(self, s: SchedulerStats) -> Iterator[Metric]:
        """The prefix-cache counters split by (bounded) tenant; the public
        pool's evictions under its own label."""
        rows: dict[str, list[int]] = {}
        for owner, row in s.prefix_by_owner.items():
            name = self.owner_label(owner)
            label = name if name == PUBLIC_POOL_LABEL else self.tenant_labels(name)
            acc = rows.setdefault(label, [0] * len(row))
            for i, value in enumerate(row):
                acc[i] += value
        queries = CounterMetricFamily("kvferry:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels=["model_name", "tenant"])
        hits = CounterMetricFamily("kvferry:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   labels=["model_name", "scope", "tenant"])
        evictions = CounterMetricFamily("kvferry:prefix_cache_evictions", "Cached KV blocks evicted to make room.",
                                        labels=["model_name", "tenant"])
        for label, (q, h, public, _refused, evicted, _cached) in sorted(rows.items()):
            if label != PUBLIC_POOL_LABEL:
                queries.add_metric([self.model_name, label], q)
                hits.add_metric([self.model_name, "private", label], h - public)
                hits.add_metric([self.model_name, "public", label], public)
            evictions.add_metric([self.model_name, label], evicted)
        yield from (queries, hits, evictions)

    def describe(self) -> Iterator[Metric]:
        return iter(())


# The node's KV store, per tier (store counters, blocks and bytes).
_TIER_COUNTERS = (
    ("kvferry:kv_tier_hits", "hits", "Blocks found in a KV store tier."),
    ("kvferry:kv_tier_misses", "misses", "Blocks looked for in a KV store tier and not found."),
    ("kvferry:kv_tier_read_bytes", "bytes_read", "Bytes read from a KV store tier."),
    ("kvferry:kv_tier_written_bytes", "bytes_written", "Bytes written to a KV store tier."),
    ("kvferry:kv_tier_quarantined_blocks", "quarantined", "Torn or corrupt blocks found, dropped, never served."),
    ("kvferry:kv_tier_refused_writes", "refused_writes", "Writes a KV store tier refused (quota, full, down)."),
    ("kvferry:kv_tier_load_seconds", "load_seconds", "Seconds spent reading blocks that a KV store tier returned."),
)


def _kv_tier_metrics(s: SchedulerStats, label: list[str], store_up: bool = True) -> Iterator[Metric]:
    tiers = s.kv_tiers if store_up else {}  # no series while the store is down (a new one counts from 0)
    for name, key, doc in _TIER_COUNTERS:
        c = CounterMetricFamily(name, doc, labels=["model_name", "tier"])
        for tier, values in tiers.items():
            c.add_metric(label + [tier], values.get(key, 0))
        yield c
    blocks = GaugeMetricFamily("kvferry:kv_tier_blocks", "Blocks held by a KV store tier.",
                               labels=["model_name", "tier"])
    for tier, values in tiers.items():
        blocks.add_metric(label + [tier], values.get("num_blocks", 0))
    yield blocks
    # The engine's side: what lookups past the device pool found, and what it moved.
    for name, doc, value in (
        ("kvferry:kv_store_query_tokens", "Prompt tokens looked up in the KV store past the device pool.",
         s.kv_store_queries),
        ("kvferry:kv_store_hit_tokens", "Of those, tokens some tier of the KV store held.", s.kv_store_hits),
        ("kvferry:kv_store_loaded_tokens", "Tokens whose KV was loaded from the KV store.", s.kv_loaded_tokens),
        ("kvferry:kv_store_partial_loads", "Loads that came back short (the rest was recomputed).",
         s.kv_partial_loads),
        ("kvferry:kv_store_saved_blocks", "Blocks ordered written down to the KV store.", s.kv_saved_blocks),
    ):
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric(label, value)
        yield c


def _spec_decode_metrics(s: SchedulerStats, label: list[str]) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters (all zero without speculation)."""
    for name, doc, value in (
        ("kvferry:spec_decode_num_drafts", "Verified draft proposals (decode steps that carried drafts).",
         s.num_drafts),
        ("kvferry:spec_decode_num_draft_tokens", "Draft tokens verified.", s.num_draft_tokens),
        ("kvferry:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens),
    ):
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric(label, value)
        yield c
    per_pos = CounterMetricFamily("kvferry:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the proposal (0: first draft).",
                                  labels=["model_name", "position"])
    for pos, value in enumerate(s.num_accepted_tokens_per_pos):
        per_pos.add_metric(label + [str(pos)], value)
    yield per_pos
    # Tokens per verified proposal, the bonus token included (1 = no draft accepted).
    mean = GaugeMetricFamily("kvferry:spec_decode_mean_accepted_length",
                             "Mean tokens emitted per verified proposal (accepted drafts + 1).", labels=["model_name"])
    mean.add_metric(label, 1 + s.num_accepted_tokens / s.num_drafts if s.num_drafts else 0.0)
    yield mean
