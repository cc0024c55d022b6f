"""Simulator validation's deterministic parts: the measured request list
becomes the simulated one (same send times, lengths and shared blocks), the
measured side is summarized with the simulator's definitions, and the error
table is computed and printed. The errors themselves are measured by
bench/validate_simulator.py, not tested."""
from __future__ import annotations

import argparse
import json

import pytest

from kvferry.plan.cli import load_requests, transfer_model
from kvferry.plan.instance import InstanceConfig, SchedulerInstance
from kvferry.plan.latency import StepCostModel
from kvferry.plan.simulator import ClusterConfig, Simulation
from kvferry.plan.validate import (
    block_hash_ids, breakdown_table, error_rows, markdown_table, measured_summary, plot_validation, predicted_spread,
    relative_error, request_breakdown, sittings_comparison, sittings_table, speed_table, spread_table, trace_lines)
from tests.plan.helpers import cost, unique_request, write_profile


def record(i: int, start: float, prompt: int, completion: int, ttft: float, e2e: float, error=None) -> dict:
    return {"request_id": i, "start_s": start, "prompt_tokens": prompt, "completion_tokens": completion,
            "ttft_s": ttft, "e2e_s": e2e, "error": error}


def test_block_hash_ids_name_equal_blocks_equally():
    a = block_hash_ids(list(range(40)), 16)
    b = block_hash_ids(list(range(32)) + [7] * 8, 16)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert a == block_hash_ids(list(range(40)), 16)  # no per-process salt
    assert block_hash_ids(list(range(16)), 16) != block_hash_ids(list(range(1, 17)), 16)


def test_trace_replays_the_measured_request_list(tmp_path):
    """Two prompts sharing 2 full blocks (a system prompt) and one sharing
    nothing: the simulated requests keep the send times, the lengths and
    exactly the shared leading blocks; a failed request is not replayed."""
    system = list(range(1000, 1032))
    prompts = [system + [1, 2, 3], list(range(5000, 5020)), system + [9] * 20, [1, 2]]
    records = [record(0, 0.50, 35, 4, 0.1, 0.3), record(1, 0.75, 20, 6, 0.1, 0.4),
               record(2, 1.25, 52, 5, 0.2, 0.5), record(3, 1.5, 2, 3, None, None, error="HTTP 500: boom")]
    lines = trace_lines(records, prompts, 16)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = argparse.Namespace(workload=None, trace=str(trace), num_requests=None, max_input_len=None,
                              max_output_len=None, rate=None, trace_block_size=16)
    reqs = load_requests(args)
    assert [(r.arrival_s, r.input_len, r.output_len) for r in reqs] == [(0.0, 35, 4), (0.25, 20, 6), (0.75, 52, 5)]
    assert [len(r.block_keys) for r in reqs] == [3, 2, 4]
    assert reqs[0].block_keys[:2] == reqs[2].block_keys[:2]
    assert reqs[0].block_keys[2] != reqs[2].block_keys[2]
    assert not set(reqs[1].block_keys) & set(reqs[0].block_keys)
    # the real scheduler sees the shared system prompt as equal tokens
    assert reqs[0].token_ids()[:32] == reqs[2].token_ids()[:32]


def test_misaligned_request_lists_are_refused():
    with pytest.raises(ValueError, match="not aligned"):
        trace_lines([record(0, 0.0, 10, 2, 0.1, 0.2)], [[1] * 11], 16)
    with pytest.raises(ValueError, match="prompts"):
        trace_lines([record(0, 0.0, 10, 2, 0.1, 0.2)] * 2, [[1] * 10], 16)


def test_measured_summary_uses_the_simulator_definitions():
    """TPOT = (e2e - ttft) / (tokens - 1); goodput over first send -> last finish."""
    records = [record(0, 1.0, 10, 5, 0.2, 0.6),     # tpot 0.1, finishes 1.6
               record(1, 2.0, 10, 3, 0.5, 0.9),     # tpot 0.2, finishes 2.9
               record(2, 2.5, 10, 1, 0.3, 0.3),     # no tpot (one token), meets the SLO
               record(3, 3.0, 10, 2, None, None, error="HTTP 500: boom")]
    s = measured_summary(records, {"ttft": 0.4, "tpot": 0.15})
    assert s["ttft_p50"] == pytest.approx(300.0)
    assert s["tpot_p50"] == pytest.approx(150.0)
    assert s["tpot_p99"] == pytest.approx(199.0)
    assert s["goodput"] == pytest.approx(2 / (2.9 - 1.0))
    assert measured_summary(records, {})["goodput"] is None


def test_error_table_rows_markdown_and_plot(tmp_path):
    assert relative_error(100.0, 110.0) == pytest.approx(0.1)
    assert relative_error(0.0, 1.0) is None and relative_error(None, 1.0) is None
    rows = (error_rows("colocated@1", {"ttft_p50": 100.0, "ttft_p99": 200.0, "tpot_p50": 50.0, "tpot_p99": 80.0,
                                       "goodput": 1.0},
                       {"ttft_p50": 90.0, "ttft_p99": 230.0, "tpot_p50": 50.0, "tpot_p99": 88.0, "goodput": 1.0})
            + error_rows("disagg@1", {"ttft_p50": 100.0, "ttft_p99": 100.0, "tpot_p50": 40.0, "tpot_p99": 40.0,
                                      "goodput": 0.0},
                         {"ttft_p50": 120.0, "ttft_p99": 100.0, "tpot_p50": 30.0, "tpot_p99": 40.0, "goodput": 0.5}))
    errs = {(r["run"], r["metric"]): r["rel_error"] for r in rows}
    assert errs[("colocated@1", "ttft_p50")] == pytest.approx(-0.1)
    assert errs[("colocated@1", "ttft_p99")] == pytest.approx(0.15)
    assert errs[("disagg@1", "tpot_p50")] == pytest.approx(-0.25)
    assert errs[("disagg@1", "goodput")] is None
    table = markdown_table(rows)
    lines = table.splitlines()
    assert len(lines) == 5 and lines[2].startswith("| colocated@1 | 100 / 90 (-10.0%)")
    assert "mean 15.0%, max 20.0%" in lines[-1]  # ttft_p50: |-10%| and |+20%|
    plot_validation(rows, tmp_path / "v.png")
    assert (tmp_path / "v.png").read_bytes()[:4] == b"\x89PNG"
    speed = speed_table({"colocated@1": {"measured_busy_s": 3.3, "simulated_busy_s": 3.0, "scale": 1.1}})
    assert speed.splitlines()[-1] == "| colocated@1 | 3.30 | 3.00 | 1.100 |"
    # a probe's scale gets its own column; a run without one shows a dash
    speed = speed_table({"a@1": {"measured_busy_s": 3.3, "simulated_busy_s": 3.0, "scale": 1.1, "probe_scale": 0.95},
                         "b@1": {"measured_busy_s": 2.0, "simulated_busy_s": 2.0, "scale": 1.0}})
    lines = speed.splitlines()
    assert "probe" in lines[0] and lines[2] == "| a@1 | 3.30 | 3.00 | 1.100 | 0.950 |"
    assert lines[3] == "| b@1 | 2.00 | 2.00 | 1.000 | - |"


def _sim_summary(ttft_p50: float, ttft_p99: float, goodput: float) -> dict:
    return {"ttft_ms": {"p50": ttft_p50, "p99": ttft_p99}, "tpot_ms": {"p50": 10.0, "p99": 10.0},
            "goodput": goodput}


def test_predicted_spread_is_the_relative_std_over_noise_seeds():
    """p99s of 90 and 110 over two seeds: mean 100, std 10, so 10%; equal
    values spread 0; one seed, or a metric a seed lacks, has no spread."""
    sim = {"seed_summaries": [_sim_summary(50.0, 90.0, 1.0), _sim_summary(50.0, 110.0, None)]}
    spread = predicted_spread(sim)
    assert spread["ttft_p99"] == pytest.approx(0.10)
    assert spread["ttft_p50"] == 0.0 and spread["tpot_p99"] == 0.0
    assert spread["goodput"] is None
    assert all(v is None for v in predicted_spread({"seed_summaries": [_sim_summary(1, 2, 1)]}).values())
    assert all(v is None for v in predicted_spread({}).values())
    table = spread_table({"a@1": spread, "b@1": predicted_spread({"seed_summaries": [_sim_summary(40, 80, 1)] * 2})})
    lines = table.splitlines()
    assert lines[2] == "| a@1 | 0.0% | 10.0% | 0.0% | 0.0% | - |"
    assert lines[-1] == "| **mean** | 0.0% | 5.0% | 0.0% | 0.0% | 0.0% |"


def test_disaggregated_request_waits_for_its_decode_instance_step():
    """The decode instance names the KV destination before the prompt goes
    to a prefill instance: it admits the request when it plans its next step
    and answers with that step's outputs. A decodes on D in 10 ms steps; B
    arriving at 0.030 while D is mid-step is admitted by the step after, and
    starts its prefill only when that one ends."""
    a = unique_request(0, 0.0, 10, 8)
    b = unique_request(1, 0.030, 10, 2)
    inst = InstanceConfig(num_kv_blocks=64, block_size=16, enable_prefix_caching=False)
    cluster = ClusterConfig(num_colocated=0, num_prefill=1, num_decode=1, instance=inst)
    # prefill: 1 ms per token (10 ms per prompt); decode step 10 ms (a mixed step pays 10 ms too)
    sim = Simulation(cluster, cost((0, 0.001, 0, 0), (0.010, 0, 0)))
    res = sim.run([a, b])
    assert res[0].ttft_s == pytest.approx(0.010)
    # D's steps for A: [0.010, 0.021] (partial block 10 + first token: 11 ms), then 10 ms decodes:
    # [0.021, 0.031], [0.031, 0.041] ... B arrives at 0.030 mid-step, D admits it in [0.031, 0.041]
    # and answers at 0.041; its prefill runs [0.041, 0.051].
    assert res[1].first_token_s == pytest.approx(0.051)


def test_served_profile_hand_over_is_the_default_transfer_latency(tmp_path):
    prof = write_profile(tmp_path / "p.json", (0.01, 0, 0, 0), (0.01, 0, 0))
    data = json.loads(prof.read_text())
    data["handover_s"] = 0.025
    prof.write_text(json.dumps(data))
    args = argparse.Namespace(profile=str(prof), kv_latency_ms=None, kv_bytes_per_token=0.0, kv_bandwidth_gbps=1.0)
    assert transfer_model(args).latency_s == pytest.approx(0.025)
    args.kv_latency_ms = 5.0
    assert transfer_model(args).latency_s == pytest.approx(0.005)


def test_request_overhead_delays_the_arrival_at_the_engine():
    """A served profile's per-request overhead (HTTP, process hops) adds to
    TTFT and queues: B, sent 5 ms after A, starts after A's 10 ms prefill."""
    a, b = unique_request(0, 0.0, 10, 1), unique_request(1, 0.005, 10, 1)
    inst = InstanceConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=10)
    sim = Simulation(ClusterConfig(num_colocated=1, instance=inst),
                     StepCostModel((0, 0.001, 0, 0), (0, 0, 0), request_overhead_s=0.020))
    res = sim.run([a, b])
    assert res[0].ttft_s == pytest.approx(0.030)
    assert res[1].ttft_s == pytest.approx(0.040 - 0.005)


def test_request_breakdown_splits_ttft_error_by_idle_and_busy_server():
    """Requests 0 and 2 find the server idle, 1 is sent while 0 runs; a
    failed request is not paired. Errors are (predicted - measured) / measured."""
    records = [record(0, 0.0, 10, 5, 0.100, 0.500), record(1, 0.2, 10, 5, 0.200, 0.600),
               record(9, 0.3, 10, 5, None, None, error="HTTP 500"), record(2, 2.0, 10, 5, 0.100, 0.300)]
    sims = [{"request_id": i, "arrival_s": t, "ttft_ms": ttft, "tpot_ms": tpot}
            for i, t, ttft, tpot in ((0, 0.0, 90.0, 100.0), (1, 0.2, 150.0, 100.0), (2, 2.0, 110.0, 50.0))]
    b = request_breakdown(records, sims)
    assert b["ttft_idle"]["n"] == 2 and b["ttft_idle"]["mean_rel_error"] == pytest.approx(0.0)  # -10%, +10%
    assert b["ttft_busy"]["n"] == 1 and b["ttft_busy"]["mean_rel_error"] == pytest.approx(-0.25)
    # measured TPOTs: 100, 100, 50 ms
    assert b["tpot"]["n"] == 3 and b["tpot"]["mean_rel_error"] == pytest.approx(0.0)
    assert "| r | +0.0% (2) | -25.0% (1) | +0.0% (3) |" in breakdown_table({"r": b})
    with pytest.raises(ValueError, match="sim_requests"):
        request_breakdown(records, sims[:2])


def test_a_token_leaving_while_its_instance_steps_on_arrives_first_token_delay_later(tmp_path):
    """Prefill 1 ms per token, decode steps 10 ms, delay 5 ms. A (10 tokens,
    3 out) steps on after its first token: TTFT 10 + 5 ms; its last token
    leaves an idle instance: no delay. B (1 token out) ends its instance's work."""
    inst = InstanceConfig(num_kv_blocks=64, block_size=16, enable_prefix_caching=False)
    delayed = StepCostModel((0, 0.001, 0, 0), (0.010, 0, 0), first_token_delay_s=0.005)
    res = Simulation(ClusterConfig(num_colocated=1, instance=inst), delayed).run(
        [unique_request(0, 0.0, 10, 3), unique_request(1, 1.0, 10, 1)])
    assert res[0].first_token_s == pytest.approx(0.015)
    assert res[0].finish_s == pytest.approx(0.030)  # prefill step, then two 10 ms decode steps
    assert res[1].first_token_s == pytest.approx(1.010) and res[1].finish_s == pytest.approx(1.010)
    path = write_profile(tmp_path / "p.json", (0, 0.001, 0, 0), (0.010, 0, 0))
    data = json.loads(path.read_text())
    data["first_token_delay_s"] = 0.005
    path.write_text(json.dumps(data))
    assert StepCostModel.from_profile(str(path)).first_token_delay_s == 0.005


def test_simulated_instances_default_to_the_servers_scheduler_settings():
    """The simulator runs the real scheduler: with the server's defaults,
    unless told otherwise, so that a replay plans the same steps."""
    from kvferry.config import EngineArgs

    served, sim = EngineArgs(), InstanceConfig()
    assert (sim.block_size, sim.max_num_seqs, sim.max_num_batched_tokens, sim.enable_prefix_caching) == \
        (served.block_size, served.max_num_seqs, served.max_num_batched_tokens, served.enable_prefix_caching)
    sched = served.create_engine_config().scheduler
    inst = SchedulerInstance("engine-0", "colocated", cost((0, 0, 0, 0), (0, 0, 0)), sim)
    assert inst.scheduler.config.enable_chunked_prefill == sched.enable_chunked_prefill
    assert inst.scheduler.config.preemption_mode == sched.preemption_mode


def test_sittings_comparison_measures_the_runs_reproducibility_and_the_error_against_their_mean():
    """Two sittings of one run: measured 90 and 110 (mean 100, std 14.1%);
    predictions 100 and 121. Sitting a: 11.1% off its own run, 0% off the
    mean, and the mean 11.1% off its run; b: 10%, 21% and 9.1%. A metric
    one sitting lacks is left out; one sitting alone is refused."""
    def rows(measured: float, predicted: float, tpot: float | None) -> list[dict]:
        return error_rows("c@1", {"ttft_p99": measured, "tpot_p50": tpot}, {"ttft_p99": predicted, "tpot_p50": 5.0})

    cmp = sittings_comparison({"a": rows(90.0, 100.0, 5.0), "b": rows(110.0, 121.0, None)})
    assert cmp["spread"]["c@1"]["ttft_p99"] == pytest.approx(14.142 / 100, rel=1e-3)
    assert "tpot_p50" not in cmp["spread"]["c@1"]
    a, b = cmp["per_sitting"]["a"], cmp["per_sitting"]["b"]
    assert a["own"]["ttft_p99"] == pytest.approx(10 / 90)
    assert a["prediction_vs_mean"]["ttft_p99"] == pytest.approx(0.0)
    assert a["mean_vs_own"]["ttft_p99"] == pytest.approx(10 / 90)
    assert b["own"]["ttft_p99"] == pytest.approx(0.10)
    assert b["prediction_vs_mean"]["ttft_p99"] == pytest.approx(0.21)
    assert b["mean_vs_own"]["ttft_p99"] == pytest.approx(10 / 110)
    assert a["own"]["tpot_p50"] is None
    table = sittings_table(cmp).splitlines()
    assert table[0] == "| run | ttft_p99 spread |" and table[2] == "| c@1 | 14.1% |"
    assert "| b | prediction vs mean of sittings | 21.0% |" in table
    with pytest.raises(ValueError, match="at least two"):
        sittings_comparison({"a": rows(90.0, 100.0, 5.0)})
