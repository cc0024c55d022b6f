"""Measured step-time noise in the simulator: drawn by seed, mean-preserving,
read from a served profile's ``step_noise``."""
from __future__ import annotations

import json
import random
import statistics

import pytest

from kvferry.bench.profile_served import noise_ratios, step_noise
from kvferry.plan.instance import InstanceConfig
from kvferry.plan.latency import PlanError, StepCostModel, StepNoise
from kvferry.plan.report import mean_summary, summarize
from kvferry.plan.simulator import ClusterConfig, Simulation
from tests.plan.helpers import unique_request, write_profile

NOISE = StepNoise(prefill=(0.9, 1.0, 1.5), decode=(1.0, 1.0, 1.2, 2.0))


def noisy_cost(noise: StepNoise | None = NOISE) -> StepCostModel:
    return StepCostModel((0.010, 0.001, 0.0, 0.0), (0.005, 0.001, 0.0), noise=noise)


def test_noise_draws_are_reproducible_by_seed():
    cost = noisy_cost()
    draws = [[cost.noisy_step([(64, 0)], 2, 100, rng) for _ in range(50)]
             for rng in (random.Random(3), random.Random(3), random.Random(4))]
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_noise_is_mean_preserving_and_picks_the_list_by_step_kind():
    cost, rng = noisy_cost(), random.Random(0)
    fitted_mixed, fitted_decode = cost.step([(64, 0)], 2, 100), cost.step([], 2, 100)
    mixed = statistics.mean(cost.noisy_step([(64, 0)], 2, 100, rng) for _ in range(20_000))
    decode = statistics.mean(cost.noisy_step([], 2, 100, rng) for _ in range(20_000))
    # a step with prefill draws from the prefill list (mean 3.4/3), a decode-only one from the decode list (1.3)
    assert mixed == pytest.approx(fitted_mixed * NOISE.mean(True), rel=0.01)
    assert decode == pytest.approx(fitted_decode * NOISE.mean(False), rel=0.01)
    assert NOISE.mean(True) == pytest.approx(3.4 / 3) and NOISE.mean(False) == pytest.approx(1.3)
    # a ratio drawn is one of the measured ones: never below the smallest
    assert min(cost.noisy_step([], 1, 0, rng) for _ in range(200)) == pytest.approx(cost.step([], 1, 0))


def test_without_noise_or_rng_a_step_takes_its_fitted_time():
    assert noisy_cost(None).noisy_step([(8, 0)], 1, 9, random.Random(0)) == noisy_cost(None).step([(8, 0)], 1, 9)
    assert noisy_cost().noisy_step([(8, 0)], 1, 9, None) == noisy_cost().step([(8, 0)], 1, 9)


def test_bad_noise_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="step_noise.decode"):
        StepNoise(prefill=(1.0,), decode=(1.0, -0.5))
    with pytest.raises(ValueError, match="step_noise.prefill"):
        StepNoise(prefill=(), decode=(1.0,))


def test_profile_step_noise_is_read_and_bad_noise_is_a_plan_error(tmp_path):
    path = write_profile(tmp_path / "p.json", (0.01, 0.001, 0, 0), (0.005, 0.001, 0))
    assert StepCostModel.from_profile(str(path)).noise is None  # an in-process profile: no noise
    data = json.loads(path.read_text())
    data["step_noise"] = {"prefill": [1.0, 1.25], "decode": [0.75, 1.0]}
    path.write_text(json.dumps(data))
    assert StepCostModel.from_profile(str(path)).noise == StepNoise((1.0, 1.25), (0.75, 1.0))
    data["step_noise"]["decode"] = [0.0]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="step_noise.decode"):
        StepCostModel.from_profile(str(path))


def test_noise_ratios_are_each_sample_over_the_fit():
    model = {"terms": ["1", "batch"], "coef": [0.010, 0.010]}
    points = [{"batch": 1, "time_s": 0.02, "samples_s": [0.02, 0.03]},
              {"batch": 3, "time_s": 0.04, "samples_s": [0.036]},
              {"batch": 2, "time_s": 0.03}]  # no samples kept: contributes none
    assert noise_ratios(points, model) == [1.0, 1.5, 0.9]


def test_simulation_with_noise_replays_by_seed_and_seeds_differ():
    inst = InstanceConfig(num_kv_blocks=512, block_size=16, max_num_batched_tokens=256)
    reqs = [unique_request(i, 0.05 * i, 100, 20) for i in range(20)]

    def run(seed: int) -> dict:
        sim = Simulation(ClusterConfig(num_colocated=1, instance=inst), noisy_cost(), seed=seed)
        return summarize(list(sim.run([unique_request(r.request_id, r.arrival_s, 100, 20) for r in reqs]).values()),
                         {})

    a, b, c = run(0), run(0), run(1)
    assert a == b and a["ttft_ms"] != c["ttft_ms"]


def test_a_lone_request_takes_its_fitted_time_times_the_mean_ratios_on_average():
    inst = InstanceConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=256)
    cost = noisy_cost()
    e2e = [Simulation(ClusterConfig(num_colocated=1, instance=inst), cost, seed=seed)
           .run([unique_request(0, 0.0, 100, 20)])[0].finish_s for seed in range(400)]
    # one prefill step (100 new tokens), then 19 decode steps of batch 1 (contexts 101..119)
    expected = (cost.step([(100, 0)], 0, 0) * NOISE.mean(True)
                + sum(cost.step([], 1, 101 + i) for i in range(19)) * NOISE.mean(False))
    assert statistics.mean(e2e) == pytest.approx(expected, rel=0.02)


def test_mean_summary_averages_numbers_and_keeps_what_all_runs_agree_on():
    runs = [{"n": 40, "ttft_ms": {"p50": 10.0, "p99": None}, "goodput": 1.0, "mode": "x"},
            {"n": 40, "ttft_ms": {"p50": 20.0, "p99": None}, "goodput": 2.0, "mode": "x"}]
    assert mean_summary(runs) == {"n": 40, "ttft_ms": {"p50": 15.0, "p99": None}, "goodput": 1.5, "mode": "x"}


def test_a_step_draws_its_noise_from_profiled_steps_of_about_its_length():
    """Sixteen samples: eight at a fitted 20 ms (one of them 2.4x: a hiccup
    of a short step) and eight at 100 ms (0.95-1.05). A 100 ms step draws
    only from the 100 ms samples, a 20 ms one only from the 20 ms ones; with
    fewer than MIN_NEAR alike, the nearest MIN_NEAR by ratio of times."""
    short = [1.0] * 7 + [2.4]
    long_ = [0.95, 1.0, 1.05, 1.0, 0.95, 1.0, 1.05, 1.0]
    noise = StepNoise.from_json({"prefill": long_ + short, "decode": [1.0],
                                 "prefill_at_s": [0.1] * 8 + [0.02] * 8})
    assert noise.prefill_at == tuple([0.02] * 8 + [0.1] * 8)  # sorted by fitted time, ratios with them
    rng = random.Random(0)
    assert {noise.factor(rng, True, 0.1) for _ in range(500)} == {0.95, 1.0, 1.05}
    assert {noise.factor(rng, True, 0.02) for _ in range(500)} == {1.0, 2.4}
    # 45 ms: within 2x of neither group's eight alone (0.02 is 2.25x off): the 8 nearest are the 100 ms ones
    assert {noise.factor(rng, True, 0.045) for _ in range(500)} == {0.95, 1.0, 1.05}
    # no fitted time asked for, or none kept: any sample
    assert 2.4 in {noise.factor(rng, True) for _ in range(500)}
    plain = StepNoise(tuple(long_ + short), (1.0,))
    assert 2.4 in {plain.factor(rng, True, 0.1) for _ in range(500)}
    # through the cost model: a 100 ms fitted step never takes the short steps' 2.4x
    cost = StepCostModel((0.0, 0.001, 0.0, 0.0), (0.005, 0.001, 0.0), noise=noise)
    assert max(cost.noisy_step([(100, 0)], 0, 0, rng) for _ in range(500)) == pytest.approx(0.105)


def test_noise_times_must_match_the_ratios():
    with pytest.raises(ValueError, match="step_noise.prefill_at_s"):
        StepNoise.from_json({"prefill": [1.0, 1.1], "decode": [1.0], "prefill_at_s": [0.01]})
    with pytest.raises(ValueError, match="step_noise.decode_at_s"):
        StepNoise((1.0,), (1.0, 1.0), decode_at=(0.02, 0.01))  # not ascending


def test_profile_step_noise_keeps_each_ratio_with_its_fitted_time():
    fit = {"terms": ["1", "new"], "coef": [0.010, 0.001]}
    prefill = [{"new": 10, "samples_s": [0.02, 0.03]}, {"new": 90, "samples_s": [0.1]}]
    decode_fit = {"terms": ["1"], "coef": [0.005]}
    decode = [{"samples_s": [0.005, 0.006]}]
    mixed = [{"sum_s": 0.05, "samples_s": [0.06]}]
    mixed_fit = {"terms": ["1"], "coef": [0.0]}
    noise = step_noise(prefill, fit, decode, decode_fit, mixed, mixed_fit)
    assert noise["prefill"] == [1.0, 1.5, 1.0, 1.2] and noise["prefill_at_s"] == [0.02, 0.02, 0.1, 0.05]
    assert noise["decode"] == [1.0, 1.2] and noise["decode_at_s"] == [0.005, 0.005]
    parsed = StepNoise.from_json(noise)
    assert parsed.prefill_at == (0.02, 0.02, 0.05, 0.1) and parsed.prefill == (1.0, 1.5, 1.2, 1.0)
