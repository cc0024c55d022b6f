"""``kvferry simulate`` and ``kvferry plan`` as a user runs them: real
processes, real files."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.plan.helpers import write_profile, write_trace


def kvferry(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvferry.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


# r0 [1,2,3]; r1 [1,2,4] hits 2; r2 [1,5] hits 1; r3 [1,2,3] hits 3  ->  6 of 11 blocks
HAND_TRACE = [(0, 1536, 8, [1, 2, 3]), (100, 1536, 8, [1, 2, 4]), (200, 1024, 8, [1, 5]), (300, 1536, 8, [1, 2, 3])]


@pytest.mark.parametrize("extra, ratio, per_instance", [
    ([], 6 / 11, [6 / 11]),
    # round-robin: engine-0 gets r0, r2 (1 of 5); engine-1 gets r1, r3 (2 of 6: r3 finds [1,2] from r1)
    (["--config", "colocated:2"], 3 / 11, [1 / 5, 2 / 6]),
    # LRU of 3 blocks: r1 evicts [1,2,3]'s last block, r2 evicts [1,2]: r3 hits 1
    (["--cache-blocks", "3"], 4 / 11, [4 / 11]),
])
def test_cache_only_gives_the_exact_block_hit_ratio(tmp_path, extra, ratio, per_instance):
    trace = write_trace(tmp_path / "t.jsonl", HAND_TRACE)
    args = ["simulate", "--trace", str(trace), "--json", *extra]
    if "--cache-blocks" not in extra:
        args += ["--cache-blocks", "inf"]
    out = kvferry(*args)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["mode"] == "cache-only"
    assert result["summary"]["block_hit_ratio"] == pytest.approx(ratio)
    assert [i["block_hit_ratio"] for i in result["instances"]] == pytest.approx(per_instance)


def test_simulate_reports_mode_percentiles_goodput_and_hits(tmp_path):
    profile = write_profile(tmp_path / "p.json", (0.002, 1e-5, 0, 0), (0.001, 1e-5, 0))
    for mode, flags in (("scheduler", []), ("fast-analytic", ["--fast"])):
        out = kvferry("simulate", "--profile", str(profile), "--workload", "shared-prefix", "--num-requests", "40",
                      "--rate", "5", "--output-len", "8", "--config", "prefill:1,decode:1",
                      "--slo", "ttft:1000,tpot:100", "--json", *flags)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        s = result["summary"]
        assert result["mode"] == mode
        assert s["completed"] == 40 and s["slo_attainment_pct"] == 100.0
        assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"] < 1000
        prefill = result["instances"][0]
        assert prefill["role"] == "prefill"
        # 4 groups of a 512-word system prompt: most prompt blocks come from the cache
        assert prefill["block_hit_ratio"] > 0.6


def test_simulate_with_measured_noise_averages_seeds_and_lists_requests(tmp_path):
    """A profile with step noise: --noise-seeds runs, their mean reported;
    --per-request lists every request; the same command gives the same JSON."""
    profile = write_profile(tmp_path / "p.json", (0.002, 1e-5, 0, 0), (0.001, 1e-5, 0))
    data = json.loads(profile.read_text())
    data["step_noise"] = {"prefill": [0.8, 1.0, 1.6], "decode": [1.0, 3.0]}
    profile.write_text(json.dumps(data))
    args = ["simulate", "--profile", str(profile), "--workload", "random", "--num-requests", "12", "--rate", "20",
            "--input-len", "64", "--output-len", "8", "--per-request", "--json"]
    runs = [kvferry(*args, "--noise-seeds", n) for n in ("3", "3", "1")]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    three, again, one = (json.loads(r.stdout) for r in runs)
    assert three["noise_seeds"] == 3 and one["noise_seeds"] == 1
    assert three["summary"] == again["summary"] and three["summary"]["ttft_ms"] != one["summary"]["ttft_ms"]
    # each seed's own run is kept, and the reported summary is their mean
    seeds = three["seed_summaries"]
    assert len(seeds) == 3 and len(one["seed_summaries"]) == 1
    assert len({s["ttft_ms"]["p99"] for s in seeds}) > 1
    assert sum(s["ttft_ms"]["p99"] for s in seeds) / 3 == pytest.approx(three["summary"]["ttft_ms"]["p99"])
    reqs = three["requests"]
    assert [r["request_id"] for r in reqs] == list(range(12)) and all(r["ttft_ms"] > 0 for r in reqs)
    assert sum(r["ttft_ms"] for r in reqs) / 12 == pytest.approx(three["summary"]["ttft_ms"]["mean"])


def test_step_time_scale_stretches_every_step_and_reports_busy_time(tmp_path):
    """--step-time-scale 2: twice the simulated busy time, and a lone
    request's TTFT twice its prefill step plus the unscaled request overhead."""
    profile = write_profile(tmp_path / "p.json", (0.002, 1e-5, 0, 0), (0.001, 1e-5, 0))
    data = json.loads(profile.read_text())
    data["request_overhead_s"] = 0.004
    profile.write_text(json.dumps(data))
    args = ["simulate", "--profile", str(profile), "--workload", "random", "--num-requests", "3", "--rate", "0.5",
            "--input-len", "100", "--output-len", "4", "--json"]
    one, two = (json.loads(kvferry(*args, *scale).stdout) for scale in ([], ["--step-time-scale", "2"]))
    assert one["step_time_scale"] == 1.0 and two["step_time_scale"] == 2.0
    assert two["busy_s"] == pytest.approx(2 * one["busy_s"]) and one["busy_s"] > 0
    prefill = 0.002 + 100 * 1e-5
    assert one["summary"]["ttft_ms"]["p50"] == pytest.approx(1000 * (0.004 + prefill), rel=0.02)
    assert two["summary"]["ttft_ms"]["p50"] == pytest.approx(1000 * (0.004 + 2 * prefill), rel=0.02)


@pytest.mark.parametrize("args, message", [
    (["--workload", "random"], "--profile is required"),
    (["--profile", "{p}", "--workload", "random", "--config", "prefill:2"], "--config: num_prefill and num_decode"),
    (["--profile", "{p}", "--workload", "random", "--config", "many"], "--config"),
    (["--profile", "{p}"], "give one of --workload or --trace"),
    (["--profile", "{p}", "--workload", "random", "--trace", "default"], "give one of"),
    (["--profile", "{p}", "--workload", "random", "--slo", "ttft:-1"], "--slo"),
    (["--profile", "{p}", "--workload", "random", "--rate", "0"], "--rate"),
    (["--profile", "{p}", "--workload", "random", "--num-kv-blocks", "0"], "--num-kv-blocks"),
    (["--profile", "{tmp}/missing.json", "--workload", "random"], "cannot read"),
    (["--trace", "{tmp}/missing.jsonl", "--cache-blocks", "inf"], "cannot read"),
    (["--trace", "default", "--cache-blocks", "lots"], "--cache-blocks"),
    (["--profile", "{p}", "--workload", "nope"], "invalid choice"),
    (["--profile", "{p}", "--workload", "random", "--noise-seeds", "0"], "--noise-seeds"),
    (["--profile", "{p}", "--workload", "random", "--step-time-scale", "0"], "--step-time-scale"),
])
def test_bad_arguments_print_one_line_and_exit_2(tmp_path, args, message):
    profile = write_profile(tmp_path / "p.json", (0.001, 0, 0, 0), (0.001, 0, 0))
    args = [a.format(p=profile, tmp=tmp_path) for a in args]
    out = kvferry("simulate", *args)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert message in out.stderr and out.stderr.startswith("kvferry simulate: error:")


def test_plan_bad_arguments_exit_2(tmp_path):
    profile = write_profile(tmp_path / "p.json", (0.001, 0, 0, 0), (0.001, 0, 0))
    for args, message in ((["--workload", "random", "--gpus", "2"], "--slo is required"),
                          (["--workload", "random", "--slo", "ttft:100", "--gpus", "0"], "--gpus")):
        out = kvferry("plan", "--profile", str(profile), *args, "--output", str(tmp_path / "plan.png"))
        assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_plan_picks_the_placement_solvable_by_hand(tmp_path):
    """Requests every 100 ms, 16-token prompts (4 ms/token: a 64 ms prefill),
    21 output tokens (20 decode steps of 10 ms), SLO TTFT 100 ms, TPOT 12 ms.
    - colocated: a decode sharing a step with another prompt's prefill pays
      74 ms for that step, so its TPOT exceeds 12 ms. With C instances a
      prompt comes every C * 100 ms; a decode lasts >= 200 ms: C = 1, 2 fail,
      C = 3 meets the SLOs -> best colocated 3C, goodput/GPU = rate / 3.
    - disaggregated: 1P1D meets both (prefill 64 ms, decode steps 10 ms) ->
      rate / 2 per GPU: the best placement."""
    rows = [(100 * i, 16, 21, [1000 + i]) for i in range(40)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    profile = write_profile(tmp_path / "p.json", (0, 0.004, 0, 0), (0.010, 0, 0))
    png = tmp_path / "plan.png"
    out = kvferry("plan", "--profile", str(profile), "--trace", str(trace), "--trace-block-size", "16",
                  "--slo", "ttft:100,tpot:12", "--gpus", "4", "--output", str(png))
    assert out.returncode == 0, out.stderr
    result = json.loads(png.with_suffix(".json").read_text())
    by_label = {(c["num_colocated"], c["num_prefill"], c["num_decode"]): c for c in result["candidates"]}
    assert by_label[(1, 0, 0)]["slo_attainment_pct"] < 50
    assert by_label[(2, 0, 0)]["slo_attainment_pct"] < 50
    assert by_label[(3, 0, 0)]["slo_attainment_pct"] == 100.0
    best, colo = result["best"], result["best_colocated"]
    assert (best["num_prefill"], best["num_decode"]) == (1, 1)
    assert best["goodput_per_gpu"] == pytest.approx(result["rate"] / 2)
    assert colo["num_colocated"] == 3
    assert colo["goodput_per_gpu"] == pytest.approx(result["rate"] / 3)
    assert "best: 1P1D" in out.stdout
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_plan_packs_instances_onto_hosts(tmp_path):
    """The hand-solvable case above, with a measured host sharing of 1.5 for
    decode steps (prefill unaffected). --instances-per-host 1 is the default
    search, candidate for candidate. With 2 per host, 1P1D shares a host: a
    decode step takes 15 ms while the prefill core runs a prompt (64 of every
    100 ms), so a decode's mean step is about 13 ms > the 12 ms TPOT SLO and
    1P1D fails; in 1P2D decode-1 has a host of its own (prefill-0, decode-0 |
    decode-1), so about half the requests (least-loaded) still meet the SLOs."""
    rows = [(100 * i, 16, 21, [1000 + i]) for i in range(40)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    profile = write_profile(tmp_path / "p.json", (0, 0.004, 0, 0), (0.010, 0, 0))
    data = json.loads(profile.read_text())
    data["host_sharing"] = {"prefill": 1.0, "decode": 1.5}
    profile.write_text(json.dumps(data))

    def plan(name: str, *extra: str) -> tuple[dict, str]:
        png = tmp_path / f"{name}.png"
        out = kvferry("plan", "--profile", str(profile), "--trace", str(trace), "--trace-block-size", "16",
                      "--slo", "ttft:100,tpot:12", "--gpus", "4", "--output", str(png), *extra)
        assert out.returncode == 0, out.stderr
        return json.loads(png.with_suffix(".json").read_text()), out.stdout

    (default, _), (one, _), (two, text) = plan("d"), plan("k1", "--instances-per-host", "1"), \
        plan("k2", "--instances-per-host", "2")
    assert one["candidates"] == default["candidates"] and one["best"] == default["best"]
    assert default["instances_per_host"] == 1 and two["instances_per_host"] == 2
    assert (default["best"]["num_prefill"], default["best"]["num_decode"]) == (1, 1)
    by_label = {(c["num_colocated"], c["num_prefill"], c["num_decode"]): c for c in two["candidates"]}
    assert by_label[(0, 1, 1)]["slo_attainment_pct"] < 10
    assert 35 < by_label[(0, 1, 2)]["slo_attainment_pct"] < 70
    assert (two["best"]["num_prefill"], two["best"]["num_decode"]) != (1, 1)
    assert "(2 per host)" in text

    bad = kvferry("plan", "--profile", str(profile), "--trace", str(trace), "--slo", "ttft:100", "--gpus", "2",
                  "--instances-per-host", "0", "--output", str(tmp_path / "bad.png"))
    assert bad.returncode == 2 and "--instances-per-host" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
