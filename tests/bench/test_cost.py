"""``kvferry bench --price-per-hour``: the cost per million useful tokens of
a run, from its records (no server), checked by hand; one live run against
the bench tests' server, whose JSON and summary carry the same figure; and
the flag's validation through the real CLI."""
from __future__ import annotations

import json

import pytest

from kvferry.bench.metrics import RequestRecord, add_cost, cost_of_run, parse_slo, summarize


def rec(i: int, ttft: float, e2e: float, out: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(i, "t", 0.0, 10, out, ttft_s=ttft, e2e_s=e2e, prompt_tokens=10,
                         completion_tokens=out, error=error)


RECORDS = [
    rec(0, 0.100, 1.000, 10),   # TPOT 0.1: meets ttft 200 / tpot 100 -> 10 useful tokens
    rec(1, 0.300, 1.200, 10),   # TTFT 300 > 200: its 10 tokens are not useful
    rec(2, 0.150, 2.150, 11),   # TPOT 0.2 > 0.1: not useful
    rec(3, 0.050, 0.050, 1),    # one token, meets: 1 useful token
    rec(4, 0.0, 0.0, 0, error="HTTP 400: bad"),
]


def test_cost_per_useful_token_of_a_recorded_run(tmp_path):
    slo = parse_slo("ttft:200,tpot:100")
    # a run of 36 s on a fleet of 2.5 per hour: 2.5 * 0.01 h = 0.025 for 11 useful tokens
    summary = add_cost(summarize(RECORDS, duration_s=36.0, slo=slo), 2.5)
    assert summary["useful_output_tokens"] == 11 and summary["total_output_tokens"] == 32
    assert summary["cost_per_million_useful_tokens"] == pytest.approx(0.025 / 11 * 1e6)  # 2272.7
    # the same figure from the run's JSON as `kvferry bench --output` writes it
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"summary": summarize(RECORDS, 36.0, slo), "records": [r.to_json() for r in RECORDS]}))
    assert cost_of_run(json.loads(path.read_text()), 2.5) == pytest.approx(0.025 / 11 * 1e6)
    # without an SLO every completed token is useful: 32
    assert add_cost(summarize(RECORDS, 36.0, {}), 2.5)["cost_per_million_useful_tokens"] == pytest.approx(
        0.025 / 32 * 1e6)
    # nothing useful: no finite cost, said as None (JSON has no infinity)
    none = add_cost(summarize([RECORDS[1], RECORDS[4]], 36.0, slo), 2.5)
    assert none["useful_output_tokens"] == 0 and none["cost_per_million_useful_tokens"] is None


def test_a_live_run_reports_its_cost(server, tmp_path, capsys):
    from kvferry.cli import main

    out = tmp_path / "run.json"
    code = main(["bench", "--url", server.base_url, "--no-progress", "--no-plots", "--output", str(out),
                 "--workload", "random", "--input-len", "16", "--output-len", "4", "--ignore-eos",
                 "--num-requests", "3", "--rate", "50", "--slo", "ttft:60000,tpot:60000", "--price-per-hour", "7.2"])
    assert code == 0
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["useful_output_tokens"] == 12 and s["price_per_hour"] == 7.2  # 3 requests x 4 tokens, all within
    # 7.2 per hour is 0.002 per second of the run's wall time
    assert s["cost_per_million_useful_tokens"] == pytest.approx(0.002 * s["duration_s"] / 12 * 1e6)
    assert cost_of_run(result, 7.2) == pytest.approx(s["cost_per_million_useful_tokens"])
    assert f"cost: {s['cost_per_million_useful_tokens']:.4g} per million useful tokens" in capsys.readouterr().out


@pytest.mark.parametrize("price", ["-1", "nan", "inf"])
def test_a_bad_price_is_refused_before_any_request(price, capsys):
    from kvferry.cli import main

    # port 9 (discard): nothing listens; the flag is refused before any request is sent
    code = main(["bench", "--url", "http://127.0.0.1:9", "--workload", "random", "--price-per-hour", price])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--price-per-hour must be a finite number >= 0" in err, err
