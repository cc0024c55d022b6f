"""The planner models attention/FFN disaggregation (AFD) from an MoE
profile: the unit's step (plan/afd.py), its candidates in ``kvferry plan``
beside colocated and P/D, ``--equal-cost`` and ``kvferry simulate --afd``.
Hand-made profiles (only the fits are read) through the real CLI."""
from __future__ import annotations

import json

import pytest

from kvferry.plan.afd import AFDShape, AFDStepCost, MoEFits, afd_breakdown, parse_afd_shapes
from kvferry.plan.latency import StepCostModel
from tests.plan.helpers import write_profile
from tests.plan.test_cli import kvferry

DECODE = (0.001, 0.0006, 0.0)
FITS = MoEFits(moe=(0.0, 1e-4, 0.0), hop=(1e-5, 0.0), num_experts=128, top_k=8, num_layers=1, num_moe_layers=1,
               bytes_per_token=4096.0)


def moe_profile(path, decode=DECODE, moe=FITS.moe, hop=FITS.hop, experts=128, top_k=8, layers=1, moe_layers=1):
    """A profile as ``kvferry profile`` writes one for an MoE model (its fits only)."""
    data = {"prefill": {"fit": {"terms": ["1", "new", "new*cached", "new^2"], "coef": [0.002, 2e-5, 0.0, 0.0]}},
            "decode": {"fit": {"terms": ["1", "batch", "batch*context"], "coef": list(decode)}},
            "moe": {"fit": {"terms": ["1", "experts", "experts*tokens_per_expert"], "coef": list(moe)},
                    "num_experts": experts, "top_k": top_k, "num_layers": layers, "num_moe_layers": moe_layers},
            "afd_hop": {"fit": {"terms": ["1", "bytes"], "coef": list(hop)}, "bytes_per_token": 4096}}
    path.write_text(json.dumps(data))
    return path


def unit(shape: AFDShape, micro_batches: int, fits: MoEFits = FITS, decode=DECODE) -> AFDStepCost:
    return AFDStepCost.of(StepCostModel((0.002, 2e-5, 0.0, 0.0), decode), fits, shape, micro_batches)


# -- the unit's step --------------------------------------------------------------------
def test_without_overlap_a_one_plus_one_unit_is_the_node_plus_a_hop_per_moe_layer():
    fits = MoEFits((2e-4, 1e-4, 3e-6), (3e-4, 1e-9), 64, 8, num_layers=4, num_moe_layers=3, bytes_per_token=2048)
    node = StepCostModel((0.002, 2e-5, 0.0, 0.0), (0.004, 1e-2, 1e-7))  # above its experts at every batch
    afd = AFDStepCost.of(node, fits, AFDShape(1, 1), 1)
    for batch, context in ((1, 100), (8, 4000), (32, 32000)):
        hop = fits.hop[0] + fits.hop[1] * batch * 2048
        assert afd.step([], batch, context) == pytest.approx(node.step([], batch, context) + 3 * hop)


def test_micro_batches_ping_pong_the_slower_side_and_reread_the_experts():
    afd = unit(AFDShape(1, 1), 2)
    p = afd.parts(16, 0)
    # one micro-batch: 8 sequences; attention = the node's 8-sequence step less its experts
    active = 128 * (1 - (1 - 8 / 128) ** 8)
    assert p["ffn"] == pytest.approx(1e-4 * active)
    assert p["attention"] == pytest.approx(max(0.001 + 0.0006 * 8 - 1e-4 * active, 0.0))
    assert p["step"] == pytest.approx(2 * max(p["attention"], p["ffn"]) + p["hop"] + min(p["attention"], p["ffn"]))
    # weight-bound experts: two micro-batches read them twice, one reads them once
    assert afd.parts(16, 0)["step"] > unit(AFDShape(1, 1), 1).parts(16, 0)["step"]


def test_ffn_workers_pool_the_attention_workers_tokens():
    # 4 attention workers' tokens on one FFN worker read fewer experts per token than 4 nodes do
    one, four = unit(AFDShape(1, 1), 1).parts(16, 0), unit(AFDShape(4, 1), 1).parts(64, 0)
    assert four["attention"] == pytest.approx(one["attention"])  # each attention worker holds 16
    assert four["ffn"] < 4 * one["ffn"] * 0.6


def test_breakdown_says_where_afd_wins_and_where_the_hop_loses_it():
    node = StepCostModel((0.002, 2e-5, 0.0, 0.0), DECODE)
    win = afd_breakdown(unit(AFDShape(4, 4), 1), node, [64], 0)[0]
    assert win["afd_tok_s_per_node"] > win["colocated_tok_s_per_node"]
    slow_hop = MoEFits(FITS.moe, (0.05, 0.0), 128, 8, 1, 1, 4096.0)
    lose = afd_breakdown(unit(AFDShape(4, 4), 1, slow_hop), node, [64], 0)[0]
    assert lose["hop_ms"] == pytest.approx(50.0)
    assert lose["afd_tok_s_per_node"] < lose["colocated_tok_s_per_node"] / 5


def test_a_unit_holds_its_attention_workers_kv_and_sequences():
    from kvferry.plan.instance import InstanceConfig

    cfg = unit(AFDShape(3, 1), 2).unit_config(InstanceConfig(num_kv_blocks=100, max_num_seqs=16))
    assert (cfg.num_kv_blocks, cfg.max_num_seqs) == (300, 48)


@pytest.mark.parametrize("text", ["2x1", "0+1", "1+", "a+b"])
def test_bad_shapes_name_the_flag(text):
    with pytest.raises(ValueError, match="--afd-shapes"):
        parse_afd_shapes(text)


def test_shapes_parse_and_none_means_no_afd():
    assert parse_afd_shapes("1+1, 2+1,1+1") == [AFDShape(1, 1), AFDShape(2, 1)]
    assert parse_afd_shapes("none") == []


# -- kvferry plan -------------------------------------------------------------------------
PLAN = ["--workload", "random", "--input-len", "64", "--output-len", "32", "--num-requests", "60", "--rate", "40",
        "--slo", "ttft:2000,tpot:100", "--max-num-seqs", "16", "--fast"]


def _plan(tmp_path, profile, *extra):
    out = kvferry("plan", *extra, *PLAN, "--output", str(tmp_path / "plan"))
    assert out.returncode == 0, out.stderr
    return json.loads((tmp_path / "plan.json").read_text()), out.stdout


def test_plan_searches_afd_units_beside_colocated_and_pd_at_equal_cost(tmp_path):
    profile = moe_profile(tmp_path / "moe.json")
    result, text = _plan(tmp_path, profile, "--hardware", f"node={profile}:2", "--gpus", "6", "--equal-cost",
                         "--afd-shapes", "1+1,2+1")
    names = {h["name"]: (h["layout"], h["share"], h["price_per_hour"]) for h in result["hardware"]}
    assert names == {"node": ("tp1pp1", 1.0, 2.0), "node:afd1+1": ("afd1+1", 2.0, 4.0),
                     "node:afd2+1": ("afd2+1", 3.0, 6.0)}
    # equal cost: every candidate is 6 nodes at 12 per hour
    assert result["equal_cost"] and all(c["gpus"] == 6 and c["price_per_hour"] == 12 for c in result["candidates"])
    afd = {(c["kind"], tuple(sorted(c["afd"].items()))) for c in result["candidates"] if c["afd"]}
    assert ("colocated", (("colocated", "afd1+1"),)) in afd and ("colocated", (("colocated", "afd2+1"),)) in afd
    assert ("disaggregated", (("decode", "afd1+1"),)) in afd and ("disaggregated", (("decode", "afd2+1"),)) in afd
    assert not any("prefill" in c["afd"] for c in result["candidates"])  # the decode pool is the one that splits
    assert result["best_colocated"]["afd"] == {} and result["best_disaggregated"]["afd"] == {}
    assert result["best_afd"]["afd"]
    assert "best_afd:" in text and "AFD units (2 micro-batches" in text and "AFD tok/s/node" in text
    breakdown = result["afd_breakdown"]
    assert breakdown["best"] == result["best_afd"]["hardware"][next(iter(result["best_afd"]["afd"]))]
    rows = breakdown["rows"]
    assert rows[0]["unit"] == breakdown["best"] and {r["unit"] for r in rows} == {"node:afd1+1", "node:afd2+1"}
    # each unit's batches up to its attention workers' sequences (16 each)
    assert max(r["batch"] for r in rows if r["unit"] == "node:afd2+1") == 32
    assert all(r["afd_step_ms"] > 0 and r["colocated_step_ms"] > 0 for r in rows)


def test_a_slow_hop_keeps_afd_from_winning(tmp_path):
    profile = moe_profile(tmp_path / "moe.json", hop=(0.05, 0.0))  # 50 ms a layer's round trip
    result, text = _plan(tmp_path, profile, "--hardware", f"node={profile}:1", "--gpus", "4", "--equal-cost",
                         "--afd-shapes", "1+1,3+1")
    assert not result["best"]["afd"]
    best_afd = result["best_afd"]
    assert best_afd["at_target_ms"]["tpot"] is None or best_afd["at_target_ms"]["tpot"] > 50
    assert best_afd["cost_per_million_useful_tokens"] is None or \
        best_afd["cost_per_million_useful_tokens"] > result["best"]["cost_per_million_useful_tokens"]


def test_a_dense_profile_and_afd_shapes_none_have_no_afd(tmp_path):
    dense = write_profile(tmp_path / "dense.json", (0.002, 2e-5, 0, 0), DECODE)
    result, text = _plan(tmp_path, dense, "--profile", str(dense), "--gpus", "3")
    assert "best_afd" not in result and not any(c["afd"] for c in result["candidates"])
    result, _ = _plan(tmp_path, dense, "--profile", str(moe_profile(tmp_path / "moe.json")), "--gpus", "3",
                      "--afd-shapes", "none")
    assert "best_afd" not in result


def test_plan_refuses_bad_afd_flags_in_one_line(tmp_path):
    profile = moe_profile(tmp_path / "moe.json")
    for flag, value in (("--afd-shapes", "2x1"), ("--afd-micro-batches", "0")):
        out = kvferry("plan", "--profile", str(profile), *PLAN, "--gpus", "2", flag, value)
        assert out.returncode == 2 and flag in out.stderr and out.stderr.count("\n") == 1, out.stderr
    out = kvferry("plan", "--profile", str(profile), *PLAN, "--gpus", "3", "--equal-cost", "--afd-shapes", "3+1",
                  "--output", str(tmp_path / "plan"))
    assert out.returncode == 0, out.stderr  # 3C, P/D splits of 3: some placement uses exactly 3


# -- kvferry simulate --afd ---------------------------------------------------------------
SIM = ["simulate", "--workload", "random", "--input-len", "64", "--output-len", "16", "--num-requests", "10",
       "--rate", "1", "--json"]


def test_simulate_runs_the_decode_pool_as_afd_units(tmp_path):
    profile = moe_profile(tmp_path / "moe.json", hop=(0.02, 0.0))

    def tpot(*extra: str) -> float:
        out = kvferry(*SIM, "--profile", str(profile), *extra)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["summary"]["tpot_ms"]["p50"]

    plain = tpot("--config", "prefill:1,decode:1")
    afd = tpot("--config", "prefill:1,decode:1", "--afd", "1+1", "--afd-micro-batches", "1")
    assert afd == pytest.approx(plain + 20.0, abs=2.0)  # one 20 ms hop a layer, one MoE layer
    assert tpot("--config", "colocated:1", "--afd", "2+1") > plain
    dense = write_profile(tmp_path / "dense.json", (0.002, 2e-5, 0, 0), DECODE)
    out = kvferry(*SIM, "--profile", str(dense), "--afd", "1+1")
    assert out.returncode == 2 and "no MoE fits" in out.stderr
    out = kvferry(*SIM, "--profile", str(profile), "--afd", "1+1,2+1")
    assert out.returncode == 2 and "--afd" in out.stderr
