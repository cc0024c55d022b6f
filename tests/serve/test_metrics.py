"""Prometheus metrics at /metrics move with the traffic."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.server_process import MODEL_NAME

pytestmark = pytest.mark.usefixtures("healthy")

EXPECTED = [
    "kvferry:time_to_first_token_seconds_count",
    "kvferry:inter_token_latency_seconds_count",
    "kvferry:e2e_request_latency_seconds_count",
    "kvferry:request_queue_time_seconds_count",
    "kvferry:prompt_tokens_total",
    "kvferry:generation_tokens_total",
    "kvferry:prefix_cache_queries_total",
    "kvferry:prefix_cache_hits_total",
    "kvferry:num_preemptions_total",
    "kvferry:engine_steps_total",
    "kvferry:engine_step_seconds_total",
    "kvferry:num_requests_running",
    "kvferry:num_requests_waiting",
    "kvferry:kv_cache_usage_perc",
    "kvferry:kv_blocks_used",
]


def test_metrics_exposed_with_model_label(server):
    r = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    labels_of: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            labels_of.setdefault(sample.name, []).append(sample.labels)
    for name in EXPECTED:
        assert labels_of.get(name), f"{name} missing"
        assert all(labels.get("model_name") == MODEL_NAME for labels in labels_of[name]), (name, labels_of[name])


def test_counters_move_after_requests(server, client):
    before = server.metrics()
    r = client.completions.create(model=MODEL_NAME, prompt="The weather today is", max_tokens=5,
                                  extra_body={"ignore_eos": True})
    assert server.wait_for_metric("kvferry:e2e_request_latency_seconds_count",
                                  lambda v: v > before.get(("kvferry:e2e_request_latency_seconds_count", ()), 0))
    after = server.metrics()

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("kvferry:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("kvferry:generation_tokens_total") == 5
    assert delta("kvferry:time_to_first_token_seconds_count") == 1
    assert delta("kvferry:inter_token_latency_seconds_count") == 4  # gaps between 5 tokens
    assert delta("kvferry:request_queue_time_seconds_count") == 1
    assert delta("kvferry:request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("kvferry:prefix_cache_queries_total") >= r.usage.prompt_tokens
    # one step per token at least (the prompt in one step, then 4 decodes), but
    # for accepted drafts (the default speculates: a step then yields 1 + accepted), and the time they took
    steps, seconds = delta("kvferry:engine_steps_total"), delta("kvferry:engine_step_seconds_total")
    assert steps + delta("kvferry:spec_decode_num_accepted_tokens_total") >= 5
    assert 0 < seconds < after[("kvferry:e2e_request_latency_seconds_sum", ())]
    assert after[("kvferry:kv_blocks_used", ())] == 0
    assert 0 <= after[("kvferry:kv_cache_usage_perc", ())] <= 1
