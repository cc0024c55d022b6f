"""``kvferry plan --hardware``: pools on different hardware, priced, ranked
by cost per million useful tokens. Real processes, real files; every
figure checked by hand."""
from __future__ import annotations

import json

import pytest

from tests.plan.helpers import write_profile, write_trace
from tests.plan.test_cli import kvferry

# 16-token prompts (one trace block), 21 output tokens: a prefill step gives
# the first, 20 decode steps the rest.
#   fast: 1 ms/prompt token (16 ms prefill), 2 ms a decode step  -> a request alone takes  56 ms; 2.0 per hour
#   slow: 4 ms/prompt token (64 ms prefill), 10 ms a decode step -> a request alone takes 264 ms; 1.0 per hour
FAST, SLOW = ((0, 0.001, 0, 0), (0.002, 0, 0)), ((0, 0.004, 0, 0), (0.010, 0, 0))
SLO = "ttft:100,tpot:12"


def per_million(price_per_hour: float, span_s: float, useful_tokens: int) -> float:
    return price_per_hour * span_s / 3600 / useful_tokens * 1e6


@pytest.fixture
def hardware(tmp_path) -> list[str]:
    fast = write_profile(tmp_path / "fast.json", *FAST)
    slow = write_profile(tmp_path / "slow.json", *SLOW)
    return ["--hardware", f"fast={fast}:2.0", "--hardware", f"slow={slow}:1.0"]


def plan(tmp_path, name: str, gap_ms: int, num: int, hardware: list[str], *extra: str) -> tuple[dict, str]:
    trace = write_trace(tmp_path / f"{name}.jsonl", [(gap_ms * i, 16, 21, [1000 + i]) for i in range(num)])
    out = kvferry("plan", *hardware, "--trace", str(trace), "--trace-block-size", "16", "--slo", SLO,
                  "--gpus", "3", "--output", str(tmp_path / name), *extra)
    assert out.returncode == 0, out.stderr
    return json.loads((tmp_path / f"{name}.json").read_text()), out.stdout


def by_layout(result: dict) -> dict:
    return {(c["num_colocated"], c["num_prefill"], c["num_decode"], *c["hardware"].values()): c
            for c in result["candidates"]}


def test_the_cheap_hardware_wins_at_a_low_rate_and_loses_at_a_high_one(tmp_path, hardware):
    # Low rate: 10 requests 1 s apart, each alone on any instance; every
    # layout meets the SLO (slow: TTFT 64 ms, TPOT 10 ms), so the cheapest
    # fleet wins: one slow instance, 1.0/h over 9 s + 264 ms for 210 tokens.
    low, low_text = plan(tmp_path, "low", 1000, 10, hardware)
    assert low["ranked_by"] == "cost_per_million_useful_tokens"
    cands = by_layout(low)
    slow1, fast1 = cands[(1, 0, 0, "slow")], cands[(1, 0, 0, "fast")]
    assert slow1["slo_attainment_pct"] == fast1["slo_attainment_pct"] == 100.0
    assert slow1["useful_output_tokens"] == fast1["useful_output_tokens"] == 210
    assert slow1["run_s"] == pytest.approx(9.264) and fast1["run_s"] == pytest.approx(9.056)
    assert slow1["cost_per_million_useful_tokens"] == pytest.approx(per_million(1.0, 9.264, 210))  # 12.25
    assert fast1["cost_per_million_useful_tokens"] == pytest.approx(per_million(2.0, 9.056, 210))  # 23.96
    assert low["best"] == slow1 and low["best_colocated"] == slow1
    # a mixed layout (fast prefill, slow decode: 3.0/h) is reported and priced
    mixed = cands[(0, 1, 1, "fast", "slow")]
    assert mixed["mixed_hardware"] and mixed["price_per_hour"] == 3.0 and low["best_mixed"]["mixed_hardware"]
    assert mixed["cost_per_million_useful_tokens"] == pytest.approx(
        per_million(3.0, mixed["run_s"], 210))
    assert "best: 1C@slow" in low_text and "cost/M useful tok" in low_text
    assert f"{slow1['cost_per_million_useful_tokens']:.4g}" in low_text

    # High rate: 40 requests 100 ms apart. One slow instance falls behind
    # (a decode shares steps with the next prompt's 64 ms prefill: TPOT >
    # 12 ms); three slow ones serve each request alone but cost 3.0/h; one
    # fast instance (56 ms a request) meets the SLO at 2.0/h and wins.
    high, _ = plan(tmp_path, "high", 100, 40, hardware)
    cands = by_layout(high)
    fast1, slow1, slow3 = cands[(1, 0, 0, "fast")], cands[(1, 0, 0, "slow")], cands[(3, 0, 0, "slow")]
    assert slow1["slo_attainment_pct"] < 50 and not slow1["qualifies"]
    assert fast1["slo_attainment_pct"] == slow3["slo_attainment_pct"] == 100.0
    assert fast1["cost_per_million_useful_tokens"] == pytest.approx(per_million(2.0, 3.9 + 0.056, 840))  # 2.62
    assert slow3["cost_per_million_useful_tokens"] == pytest.approx(per_million(3.0, 3.9 + 0.264, 840))  # 4.13
    # slow prefill + slow decode also costs 2.0/h and meets the SLO, but its
    # last request ends later (prefill 64 ms, then 20 decode steps of 10 ms)
    slow_disagg = cands[(0, 1, 1, "slow", "slow")]
    assert slow_disagg["qualifies"] and slow_disagg["run_s"] > 3.9 + 0.264
    assert high["best"] == fast1


def test_pools_can_be_pinned_to_hardware_and_bad_specs_are_refused(tmp_path, hardware):
    result, _ = plan(tmp_path, "pinned", 1000, 4, hardware, "--prefill-hardware", "fast",
                     "--decode-hardware", "slow", "--colocated-hardware", "none")
    assert {(c["hardware"]["prefill"], c["hardware"]["decode"]) for c in result["candidates"]} == {("fast", "slow")}
    assert result["best_colocated"] is None and result["best"]["mixed_hardware"]

    profile = write_profile(tmp_path / "p.json", *FAST)
    trace = write_trace(tmp_path / "t.jsonl", [(0, 16, 4, [1])])
    for args, message in (
            (["--hardware", f"a={profile}"], "NAME=PROFILE.json:PRICE_PER_HOUR"),
            (["--hardware", f"a={profile}:-1"], "price per hour"),
            (["--hardware", f"a b={profile}:1"], "name"),
            (["--hardware", f"a={profile}:1", "--hardware", f"a={profile}:2"], "'a' is given twice"),
            (["--hardware", f"a={tmp_path}/missing.json:1"], "cannot read"),
            (["--hardware", f"a={profile}:1", "--decode-hardware", "b"], "--decode-hardware: no hardware named 'b'"),
            (["--hardware", f"a={profile}:1", "--profile", str(profile)], "not both"),
            (["--profile", str(profile), "--prefill-hardware", "a"], "needs --hardware"),
            (["--hardware", f"a={profile}:1", "--hardware", f"b={profile}:1", "--instances-per-host", "2"],
             "--instances-per-host")):
        out = kvferry("plan", *args, "--trace", str(trace), "--slo", SLO, "--gpus", "2",
                      "--output", str(tmp_path / "bad"))
        assert out.returncode == 2, (args, out.stderr)
        assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, (args, out.stderr)
    out = kvferry("plan", "--hardware", f"a={profile}:1", "--colocated-hardware", "none", "--trace", str(trace),
                  "--slo", SLO, "--gpus", "1", "--output", str(tmp_path / "bad"))
    assert out.returncode == 2 and "leaves no placement" in out.stderr, out.stderr
