"""The autoscaling policy (``kvferry.autoscale``) with a real profile
file and the planner's own evaluation: the measured window, scaling up at
once, down only after K intervals and the cool-down, bounds, idle windows,
decisions as JSON, the loop with an apply function that works and one that
fails, and the flags' errors.

The profile (made as the plan tests make one): a prefill of 128 tokens
takes 69 ms, a decode step 10 ms + 1 ms per sequence; 32 output tokens;
SLO TTFT 300 ms, TPOT 30 ms. Colocated, the planner's answer is 1 engine
up to about 5 req/s, 2 at 10 req/s and 4 at 20 req/s (the scan in
``test_the_profile_gives_the_answers_the_tests_rely_on``)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

import pytest

from kvferry.autoscale.flags import add_autoscale_args, parse_counts
from kvferry.autoscale.policy import Autoscaler, Decision, ScaleBounds, autoscaler_from_args
from kvferry.autoscale.window import WorkloadWindow, window_from_args
from tests.plan.helpers import profile_with_quality, write_profile

SLO = {"ttft": 0.3, "tpot": 0.03}


@pytest.fixture(scope="module")
def poor_profile(tmp_path_factory) -> str:
    """A profile whose decode fit is poor (as one measured on a busy machine)."""
    return str(profile_with_quality(tmp_path_factory.mktemp("autoscale-poor") / "poor.json", prefill_r2=0.99,
                                    prefill_rms=0.02, decode_r2=0.55, decode_rms=0.2))


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    return str(write_profile(tmp_path_factory.mktemp("autoscale") / "profile.json",
                             (0.005, 0.0005, 0, 0), (0.01, 0.001, 0)))


def feed(window: WorkloadWindow, rate: float, start: float, end: float, prompt: int = 128, out: int = 32) -> None:
    """Evenly spaced requests arriving in (start, end], recorded as finished."""
    for k in range(1, round((end - start) * rate) + 1):
        window.record(start + k / rate, prompt, out)


def window_at(rate: float, now: float = 60.0) -> WorkloadWindow:
    w = WorkloadWindow(60.0, now=0.0)
    feed(w, rate, 0.0, now)
    return w


def scaler(profile: str, mode: str = "colocated", **kw) -> Autoscaler:
    bounds = kw.pop("bounds", None) or ScaleBounds.of(mode, max_cores=8)
    return Autoscaler(profile, mode, SLO, bounds, kw.pop("interval_s", 30.0), **kw)


# -- the window ------------------------------------------------------------------------------
def test_window_measures_rate_and_lengths_over_the_last_window_s():
    w = WorkloadWindow(60.0, now=0.0)
    feed(w, 2.0, 0.0, 120.0, prompt=100, out=10)  # 2 req/s for two minutes
    feed(w, 8.0, 120.0, 150.0, prompt=300, out=30)  # then 8 req/s for 30 s
    snap = w.snapshot(150.0)
    # the last 60 s: 30 s at 2 req/s and 30 s at 8 req/s
    assert snap.rate == pytest.approx(5.0, rel=0.05)
    assert snap.num_requests == pytest.approx(300, abs=3)
    assert snap.mean_prompt_tokens == pytest.approx((60 * 100 + 240 * 300) / 300, rel=0.02)
    assert all(s.arrival_s >= 90.0 for s in snap.samples)
    # the first seconds' rate is over the time since the window started, not the whole window
    young = WorkloadWindow(60.0, now=0.0)
    feed(young, 4.0, 0.0, 10.0)
    assert young.snapshot(10.0).rate == pytest.approx(4.0, rel=0.05)
    # the planner's workload: at least 200 requests at the measured rate
    requests = snap.to_requests(block_size=16)
    assert len(requests) == snap.num_requests
    span = requests[-1].arrival_s - requests[0].arrival_s
    assert (len(requests) - 1) / span == pytest.approx(snap.rate, rel=0.05)
    assert len(young.snapshot(10.0).to_requests()) == 200


def test_window_memory_is_bounded_and_arrivals_can_be_counted_as_they_come():
    w = WorkloadWindow(60.0, max_samples=50, now=0.0)
    feed(w, 10.0, 0.0, 60.0)
    snap = w.snapshot(60.0)
    assert snap.num_requests == 50  # the most recent 50 samples ...
    assert snap.rate == pytest.approx(10.0, rel=0.05)  # ... but every arrival counts in the rate
    # bad values are dropped, never raised (the server's loop calls this)
    w.record(float("nan"), 10, 1)
    w.record(61.0, 0, 5)
    w.record(61.0, "12", 5)
    assert w.snapshot(61.0).num_requests == 50
    # arrivals noted as they come: a request still running counts too
    counted = WorkloadWindow(60.0, now=0.0)
    for i in range(120):
        counted.record_arrival(i * 0.5)
    counted.record(1.0, 64, 8, cached_tokens=32)
    snap = counted.snapshot(60.0)
    assert counted.counts_arrivals and snap.rate == pytest.approx(2.0, rel=0.05) and snap.num_requests == 1
    assert snap.cached_fraction == 0.5
    (req, *_) = snap.to_requests(block_size=16)
    assert req.input_len == 64 and req.output_len == 8 and len(req.block_keys) == 4


# -- the policy --------------------------------------------------------------------------
def test_the_profile_gives_the_answers_the_tests_rely_on(profile):
    """From 1 engine, the cheapest layout meeting the SLO at each rate."""
    answers = {}
    for rate in (2.0, 10.0, 20.0):
        d = scaler(profile).decide(window_at(rate), {"engine": 1}, now=60.0)
        answers[rate] = 1 if d is None else d.to_counts["engine"]
    assert answers == {2.0: 1, 10.0: 2, 20.0: 4}


def test_a_high_rate_scales_up_at_once(profile):
    a = scaler(profile, cooldown_s=1000.0)
    start = time.perf_counter()
    d = a.decide(window_at(20.0), {"engine": 1}, now=60.0)
    assert time.perf_counter() - start < 5.0  # the analytic planner: well under the interval
    assert d is not None and d.direction == "up"
    assert d.from_counts == {"engine": 1} and d.to_counts == {"engine": 4}
    assert d.rate == pytest.approx(20.0, rel=0.05) and d.mean_prompt_tokens == 128 and d.mean_output_tokens == 32
    assert d.predicted_attainment_pct >= 90 and d.current_attainment_pct < 90
    assert "engine=1 would keep" in d.reason and "engine=4 is the cheapest that meets it" in d.reason
    assert a.history == [d]
    # a second high interval right after (cool-down or not): the current layout meets it, nothing changes
    assert a.decide(window_at(20.0, 90.0), {"engine": 4}, now=90.0) is None
    # disagg: the cheapest prefill/decode split that meets the SLO
    dis = scaler(profile, "disagg")
    d = dis.decide(window_at(20.0), {"prefill": 1, "decode": 1}, now=60.0)
    assert d is not None and d.direction == "up" and sum(d.to_counts.values()) == 3
    assert d.to_counts["prefill"] >= 2


def test_too_few_requests_change_nothing(profile):
    a = scaler(profile, min_requests=20)
    w = WorkloadWindow(60.0, now=0.0)
    for t in range(10):  # 10 requests of a burst: too few to plan from
        w.record(50.0 + t * 0.01, 2000, 32)
    assert a.decide(w, {"engine": 1}, now=60.0) is None
    assert "fewer than 20" in a.last_evaluation["reason"] and a.history == []


def test_a_low_rate_scales_down_only_after_k_intervals_and_the_cooldown(profile):
    a = scaler(profile, down_after=3, cooldown_s=200.0)
    w = WorkloadWindow(60.0, now=0.0)
    feed(w, 20.0, 0.0, 60.0)
    up = a.decide(w, {"engine": 1}, now=60.0)
    assert up is not None and up.to_counts == {"engine": 4}
    current, decisions, pending = dict(up.to_counts), [], []
    for now in range(90, 400, 30):  # from t=60 on: 2 req/s
        feed(w, 2.0, now - 30.0, now)
        d = a.decide(w, current, now=float(now))
        if d is None:
            pending.append((now, a.last_evaluation["reason"]))
            continue
        decisions.append((now, d))
        current = d.to_counts
    (when, down), = decisions
    # the answer is 1 engine from t=120 (the window is all low rate); 3 intervals: t=180; the cool-down: t>=260
    assert when == 270 and down.direction == "down" and down.to_counts == {"engine": 1}
    assert down.from_counts == {"engine": 4} and "for 3 consecutive intervals" in down.reason
    reasons = dict(pending)
    assert "scale-down pending: 1 of 3 intervals" in reasons[120]
    assert "scale-down pending: cool-down" in reasons[240]
    assert a.history == [up, down]


def test_scale_down_goes_to_the_dearest_of_the_k_answers_and_a_miss_resets(profile):
    a = scaler(profile, down_after=3, cooldown_s=0.0)
    four = {"engine": 4}
    assert a.decide(window_at(10.0).snapshot(60.0), four, now=60.0) is None  # answer: 2
    assert a.decide(window_at(2.0, 90.0).snapshot(90.0), four, now=90.0) is None  # answer: 1
    d = a.decide(window_at(2.0, 120.0).snapshot(120.0), four, now=120.0)
    assert d is not None and d.to_counts == {"engine": 2}  # the most cautious of 2, 1, 1
    assert d.predicted_attainment_pct >= 90  # planned now, at the current load
    # an interval whose answer is not cheaper resets the count
    b = scaler(profile, down_after=2, cooldown_s=0.0)
    assert b.decide(window_at(2.0, 60.0), {"engine": 2}, now=60.0) is None
    assert b.decide(window_at(10.0, 90.0), {"engine": 2}, now=90.0) is None  # 2 engines are the answer again
    assert b.decide(window_at(2.0, 120.0), {"engine": 2}, now=120.0) is None
    assert b.decide(window_at(2.0, 150.0), {"engine": 2}, now=150.0).to_counts == {"engine": 1}


def test_bounds_hold(profile):
    bounds = ScaleBounds.of("colocated", {"engine": 2}, {"engine": 3}, max_cores=8)
    a = scaler(profile, bounds=bounds, down_after=1, cooldown_s=0.0)
    up = a.decide(window_at(20.0), {"engine": 2}, now=60.0)  # 4 would meet it; 3 is the most allowed
    assert up.to_counts == {"engine": 3} and "no layout within bounds meets it" in up.reason
    assert a.decide(window_at(20.0, 90.0), {"engine": 3}, now=90.0) is None
    down = a.decide(window_at(2.0, 120.0), {"engine": 3}, now=120.0)
    assert down.to_counts == {"engine": 2}  # 1 would do; 2 is the fewest allowed
    clamp = a.decide(window_at(2.0, 150.0), {"engine": 6}, now=150.0)  # outside the bounds: brought in at once
    assert clamp.direction == "bounds" and clamp.to_counts == {"engine": 3}
    # disagg with 3 cores at most: 40 req/s would need 5; the best of at most 3
    dis = scaler(profile, "disagg", bounds=ScaleBounds.of("disagg", max_cores=3))
    d = dis.decide(window_at(40.0), {"prefill": 1, "decode": 1}, now=60.0)
    assert sum(d.to_counts.values()) <= 3 and all(n >= 1 for n in d.to_counts.values())
    assert dis.bounds.max_counts == {"prefill": 2, "decode": 2}


def test_an_idle_window_keeps_the_counts_unless_arrivals_are_counted(profile):
    a = scaler(profile, down_after=2, cooldown_s=0.0)
    w = WorkloadWindow(60.0, now=0.0)
    feed(w, 20.0, 0.0, 10.0)
    for now in (100.0, 130.0, 160.0):  # nothing finished in the window: perhaps nothing can finish
        assert a.decide(w, {"engine": 4}, now=now) is None
    assert "may be an overload" in a.last_evaluation["reason"]
    counted = WorkloadWindow(60.0, now=0.0)
    counted.record_arrival(5.0)
    assert a.decide(counted, {"engine": 4}, now=100.0) is None  # 1 of 2 intervals
    d = a.decide(counted, {"engine": 4}, now=130.0)
    assert d.direction == "down" and d.to_counts == {"engine": 1} and "no request arrived" in d.reason


def test_a_decision_round_trips_through_json(profile):
    a = scaler(profile)
    d = a.decide(window_at(20.0), {"engine": 1}, now=60.0)
    text = json.dumps(d.to_json())
    back = Decision.from_json(json.loads(text))
    assert back == d and isinstance(back.to_counts, dict)
    status = json.loads(json.dumps(a.status()))
    assert status["decisions"] == [d.to_json()] and status["bounds"]["max_cores"] == 8
    assert status["slo_ms"] == {"ttft": 300.0, "tpot": 30.0} and status["last_evaluation"]["outcome"] == "up"
    assert "engine=1 -> engine=4" in d.log_line()


# -- the loop --------------------------------------------------------------------------------
def _loaded_window() -> WorkloadWindow:
    """A monotonic-clock window holding the last minute at 20 req/s."""
    now = time.monotonic()
    w = WorkloadWindow(60.0, now=now - 60.0)
    feed(w, 20.0, now - 60.0, now)
    return w


def test_run_applies_each_decision_logs_it_and_survives_failures(profile, caplog):
    caplog.set_level(logging.INFO, logger="kvferry.autoscale.policy")

    async def scenario(apply_raises: bool, current_fails_once: bool) -> tuple[list, Autoscaler]:
        a = scaler(profile, interval_s=0.02)
        current, calls, failed = {"engine": 1}, [], []

        def current_fn() -> dict:
            if current_fails_once and not failed:
                failed.append(True)
                raise RuntimeError("no answer")
            return dict(current)

        async def apply_fn(target: dict) -> None:
            calls.append(target)
            if apply_raises:
                raise RuntimeError("boom")
            current.update(target)

        task = asyncio.create_task(a.run(_loaded_window(), current_fn, apply_fn))
        deadline = time.monotonic() + 20
        while len(calls) < 2 and time.monotonic() < deadline and not (calls and not apply_raises):
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # a few more intervals: nothing more to do once applied
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return calls, a

    calls, a = asyncio.run(scenario(apply_raises=False, current_fails_once=True))
    assert calls == [{"engine": 4}]
    (d,) = a.history
    assert d.applied is True and d.error is None
    assert any("autoscale up: engine=1 -> engine=4" in r.message and r.levelno == logging.INFO
               for r in caplog.records)
    assert any("the decision failed" in r.message for r in caplog.records)  # current_fn raised once

    calls, a = asyncio.run(scenario(apply_raises=True, current_fails_once=False))
    assert len(calls) >= 2 and all(c == {"engine": 4} for c in calls)  # the loop went on after the failure
    assert a.history[0].applied is False and a.history[0].error == "RuntimeError: boom"
    assert any("applying engine=4 failed" in r.message for r in caplog.records)


# -- validation and flags -------------------------------------------------------------------------
def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_autoscale_args(parser)
    return parser.parse_args(list(argv))


def test_flags_build_the_autoscaler_and_bad_values_name_the_flag(profile, poor_profile, tmp_path, caplog):
    assert autoscaler_from_args(parse(), "colocated", SLO) is None
    a = autoscaler_from_args(parse("--autoscale", profile, "--autoscale-slo", "ttft:500", "--autoscale-min",
                                   "prefill=1,decode=2", "--autoscale-max-cores", "6",
                                   "--autoscale-interval-s", "15"), "disagg", SLO)
    assert a.slo == {"ttft": 0.5} and a.interval_s == 15.0
    assert a.bounds.min_counts == {"prefill": 1, "decode": 2} and a.bounds.max_counts == {"prefill": 4, "decode": 5}
    assert window_from_args(parse("--autoscale-window-s", "30"), now=0.0).window_s == 30.0
    assert parse_counts("engine=3", "--autoscale-max") == {"engine": 3}

    missing = str(tmp_path / "missing.json")
    cases = [
        (("--autoscale", missing), "colocated", SLO, "--autoscale: cannot read"),
        (("--autoscale", poor_profile), "colocated", SLO, "--autoscale-allow-poor-fit"),
        (("--autoscale", profile), "colocated", {}, "--autoscale-slo"),
        (("--autoscale", profile, "--autoscale-slo", "ttft:0"), "colocated", None, "--autoscale-slo"),
        (("--autoscale", profile, "--autoscale-min", "prefill=1,decode=1"), "colocated", SLO, "--autoscale-min"),
        (("--autoscale", profile, "--autoscale-min", "engine=x"), "colocated", SLO, "--autoscale-min"),
        (("--autoscale", profile, "--autoscale-min", "engine=4", "--autoscale-max", "engine=2"), "colocated", SLO,
         "--autoscale-min: engine=4 is above --autoscale-max engine=2"),
        (("--autoscale", profile, "--autoscale-min", "engine=9"), "colocated", SLO, "--autoscale-max-cores 8"),
        (("--autoscale", profile, "--autoscale-max-cores", "1"), "disagg", SLO, "--autoscale-max-cores"),
        (("--autoscale", profile, "--autoscale-interval-s", "0"), "colocated", SLO, "--autoscale-interval-s"),
        (("--autoscale", profile, "--autoscale-down-after", "0"), "colocated", SLO, "--autoscale-down-after"),
        (("--autoscale", profile, "--autoscale-min-attainment", "150"), "colocated", SLO,
         "--autoscale-min-attainment"),
    ]
    for argv, mode, slo, message in cases:
        with pytest.raises(ValueError, match=message.replace("+", r"\+")):
            autoscaler_from_args(parse(*argv), mode, slo)
    with pytest.raises(ValueError, match="--autoscale-window-s"):
        window_from_args(parse("--autoscale-window-s", "-1"))
    not_a_profile = tmp_path / "not.json"
    not_a_profile.write_text("{}")
    with pytest.raises(ValueError, match="--autoscale: .* is not a kvferry profile JSON"):
        autoscaler_from_args(parse("--autoscale", str(not_a_profile)), "colocated", SLO)
    # the poor profile, allowed: the same warning kvferry plan prints, logged
    caplog.set_level(logging.WARNING, logger="kvferry.autoscale.policy")
    allowed = autoscaler_from_args(parse("--autoscale", poor_profile, "--autoscale-allow-poor-fit"),
                                   "colocated", SLO)
    assert allowed is not None
    assert any("decode fit is poor" in r.message and "using it anyway" in r.message for r in caplog.records)
