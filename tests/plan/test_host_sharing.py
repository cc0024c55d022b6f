"""Instances on one host slow each other while both step (plan/host.py),
the served profile's measurement of it, and the simulator's use."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvferry.bench.profile_served import host_sharing, noise_ratios, overlap_sample, server_mixes
from kvferry.plan.host import HostClock, HostSharing, place
from kvferry.plan.instance import InstanceConfig
from kvferry.plan.latency import StepCostModel, StepNoise
from kvferry.plan.simulator import ClusterConfig, Simulation
from tests.plan.helpers import unique_request, write_profile

PREFILL = {"terms": ["1", "new", "new*cached", "new^2"], "coef": [0.030, 0.001, 0.0, 0.0]}


# -- the clock -----------------------------------------------------------------------
def _ends(moved) -> dict:
    return {inst: pytest.approx(at) for inst, at, _ in moved}


def test_a_step_alone_on_its_host_takes_its_own_time():
    clock = HostClock([["a", "b"]], HostSharing(prefill=1.5, decode=1.2))
    assert _ends(clock.start("a", 0.0, 1.0, True)) == {"a": 1.0}
    stretch, moved = clock.finish("a", 1.0)
    assert stretch == pytest.approx(0.0) and moved == []


def test_two_steps_slow_each_other_only_while_both_run():
    # a: 1 s of prefill from t=0; b: 1 s of decode from t=0.5; factors 1.5 / 1.2
    clock = HostClock([["a", "b"]], HostSharing(prefill=1.5, decode=1.2))
    clock.start("a", 0.0, 1.0, True)
    # from 0.5 both run: a has 0.5 s left at rate 1/1.5 -> ends 1.25; b at 1/1.2 -> would end 1.7
    assert _ends(clock.start("b", 0.5, 1.0, False)) == {"a": 1.25, "b": 1.7}
    stretch, moved = clock.finish("a", 1.25)
    assert stretch == pytest.approx(0.25)
    # b did 0.75 / 1.2 = 0.625 s of work; the 0.375 s left now run at full speed
    assert _ends(moved) == {"b": 1.625}
    stretch, _ = clock.finish("b", 1.625)
    assert stretch == pytest.approx(0.125)


def test_stale_step_ends_are_told_apart():
    clock = HostClock([["a", "b"]], HostSharing(prefill=2.0))
    (_, _, first), = clock.start("a", 0.0, 1.0, True)
    moved = clock.start("b", 0.2, 1.0, True)
    newer = dict((i, v) for i, _, v in moved)["a"]
    assert not clock.is_current("a", first) and clock.is_current("a", newer)


def test_instances_on_their_own_hosts_never_slow_each_other():
    clock = HostClock([["a"], ["b"]], HostSharing(prefill=3.0, decode=3.0))
    clock.start("a", 0.0, 1.0, True)
    assert _ends(clock.start("b", 0.5, 1.0, True)) == {"b": 1.5}
    assert clock.finish("a", 1.0) == (pytest.approx(0.0), [])


def test_placement_pairs_the_pools_host_by_host():
    assert place(["p0", "p1"], ["d0", "d1", "d2"], 2) == [["p0", "d0"], ["p1", "d1"], ["d2"]]
    assert place(["e0", "e1", "e2"], [], 2) == [["e0", "e1"], ["e2"]]
    assert place(["p0"], ["d0"], 1) == [["p0"], ["d0"]]
    with pytest.raises(ValueError, match="instances_per_host"):
        place(["p0"], ["d0"], 0)


def test_host_sharing_is_checked_and_read():
    with pytest.raises(ValueError, match="host_sharing.prefill"):
        HostSharing(prefill=0.9)
    assert HostSharing.from_json(None) is None
    assert HostSharing.from_json({"prefill": 1.3, "decode": 1.1}) == HostSharing(1.3, 1.1)


# -- the simulator -----------------------------------------------------------------
def _disagg_run(per_host: int, sharing: HostSharing | None) -> dict:
    # prefill: 0.01 + 0.001/token; decode: 0.02 per step
    cost = StepCostModel((0.01, 0.001, 0.0, 0.0), (0.02, 0.0, 0.0), host_sharing=sharing)
    cluster = ClusterConfig(num_colocated=0, num_prefill=1, num_decode=1,
                            instance=InstanceConfig(max_num_batched_tokens=2048), instances_per_host=per_host)
    # request 0 decodes 50 tokens (1 s); request 1 arrives while it decodes
    reqs = [unique_request(0, 0.0, 100, 51), unique_request(1, 0.5, 190, 2)]
    return Simulation(cluster, cost).run(reqs)


def test_a_prefill_overlapping_decode_on_one_host_takes_the_modelled_factor():
    alone = _disagg_run(1, HostSharing(prefill=1.5, decode=1.0))
    shared = _disagg_run(2, HostSharing(prefill=1.5, decode=1.0))
    # request 0 prefilled with the decode core idle: no change
    assert shared[0].ttft_s == pytest.approx(alone[0].ttft_s)
    # request 1's prefill (0.2 s alone) ran wholly beside decode steps: 1.5x
    assert alone[1].ttft_s - shared[1].ttft_s == pytest.approx(-0.5 * 0.2)


def test_shared_hosts_without_a_measured_sharing_or_own_hosts_change_nothing():
    base = _disagg_run(1, None)
    for per_host, sharing in ((2, None), (1, HostSharing(2.0, 2.0))):
        run = _disagg_run(per_host, sharing)
        assert [(r.ttft_s, r.finish_s) for r in run.values()] == [(r.ttft_s, r.finish_s) for r in base.values()]


def test_decode_steps_beside_a_prefill_stretch_tpot():
    shared = _disagg_run(2, HostSharing(prefill=1.0, decode=2.0))
    alone = _disagg_run(1, HostSharing(prefill=1.0, decode=2.0))
    # request 0's decode steps beside request 1's 0.2 s prefill ran at half speed: 0.1 s of work lost
    # (within a step: the prefill starts and ends mid-step)
    assert shared[0].finish_s - alone[0].finish_s == pytest.approx(0.1, abs=0.021)


def test_simulate_cli_takes_instances_per_host(tmp_path):
    prof = write_profile(tmp_path / "p.json", (0.01, 0.001, 0.0, 0.0), (0.02, 0.0, 0.0))
    data = json.loads(prof.read_text())
    data["host_sharing"] = {"prefill": 1.5, "decode": 1.0}
    prof.write_text(json.dumps(data))

    def ttft_p50(*extra: str) -> float:
        out = subprocess.run([sys.executable, "-m", "kvferry.cli", "simulate", "--profile", str(prof),
                              "--workload", "random", "--rate", "4", "--num-requests", "30", "--config",
                              "prefill:1,decode:1", "--json", *extra], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)["summary"]["ttft_ms"]["p50"]

    assert ttft_p50("--instances-per-host", "2") > ttft_p50()
    bad = subprocess.run([sys.executable, "-m", "kvferry.cli", "simulate", "--profile", str(prof), "--workload",
                          "random", "--config", "prefill:1,decode:1", "--instances-per-host", "0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("kvferry simulate: error: --instances-per-host")
    assert "Traceback" not in bad.stderr


# -- the served profile's measurement -----------------------------------------------
def _probe(time_s: float, pairs: list[tuple[float, float, float, list[float]]]) -> dict:
    """A mixed point; pairs: (ttft_s, alone_ttft_s, decode_gap_s, overlap_gaps_s) per sample."""
    return {"new": 170, "cached": 16, "batch": 1, "context": 130, "time_s": time_s, "samples_s": [time_s],
            "pairs": [dict(zip(("ttft_s", "alone_ttft_s", "decode_gap_s", "overlap_gaps_s"), q)) for q in pairs]}


def test_a_server_that_mixes_measures_no_host_sharing():
    pred = 0.030 + 0.001 * 170  # 0.2 s
    mixed = _probe(pred + 0.03, [])
    assert server_mixes([mixed], PREFILL)
    assert not server_mixes([mixed], PREFILL, {"prefill", "decode"})  # the roles decide where known
    assert server_mixes([_probe(0.03, [])], PREFILL, {"engine"})
    assert host_sharing([], 0.01) is None


def test_a_disaggregated_server_measures_host_sharing():
    # TTFT 0.355 = overhead 0.01 + routing hop 1.5 * 0.03 + prefill 0.3, alone 0.21 = 0.01 + 0.2: 1.5x;
    # the streams stepped at 0.03 s before the newcomer and at a median 0.033 s beside its prefill: 1.1x
    probe = _probe(0.03, [(0.355, 0.21, 0.03, [0.033, 0.036, 0.03]), (0.355, 0.21, 0.03, [0.033])])
    assert not server_mixes([probe, mixed_looking := _probe(0.2, []), probe], PREFILL)
    assert server_mixes([probe, mixed_looking, mixed_looking], PREFILL)
    sharing = host_sharing([probe], 0.01)
    assert sharing["prefill"] == pytest.approx(1.5) and sharing["prefill_ratios"] == [1.5, 1.5]
    assert sharing["decode"] == pytest.approx(1.1)
    # the median over samples: one slow pair does not carry it
    skewed = _probe(0.03, [(0.355, 0.21, 0.03, [0.03])] * 2 + [(0.9, 0.21, 0.03, [0.03])])
    assert host_sharing([skewed], 0.01)["prefill"] == pytest.approx(1.5)
    # a measured speed-up is noise: sharing never speeds a step up
    assert host_sharing([_probe(0.03, [(0.1, 0.21, 0.03, [0.02])])], 0.01) | {"points": None} == {
        "prefill": 1.0, "decode": 1.0, "prefill_ratios": [0.225], "decode_ratios": [0.667], "points": None}


def test_overlap_sample_reads_the_steps_beside_the_prefill():
    # one stream stepping every 30 ms; the newcomer sent at 1.0, first token at 1.4, overhead 10 ms
    times = [[0.91 + 0.03 * i for i in range(3)] + [0.97 + 0.04 * i for i in range(1, 12)]]
    sample = overlap_sample(times, 1.0, 1.4, 0.01)
    assert sample["ttft_s"] == pytest.approx(0.4)
    assert sample["decode_gap_s"] == pytest.approx(0.03)
    # admitted by 1.0 + 0.01 + 2 * 0.03: only gaps that began after the send and end after that
    assert sample["overlap_gaps_s"] and all(g == pytest.approx(0.04) for g in sample["overlap_gaps_s"])


def test_noise_of_a_disaggregated_profile_keeps_only_real_prefill_samples():
    # the bug this guards: decode-only gaps over a prefill+decode prediction gave ratios of ~0.1
    points = [{"new": 170, "cached": 16, "time_s": 0.2, "samples_s": [0.2, 0.21]}]
    assert noise_ratios(points, PREFILL) == [1.0, 1.05]


def _fast_run(per_host: int, sharing: HostSharing | None, noise: StepNoise | None = None) -> dict:
    cost = StepCostModel((0.01, 0.001, 0.0, 0.0), (0.02, 0.0, 0.0), noise=noise, host_sharing=sharing)
    cluster = ClusterConfig(num_colocated=0, num_prefill=1, num_decode=1, fast=True, instances_per_host=per_host)
    reqs = [unique_request(0, 0.0, 100, 51), unique_request(1, 0.5, 190, 2)]
    return Simulation(cluster, cost).run(reqs)


def test_fast_mode_slows_a_prefill_beside_decodes_on_its_host():
    alone, shared = _fast_run(1, HostSharing(1.5, 1.0)), _fast_run(2, HostSharing(1.5, 1.0))
    assert shared[0].ttft_s == pytest.approx(alone[0].ttft_s)  # the decode instance was idle
    assert shared[1].ttft_s == pytest.approx(alone[1].ttft_s + 0.5 * 0.2)  # request 0 was decoding
    assert [r.finish_s for r in _fast_run(1, None).values()] == [r.finish_s for r in alone.values()]


def test_fast_mode_prices_steps_at_the_mean_measured_spread():
    plain = _fast_run(1, None)
    noisy = _fast_run(1, None, StepNoise(prefill=(1.0, 1.4), decode=(0.9, 1.1)))
    assert noisy[0].ttft_s == pytest.approx(1.2 * plain[0].ttft_s)
    assert noisy[0].tpot_s == pytest.approx(plain[0].tpot_s)
