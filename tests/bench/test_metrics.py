"""kvferry bench without a server: goodput arithmetic, SLO parsing, arrivals,
trace prompts, workload shapes and the compare table."""
from __future__ import annotations

import json
import random
import statistics

import pytest

from kvferry.bench.arrivals import intervals
from kvferry.bench.compare import compare_table
from kvferry.bench.metrics import RequestRecord, meets_slo, parse_slo, summarize
from kvferry.bench.text import block_text, words
from kvferry.bench.trace import TraceEntry, load_trace, trace_prompt
from kvferry.bench.workloads import BenchError, LengthDist, shared_prefix_workload


def rec(i: int, ttft: float, e2e: float, out: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(i, "t", 0.0, 10, out, ttft_s=ttft, e2e_s=e2e, prompt_tokens=10,
                         completion_tokens=out, error=error)


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        rec(0, 0.100, 1.000, 10),   # tpot 0.1 -> meets ttft 200 / tpot 100
        rec(1, 0.300, 1.200, 10),   # ttft 300 > 200
        rec(2, 0.150, 2.150, 11),   # tpot 0.2 > 0.1
        rec(3, 0.050, 0.050, 1),    # one token: no TPOT, meets
        rec(4, 0.0, 0.0, 0, error="HTTP 400: bad"),  # failed: never meets
    ]
    slo = parse_slo("ttft:200,tpot:100")
    assert slo == {"ttft": 0.2, "tpot": 0.1}
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, False]
    s = summarize(records, duration_s=4.0, slo=slo)
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["slo_attainment_pct"] == pytest.approx(100 * 2 / 5)
    assert s["completed"] == 4 and s["failed"] == 1 and s["errors"] == {"HTTP 400: bad": 1}
    assert s["request_throughput"] == pytest.approx(4 / 4.0)
    assert s["output_token_throughput"] == pytest.approx(32 / 4.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)  # 100, 100, 200 (one-token request: none)
    assert s["tpot_ms"]["mean"] == pytest.approx(400.0 / 3)
    assert s["ttft_ms"]["mean"] == pytest.approx(1000 * (0.1 + 0.3 + 0.15 + 0.05) / 4)


def test_no_slo_means_no_goodput():
    s = summarize([rec(0, 0.1, 0.2, 2)], 1.0, {})
    assert s["goodput"] is None and s["slo_attainment_pct"] is None


@pytest.mark.parametrize("bad", ["ttft", "ttft:abc", "ttft:-5", "latency:100", "ttft:100,"])
def test_bad_slo_names_the_flag(bad):
    with pytest.raises(ValueError, match="--slo"):
        parse_slo(bad)


def test_e2el_alias_and_itl_slo():
    slo = parse_slo("e2el:1000,itl:50")
    r = rec(0, 0.1, 0.5, 3)
    r.itl_s = [0.02, 0.06]
    assert slo == {"e2e": 1.0, "itl": 0.05} and not meets_slo(r, slo)


def test_gamma_arrivals_keep_the_mean_rate():
    for burstiness in (1.0, 0.5):
        gaps = [g for g, _ in zip(intervals(10.0, burstiness, seed=3), range(4000))]
        assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.08)
    # burstier arrivals spread the gaps more (coefficient of variation 1/sqrt(shape))
    cv = lambda b: statistics.pstdev(g := [x for x, _ in zip(intervals(10.0, b, 1), range(4000))]) / statistics.fmean(g)  # noqa: E731
    assert cv(0.25) > 1.5 > cv(1.0) > 0.8


def test_length_dist_parse():
    assert LengthDist.parse("64", "--input-len") == LengthDist(64, 64)
    d = LengthDist.parse("8:16", "--input-len")
    assert {d.sample(random.Random(i)) for i in range(200)} == set(range(8, 17))
    for bad in ("0", "9:3", "x", "1:2:3"):
        with pytest.raises(BenchError, match="--input-len"):
            LengthDist.parse(bad, "--input-len")


def test_trace_prompts_keep_the_prefix_structure():
    a = TraceEntry(0, 3 * 32 + 5, 4, (7, 8, 9, 10))
    b = TraceEntry(10, 2 * 32 + 20, 4, (7, 8, 11))
    pa, na = trace_prompt(a, 32, None)
    pb, nb = trace_prompt(b, 32, None)
    wa, wb = pa.split(), pb.split()
    assert (na, nb) == (101, 84) and (len(wa), len(wb)) == (101, 84)
    assert wa[:64] == wb[:64]          # hash ids 7, 8: equal blocks
    assert wa[64:96] != wb[64:96]      # 9 vs 11: different blocks
    assert wa[96:] == block_text(10, 5, salt="mooncake").split()  # the partial last block
    assert block_text(10, 32, salt="mooncake").startswith(block_text(10, 5, salt="mooncake"))
    clipped, n = trace_prompt(a, 32, max_input_len=40)
    assert n == 40 and clipped.split() == wa[:40]


def test_words_are_single_tokens_of_a_byte_level_bpe():
    from kvferry.model.loader import resolve_model_folder
    from kvferry.model.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_folder(None))
    text = block_text("x", 300)
    assert len(words()) == 1024 and abs(len(tok.encode(text)) - 300) <= 3


def test_shipped_trace_and_bad_trace(tmp_path):
    entries = load_trace(None)
    assert len(entries) == 300 and entries[0].hash_ids[0] == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(BenchError, match="line 1"):
        load_trace(str(bad))


def test_shared_prefix_groups_share_system_prompts():
    sessions = [s for s, _ in zip(shared_prefix_workload(3, 4, 20, 5, LengthDist(2, 2), seed=1), range(12))]
    systems = [s.requests[0].messages[0]["content"] for s in sessions]
    assert len(set(systems)) == 3 and all(systems.count(x) == 4 for x in set(systems))


def test_compare_prints_ratios(tmp_path):
    def result(throughput: float, p50: float) -> dict:
        stats = {"mean": p50, "p50": p50, "p90": p50, "p99": p50}
        return {"summary": {"completed": 10, "failed": 0, "request_throughput": throughput, "goodput": None,
                            "ttft_ms": stats, "tpot_ms": stats, "itl_ms": stats, "e2e_ms": stats},
                "server": {"prefix_cache_hit_rate": 0.5}}
    (tmp_path / "a.json").write_text(json.dumps(result(2.0, 100.0)))
    (tmp_path / "b.json").write_text(json.dumps({"sweep": [result(1.0, 1.0), result(3.0, 50.0)]}))
    table = compare_table(str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert "1.50x better" in next(line for line in table.splitlines() if line.startswith("request throughput"))
    assert "0.50x better" in next(line for line in table.splitlines() if line.startswith("TTFT p50"))
    with pytest.raises(BenchError, match="missing.json"):
        compare_table(str(tmp_path / "missing.json"), str(tmp_path / "b.json"))


def test_trace_arrivals_follow_timestamps_divided_by_the_time_scale():
    from kvferry.bench.trace import trace_workload

    entries = [TraceEntry(1000.0, 40, 4, (0,)), TraceEntry(3000.0, 40, 9, (0, 1)), TraceEntry(7000.0, 40, 2, (2,))]
    sessions = list(trace_workload(entries, 32, 4.0, None, 3))
    assert [s.arrival_s for s in sessions] == [0.0, 0.5, 1.5]  # (t - t0) / 1000 / 4
    assert [s.requests[0].max_tokens for s in sessions] == [3, 3, 2]  # clipped by max_output_len
