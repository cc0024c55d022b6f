"""vLLM's metric names at /metrics: every series vLLM's published Grafana
dashboard reads has samples after a short real load, with vLLM's labels,
types and bucket boundaries; --metrics-prefix picks the names."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvferry.core.scheduler import SchedulerStats
from kvferry.serve.metrics import ServerMetrics
from tests.serve.server_process import MODEL_NAME

pytestmark = pytest.mark.usefixtures("healthy")

QUERIES = Path(__file__).parent / "fixtures" / "vllm_grafana_queries.txt"
_SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def dashboard_series() -> set[str]:
    """The series names the dashboard's expressions read."""
    lines = [line for line in QUERIES.read_text().splitlines() if line and not line.startswith("#")]
    names = {name for line in lines for name in re.findall(r"vllm:[a-z0-9_]+", line)}
    assert len(names) >= 15, names
    return names


def scrape(server) -> dict[str, list]:
    r = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert r.status_code == 200
    return {family.name: family for family in text_string_to_metric_families(r.text)}


def samples_of(families: dict, series: str) -> list:
    return [s for f in families.values() for s in f.samples if s.name == series]


def test_dashboard_queries_have_data_after_load(server, client):
    # A short load: plain, streamed, chat, and two sequences per request.
    client.completions.create(model=MODEL_NAME, prompt="The weather today is", max_tokens=6,
                              extra_body={"ignore_eos": True})
    for _ in client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4, stream=True):
        pass
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    client.completions.create(model=MODEL_NAME, prompt="A list of colors:", max_tokens=3, n=2)
    assert server.wait_for_metric("vllm:e2e_request_latency_seconds_count", lambda v: v >= 4, engine="0")
    families = scrape(server)
    for series in sorted(dashboard_series()):
        samples = samples_of(families, series)
        assert samples, f"{series}: no samples"
        assert all(s.labels.get("model_name") == MODEL_NAME for s in samples), (series, samples)
        if series.endswith(("_count", "_sum")) or series.endswith("_tokens_total"):
            assert sum(s.value for s in samples) > 0, f"{series}: no data after the load"
    success = {s.labels["finished_reason"]: s.value for s in samples_of(families, "vllm:request_success_total")}
    assert success["length"] >= 5 and {"stop", "length", "abort"} <= success.keys()


def test_types_labels_and_buckets_are_vllms(server):
    families = scrape(server)
    expected_types = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram",
    }
    for name, kind in expected_types.items():
        assert families[name].type == kind, (name, families[name].type)
        assert all(set(s.labels) - {"le", "finished_reason"} == {"model_name", "engine"}
                   for s in families[name].samples), name

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in families[name].samples if s.name == f"{name}_bucket"][:-1]

    assert bounds("vllm:time_to_first_token_seconds") == [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]
    assert bounds("vllm:request_queue_time_seconds") == bounds("vllm:e2e_request_latency_seconds") == [
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
        1920.0, 7680.0]
    assert bounds("vllm:time_per_output_token_seconds")[:3] == [0.01, 0.025, 0.05]
    # 1-2-5 up to the server's max_model_len (1024)
    assert bounds("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    # kvferry's own names are still there (default --metrics-prefix both)
    assert "kvferry:time_to_first_token_seconds" in families


@pytest.mark.parametrize("prefix, present, absent", [("vllm", "vllm:", "kvferry:"), ("kvferry", "kvferry:", "vllm:"),
                                                     ("both", "vllm:", None)])
def test_metrics_prefix_picks_the_names(prefix, present, absent):
    metrics = ServerMetrics(MODEL_NAME, lambda: SchedulerStats(), prefix=prefix, max_model_len=1024)
    for include_tenants in (True, False):
        names = [f.name for f in text_string_to_metric_families(metrics.render(include_tenants).decode())]
        assert any(n.startswith(present) for n in names)
        if absent is not None:
            assert not any(n.startswith(absent) for n in names), names
    with pytest.raises(ValueError, match="metrics_prefix"):
        ServerMetrics(MODEL_NAME, lambda: SchedulerStats(), prefix="prom")


def test_metrics_prefix_flag():
    from kvferry.serve.api_flags import ApiOptions
    from tests.serve.test_cli_flags import serve_args

    assert ApiOptions.from_args(serve_args()).metrics_prefix == "both"
    assert ApiOptions.from_args(serve_args("--metrics-prefix", "vllm")).metrics_prefix == "vllm"
    with pytest.raises(SystemExit):
        serve_args("--metrics-prefix", "prom")
