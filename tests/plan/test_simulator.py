"""The simulator against results computed by hand or by queueing theory."""
from __future__ import annotations

import random

import pytest

from kvferry.plan.instance import InstanceConfig
from kvferry.plan.simulator import ClusterConfig, Simulation
from tests.plan.helpers import cost, unique_request


def _mean_ttft(fast: bool, rate: float, service_s: float, n: int, seed: int = 1) -> float:
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        reqs.append(unique_request(i, t, 16, 1))
    # one 16-token prompt per step (the budget), each step takes exactly service_s: an M/D/1 queue
    inst = InstanceConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=16)
    sim = Simulation(ClusterConfig(num_colocated=1, instance=inst, fast=fast), cost((service_s, 0, 0, 0), (0, 0, 0)))
    results = sim.run(reqs).values()
    assert all(r.finish_s is not None and not r.failed for r in results)
    return sum(r.ttft_s for r in results) / n


@pytest.mark.parametrize("fast", [False, True], ids=["scheduler", "fast"])
def test_md1_prefill_queue_matches_the_analytic_mean_wait(fast):
    service_s, rho = 0.1, 0.6
    n = 20_000 if not fast else 40_000
    wait = _mean_ttft(fast, rho / service_s, service_s, n) - service_s
    expected = rho * service_s / (2 * (1 - rho))  # Pollaczek-Khinchine for deterministic service
    assert wait == pytest.approx(expected, rel=0.05)


def test_colocated_chunked_prefill_reproduces_hand_computed_latencies():
    """1 ms per prefilled token, 2 ms per decode step (the larger intercept of
    a mixed step), a 64-token budget. By hand:
      t=0     step 1: A 64 of 100                         -> 0.064
      t=.064  step 2: A 36 (its last), B 28 of 40 (chunk)  -> 0.128  A's 1st token
      t=.128  step 3: A decode, B 12 (its last)           -> 0.142  B's 1st token
      t=.142  step 4: A decode, B decode                  -> 0.144  both done
    """
    a = unique_request(0, 0.0, 100, 3)
    b = unique_request(1, 0.010, 40, 2)
    inst = InstanceConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=64, enable_prefix_caching=False)
    sim = Simulation(ClusterConfig(num_colocated=1, instance=inst), cost((0, 0.001, 0, 0), (0.002, 0, 0)))
    res = sim.run([a, b])
    assert res[0].ttft_s == pytest.approx(0.128)
    assert res[1].ttft_s == pytest.approx(0.132)
    assert res[0].finish_s == pytest.approx(0.144)
    assert res[1].finish_s == pytest.approx(0.144)
    assert res[0].tpot_s == pytest.approx(0.008)
    assert res[1].tpot_s == pytest.approx(0.002)
    assert sim.front[0].num_steps == 4


def test_disaggregated_prefill_then_transfer_then_decode():
    """Prefill 1 ms/token on the prefill instance, KV of 40 tokens at
    1 MB/token over 10 GB/s = 4 ms. The decode instance loads the two full
    blocks (32 tokens) and computes the partial block's 8 tokens plus the
    first token as a 9-token prefill chunk (9 ms; it samples token 2), then
    tokens 3 and 4 in 2 ms decode steps."""
    from kvferry.plan.latency import KVTransferModel

    req = unique_request(0, 0.0, 40, 4)
    inst = InstanceConfig(num_kv_blocks=64, block_size=16, enable_prefix_caching=False)
    cluster = ClusterConfig(num_colocated=0, num_prefill=1, num_decode=1, instance=inst,
                            transfer=KVTransferModel(bytes_per_token=1e6, bandwidth_gbps=10.0))
    sim = Simulation(cluster, cost((0, 0.001, 0, 0), (0.002, 0, 0)))
    r = sim.run([req])[0]
    assert r.ttft_s == pytest.approx(0.040)
    assert r.finish_s == pytest.approx(0.040 + 0.004 + 0.009 + 2 * 0.002)
    assert r.num_output_tokens == 4
    assert (sim.front[0].num_steps, sim.back[0].num_steps) == (1, 3)


def test_prefix_aware_router_keeps_a_shared_prefix_on_one_instance():
    """Two groups with distinct 4-block system prompts: prefix-aware sends
    each group to the instance that already holds it; round-robin does not."""
    from kvferry.plan.workload import SimRequest

    def req(i, group):
        keys = tuple(group * 100 + k for k in range(4)) + (10_000 + i,)
        return SimRequest(i, i * 1.0, 80, 2, keys, 16)

    reqs = [req(i, g) for i, g in enumerate([0, 1, 1, 0, 0, 1, 1, 0])]
    ratios = {}
    for router in ("prefix-aware", "round-robin"):
        inst = InstanceConfig(num_kv_blocks=256, block_size=16)
        sim = Simulation(ClusterConfig(num_colocated=2, router=router, instance=inst),
                         cost((0.001, 1e-5, 0, 0), (0.001, 0, 0)))
        sim.run([SimRequest(**{f: getattr(r, f) for f in ("request_id", "arrival_s", "input_len", "output_len",
                                                             "block_keys", "key_block_size")}) for r in reqs])
        q = sum(i.kv.stats.queries for i in sim.front)
        h = sum(i.kv.stats.hits for i in sim.front)
        ratios[router] = h / q
    # prefix-aware: every request but the first of each group hits 64 of 80 tokens
    assert ratios["prefix-aware"] == pytest.approx(6 * 64 / (8 * 80))
    assert ratios["round-robin"] < ratios["prefix-aware"]


def test_the_simulator_never_imports_torch():
    """It drives the scheduler and KV bookkeeping alone, so it runs where torch is absent."""
    import subprocess
    import sys

    code = ("import sys, kvferry.plan.simulator, kvferry.plan.search, kvferry.plan.cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("rate", [2.0, 6.0])
def test_fast_model_agrees_with_the_scheduler_driven_instance(rate):
    """The analytic model is a shortcut, not a different system: on a
    Poisson workload its medians and TTFT tail stay close to the real
    scheduler's (its TPOT tail is smoother: one TPOT per request)."""
    from dataclasses import replace

    from kvferry.plan.report import summarize

    rng = random.Random(3)
    t, reqs = 0.0, []
    for i in range(400):
        t += rng.expovariate(rate)
        reqs.append(unique_request(i, t, rng.randint(200, 600), rng.randint(20, 60)))
    step_cost = cost((0.01, 1e-4, 1e-8, 1e-8), (0.005, 2e-4, 1e-7))
    summaries = {}
    for fast in (False, True):
        cluster = ClusterConfig(num_colocated=1, instance=InstanceConfig(max_num_batched_tokens=512), fast=fast)
        summaries[fast] = summarize(list(Simulation(cluster, step_cost).run([replace(r) for r in reqs]).values()), {})
    real, fast = summaries[False], summaries[True]
    assert fast["ttft_ms"]["p50"] == pytest.approx(real["ttft_ms"]["p50"], rel=0.15)
    assert fast["ttft_ms"]["p99"] == pytest.approx(real["ttft_ms"]["p99"], rel=0.15)
    assert fast["tpot_ms"]["p50"] == pytest.approx(real["tpot_ms"]["p50"], rel=0.15)
