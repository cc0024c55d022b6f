"""The online step-time model and SLO admission."""
from __future__ import annotations

import pytest

from kvferry.router.admission import SloConfig, SloRejectedError, StepTimeModel, admit, predict


def test_least_squares_recovers_a_linear_step_time():
    model = StepTimeModel()
    assert model.fit() is None
    for tokens in [1, 8, 64, 512, 2048, 3, 100]:
        model.observe(tokens, 0.02 + 0.0005 * tokens)
    fixed, per_token = model.fit()
    assert fixed == pytest.approx(0.02, rel=1e-6) and per_token == pytest.approx(0.0005, rel=1e-6)
    assert model.predict_s(1000, num_steps=2) == pytest.approx(0.04 + 0.5)


def test_the_window_forgets_old_steps():
    model = StepTimeModel(window=4)
    for _ in range(10):
        model.observe(100, 1.0)
    for tokens in (10, 20, 30, 40):
        model.observe(tokens, tokens * 0.001)
    assert model.num_observations == 4 and model.fit()[1] == pytest.approx(0.001)


def test_same_size_steps_give_time_per_token():
    model = StepTimeModel()
    for _ in range(5):
        model.observe(4, 0.04)
    assert model.fit() == (0.0, pytest.approx(0.01))


def test_prediction_counts_the_queue_in_chunks():
    model = StepTimeModel()
    model.observe(1, 0.011)
    model.observe(101, 0.111)  # fixed 0.01 s, 1 ms per token
    p = predict(model, queued_prefill_tokens=150, new_tokens=100, num_running=2, max_num_batched_tokens=100)
    # 250 prefill tokens -> 3 steps, each also carrying 2 decode tokens.
    assert p.ttft_s == pytest.approx(3 * 0.01 + 0.001 * (250 + 6))
    assert p.tpot_s == pytest.approx(0.01 + 0.003)
    assert p.queue_drain_s == pytest.approx(2 * 0.01 + 0.001 * (150 + 4))


def test_admission_refuses_what_cannot_meet_the_slo_and_says_when_to_retry():
    model = StepTimeModel()
    model.observe(1, 0.011)
    model.observe(101, 0.111)
    p = predict(model, 5000, 100, 0, 100)
    admit(SloConfig(ttft_slo_ms=60_000), p)  # meets it
    with pytest.raises(SloRejectedError, match="TTFT SLO") as err:
        admit(SloConfig(ttft_slo_ms=100), p)
    assert err.value.retry_after_s == pytest.approx(p.queue_drain_s)
    with pytest.raises(SloRejectedError, match="TPOT SLO") as err:
        admit(SloConfig(tpot_slo_ms=1), p)
    assert err.value.retry_after_s >= 1.0
    admit(SloConfig(ttft_slo_ms=1), None)  # no evidence yet: admitted


def test_slo_values_must_be_positive():
    with pytest.raises(ValueError, match="ttft_slo_ms"):
        SloConfig(ttft_slo_ms=0)
