"""Mixed prefill+decode steps: the fit of what they cost beyond the two
separate fits, and the simulator's use of it."""
from __future__ import annotations

import json

import pytest

from kvferry.bench.profile import MIXED_TERMS, fit_mixed
from kvferry.plan.latency import PlanError, StepCostModel
from tests.plan.helpers import write_profile

PREFILL = {"terms": ["1", "new", "new*cached", "new^2"], "coef": [0.030, 0.0008, 1e-7, 2e-7]}
DECODE = {"terms": ["1", "batch", "batch*context"], "coef": [0.025, 0.001, 3e-6]}


def test_fit_mixed_recovers_the_extra_cost_of_synthetic_points():
    m1, m_batch, m_new = 0.004, 0.002, 0.00005
    parts = StepCostModel(tuple(PREFILL["coef"]), tuple(DECODE["coef"]))
    points = []
    for batch in (1, 2, 4, 8):
        for new, cached in ((64, 16), (128, 16), (320, 0)):
            context = 150
            t = parts.step([(new, cached)], batch, batch * context) + m1 + m_batch * batch + m_new * new
            points.append({"new": new, "cached": cached, "batch": batch, "context": context, "time_s": t})
    f = fit_mixed(points, PREFILL, DECODE)
    assert f["terms"] == list(MIXED_TERMS)
    assert f["coef"] == pytest.approx([m1, m_batch, m_new], rel=1e-6)
    # each point keeps the two fits' sum and the rest
    p = points[0]
    assert p["sum_s"] + p["extra_s"] == pytest.approx(p["time_s"])
    assert p["extra_s"] == pytest.approx(m1 + m_batch * 1 + m_new * 64)


def test_fit_mixed_never_makes_a_mixed_step_cheaper_than_its_parts():
    parts = StepCostModel(tuple(PREFILL["coef"]), tuple(DECODE["coef"]))
    # measured below the sum (a disaggregated server: the "mixed" gap is a plain decode step)
    points = [{"new": n, "cached": 16, "batch": b, "context": 100,
               "time_s": 0.5 * parts.step([(n, 16)], b, 100 * b)} for b in (1, 4) for n in (64, 256)]
    assert fit_mixed(points, PREFILL, DECODE)["coef"] == [0.0, 0.0, 0.0]
    assert fit_mixed([], PREFILL, DECODE)["coef"] == [0.0, 0.0, 0.0]


def test_the_mixed_cost_applies_only_to_steps_that_both_prefill_and_decode():
    plain = StepCostModel(tuple(PREFILL["coef"]), tuple(DECODE["coef"]))
    mixed = StepCostModel(tuple(PREFILL["coef"]), tuple(DECODE["coef"]), mixed=(0.004, 0.002, 0.0001))
    assert mixed.step([(100, 0)], 0, 0) == plain.step([(100, 0)], 0, 0)
    assert mixed.step([], 3, 300) == plain.step([], 3, 300)
    # two chunks (60 + 40 new tokens) with 3 decodes
    assert mixed.step([(60, 0), (40, 10)], 3, 300) == pytest.approx(
        plain.step([(60, 0), (40, 10)], 3, 300) + 0.004 + 0.002 * 3 + 0.0001 * 100)


def test_profile_mixed_fit_is_read_and_checked(tmp_path):
    path = write_profile(tmp_path / "p.json", tuple(PREFILL["coef"]), tuple(DECODE["coef"]))
    assert StepCostModel.from_profile(str(path)).mixed == (0.0, 0.0, 0.0)  # none measured: the sum alone
    data = json.loads(path.read_text())
    data["mixed"] = {"fit": {"terms": list(MIXED_TERMS), "coef": [0.001, 0.002, 0.003]}}
    path.write_text(json.dumps(data))
    assert StepCostModel.from_profile(str(path)).mixed == (0.001, 0.002, 0.003)
    data["mixed"]["fit"]["terms"] = ["1", "new"]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="mixed fit terms"):
        StepCostModel.from_profile(str(path))


def test_the_mixed_step_is_the_longest_gap_ending_between_send_and_first_text():
    from kvferry.bench.profile_served import mixed_gap

    # decode steps of 30 ms; the newcomer is sent at 0.100 and its prefill rides the step
    # [0.120, 0.320]; its first text comes with the stream's chunk at 0.320 (delivered 1 ms apart)
    times = [0.030, 0.060, 0.090, 0.120, 0.320, 0.350, 0.380]
    assert mixed_gap(times, sent=0.100, first=0.321) == pytest.approx(0.200)
    # a first token without text: the newcomer's first text comes a step later; still the mixed step
    assert mixed_gap(times, sent=0.100, first=0.351) == pytest.approx(0.200)
    # the stream saw no step end in the window
    assert mixed_gap([0.030, 0.060], sent=0.100, first=0.321) is None
