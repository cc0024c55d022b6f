"""vLLM's metric names, labels, types and buckets (vLLM v1), for the
dashboards and alerts built for vLLM (``--metrics-prefix vllm|both``).

Every figure kvferry measures is exported under vLLM's name with vLLM's
labels (``model_name``, ``engine``) and bucket boundaries, so a Grafana
board written for vLLM reads kvferry unchanged. ``engine`` is always "0":
kvferry merges its cores' stats into one set (its own ``kvferry:`` names
carry the per-tier and per-tenant detail).

Two names vLLM v0 had and its published dashboard still plots are kept
with their true value for kvferry: ``vllm:num_requests_swapped`` and
``vllm:cpu_cache_usage_perc`` are always 0 (kvferry never swaps a running
request's KV out to a CPU pool; it preempts and recomputes, counted in
``vllm:num_preemptions_total``).

Not exported: ``vllm:iteration_tokens_total`` (the front end does not see
per-step token counts), LoRA and spec-decode names (kvferry's own
``kvferry:spec_*`` names carry the latter).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvferry.core.scheduler import SchedulerStats
from kvferry.outputs import RequestOutput

METRICS_PREFIXES = ("vllm", "kvferry", "both")

# vLLM v1's bucket boundaries.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
N_BUCKETS = [1, 2, 5, 10, 20]
FINISH_REASONS = ("stop", "length", "abort")
ENGINE = "0"


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class VllmMetrics:
    """The per-request series under vLLM's names, in ``registry``, and a
    collector for the engine-state ones. Fed by ServerMetrics's observer
    hooks (the same events as the ``kvferry:`` series)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, stats: Callable[[], SchedulerStats],
                 max_model_len: int) -> None:
        self.labels = [model_name, ENGINE]
        names = ["model_name", "engine"]
        tokens = buckets_1_2_5(max_model_len)

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(*self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(*self.labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                         TPOT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        TPOT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_hist = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_hist = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                    tokens)
        self.max_generation = hist("vllm:request_max_num_generation_tokens",
                                   "Histogram of maximum number of requested generation tokens.", tokens)
        self.max_tokens_param = hist("vllm:request_params_max_tokens",
                                     "Histogram of the max_tokens request parameter.", tokens)
        self.n_param = hist("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=registry)
        self.success = {reason: success.labels(*self.labels, reason) for reason in FINISH_REASONS}
        self._success_family = success
        registry.register(_VllmEngineCollector(self.labels, stats))

    # -- fed by ServerMetrics --------------------------------------------------
    def first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def tokens(self, num_tokens: int, gap_s: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if gap_s is not None:
            for _ in range(num_tokens):
                self.itl.observe(gap_s)
                self.tpot.observe(gap_s)

    def finished(self, reason: str, count: int = 1) -> None:
        counter = self.success.get(reason)
        if counter is None:  # a reason vLLM has no series for ("error", ...): its own series
            counter = self.success[reason] = self._success_family.labels(*self.labels, reason)
        counter.inc(count)

    def request_finished(self, stream, output: RequestOutput, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        self.prompt_hist.observe(len(output.prompt_token_ids))
        self.generation_hist.observe(sum(len(o.token_ids) for o in output.outputs))
        self.n_param.observe(stream.n)
        max_tokens = getattr(stream, "max_tokens", None)
        if max_tokens is not None:
            self.max_tokens_param.observe(max_tokens)
            self.max_generation.observe(max_tokens)
        m = output.metrics
        if m is None or m.first_scheduled_time is None:
            return
        self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            self.prefill.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
            if m.finished_time is not None:
                self.decode.observe(max(0.0, m.finished_time - m.first_token_time))
        if m.finished_time is not None:
            self.inference.observe(max(0.0, m.finished_time - m.first_scheduled_time))


class _VllmEngineCollector(Collector):
    """vLLM's scheduler and cache series, read from the engine's stats at scrape time."""

    def __init__(self, labels: list[str], stats: Callable[[], SchedulerStats]) -> None:
        self.labels = labels
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("vllm:num_requests_swapped", "Number of requests swapped to CPU (always 0: kvferry never swaps).", 0),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. "
             "DEPRECATED: Use vllm:kv_cache_usage_perc instead.", usage),
            ("vllm:cpu_cache_usage_perc", "CPU swap-space usage (always 0: kvferry never swaps).", 0.0),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
            g.add_metric(self.labels, value)
            yield g
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             s.prefix_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_hits),
            ("vllm:gpu_prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens. "
             "DEPRECATED: Use vllm:prefix_cache_queries instead.", s.prefix_queries),
            ("vllm:gpu_prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens. "
             "DEPRECATED: Use vllm:prefix_cache_hits instead.", s.prefix_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
            c.add_metric(self.labels, value)
            yield c

    def describe(self) -> Iterator[Metric]:
        return iter(())
