"""The planner knows TP/PP layouts: ``kvferry profile`` fits the step at
each (TP, PP) it is given and ``kvferry plan`` searches them per pool.
Real processes (the CLI, the engine's rank processes), real files."""
from __future__ import annotations

import json

from tests.plan.helpers import write_profile
from tests.plan.test_cli import kvferry
from tests.tiny_models import make_tiny_checkpoint

PREFILL_TERMS = ["1", "new", "new*cached", "new^2"]
DECODE_TERMS = ["1", "batch", "batch*context"]


def test_profile_fits_each_layout_and_skips_what_cannot_run_in_one_line(tmp_path):
    # 4 query heads, 2 KV heads, 2 layers: TP 2 and PP 2 split, TP 3 does not (the engine refuses it);
    # TP 2 x PP 2 and TP 3 x PP 2 need more CPUs than the budget of 3.
    model = make_tiny_checkpoint(tmp_path / "m", arch="llama")
    out_json = tmp_path / "profile.json"
    out = kvferry("profile", "--model", str(model), "--tensor-parallel-sizes", "1,2,3",
                  "--pipeline-parallel-sizes", "1,2", "--threads", "3",
                  "--new-tokens", "16,32", "--cached-tokens", "0,16", "--batch-sizes", "1,2,4",
                  "--context-lens", "16", "--decode-steps", "2", "--repeats", "1", "--kv-cache-memory-gb", "0.02",
                  "--output", str(out_json), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out_json.read_text())
    layouts = {lay["name"]: lay for lay in data["layouts"]}
    assert list(layouts) == ["tp1pp1", "tp1pp2", "tp2pp1"]
    assert (layouts["tp1pp1"]["ranks"], layouts["tp1pp1"]["threads_per_rank"]) == (1, 3)
    assert (layouts["tp2pp1"]["ranks"], layouts["tp2pp1"]["threads_per_rank"]) == (2, 1)
    assert (layouts["tp1pp2"]["ranks"], layouts["tp1pp2"]["threads_per_rank"]) == (2, 1)
    for lay in layouts.values():
        assert lay["prefill"]["fit"]["terms"] == PREFILL_TERMS and len(lay["prefill"]["points"]) == 4
        assert lay["decode"]["fit"]["terms"] == DECODE_TERMS and len(lay["decode"]["points"]) == 3
        assert (tmp_path / f"profile.{lay['name']}.png").exists()
    # the top level keeps the first layout's fits (what older readers read)
    assert data["prefill"]["fit"] == layouts["tp1pp1"]["prefill"]["fit"]
    skipped = {s["name"]: s["reason"] for s in data["skipped_layouts"]}
    assert set(skipped) == {"tp3pp1", "tp2pp2", "tp3pp2"}
    assert "num_attention_heads" in skipped["tp3pp1"] or "divisible" in skipped["tp3pp1"], skipped
    assert "4 ranks need at least 4 CPUs" in skipped["tp2pp2"]
    assert "6 ranks need at least 6 CPUs" in skipped["tp3pp2"]
    said = [line for line in out.stdout.splitlines() if line.startswith("kvferry profile: skipping")]
    assert len(said) == 3 and all("\n" not in s for s in skipped.values())
    assert sum(line.startswith(("tp1pp1 (", "tp1pp2 (", "tp2pp1 (")) for line in out.stdout.splitlines()) == 6


def test_a_served_profile_refuses_layouts_in_one_line():
    out = kvferry("profile", "--url", "http://127.0.0.1:9", "--tensor-parallel-sizes", "1,2")
    assert out.returncode == 2
    assert "--tensor-parallel-sizes" in out.stderr and "served profile" in out.stderr
    assert out.stderr.count("\n") == 1


def _fits(prefill: tuple, decode: tuple) -> dict:
    return {"prefill": {"fit": {"terms": PREFILL_TERMS, "coef": list(prefill)}},
            "decode": {"fit": {"terms": DECODE_TERMS, "coef": list(decode)}}}


def two_layout_profile(path):
    """A GPU profile: TP 2 (two GPUs) prefills 4x as fast as TP 1 and decodes
    no faster, so the prefill pool should pay for TP 2 and the decode pool not."""
    tp1 = {"name": "tp1pp1", "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "ranks": 1,
           **_fits((0.002, 1e-3, 0, 0), (0.004, 1e-4, 0))}
    tp2 = {"name": "tp2pp1", "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "ranks": 2,
           **_fits((0.002, 2.5e-4, 0, 0), (0.004, 1e-4, 0))}
    path.write_text(json.dumps({"device": "cuda", **{k: tp1[k] for k in ("prefill", "decode")},
                                "layouts": [tp1, tp2]}))
    return path


PLAN = ["--workload", "random", "--input-len", "256", "--output-len", "8", "--num-requests", "20", "--rate", "2",
        "--slo", "ttft:150,tpot:50", "--gpus", "4"]


def test_plan_picks_the_cheaper_layout_per_pool_and_says_why(tmp_path):
    profile = two_layout_profile(tmp_path / "p.json")
    out = kvferry("plan", "--hardware", f"gpu={profile}:1", "--colocated-hardware", "none", *PLAN,
                  "--output", str(tmp_path / "plan"))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "plan.json").read_text())
    assert {h["name"]: (h["layout"], h["share"], h["price_per_hour"]) for h in result["hardware"]} == {
        "gpu:tp1pp1": ("tp1pp1", 1.0, 1.0), "gpu:tp2pp1": ("tp2pp1", 2.0, 2.0)}
    choice = result["layout_choice"]
    # TP 1 prefills 256 tokens in 258 ms (over the 150 ms TTFT); TP 2 in 66 ms
    assert choice["prefill"]["chosen"] == "gpu:tp2pp1"
    # both decode alike: TP 1 is half the price
    assert choice["decode"]["chosen"] == "gpu:tp1pp1"
    best = result["best"]
    assert best["layout"] == {"prefill": "tp2pp1", "decode": "tp1pp1"} and best["gpus"] == 3
    assert best["price_per_hour"] == 3.0
    tp1_decode = choice["decode"]["by_hardware"]["gpu:tp1pp1"]["cost_per_million_useful_tokens"]
    tp2_decode = choice["decode"]["by_hardware"]["gpu:tp2pp1"]["cost_per_million_useful_tokens"]
    assert tp1_decode < tp2_decode
    # every candidate fits --gpus in shares: a TP 2 instance counts 2
    assert all(c["gpus"] <= 4 for c in result["candidates"])
    assert any(c["layout"] == {"prefill": "tp2pp1", "decode": "tp2pp1"} and c["gpus"] == 4
               for c in result["candidates"])
    lines = {line.split(":")[0].strip(): line for line in out.stdout.splitlines()}
    assert "gpu:tp2pp1" in lines["prefill layout"] and "gpu:tp1pp1" in lines["prefill layout"]
    assert "per million useful tokens" in lines["decode layout"]
    assert lines["decode layout"].split(": ", 1)[1].startswith("gpu:tp1pp1, of")


def test_a_plain_profile_with_layouts_searches_them_too(tmp_path):
    profile = two_layout_profile(tmp_path / "p.json")
    out = kvferry("plan", "--profile", str(profile), *PLAN, "--output", str(tmp_path / "plan"))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "plan.json").read_text())
    assert [h["name"] for h in result["hardware"]] == ["tp1pp1", "tp2pp1"]
    assert {c["layout"].get("colocated") for c in result["candidates"]} >= {"tp1pp1", "tp2pp1"}
    assert set(result["layout_choice"]) == {"colocated", "prefill", "decode"}
    assert "colocated layout" in out.stdout


def test_a_profile_without_layouts_loads_as_tp1_pp1(tmp_path):
    profile = write_profile(tmp_path / "old.json", (0.002, 1e-5, 0, 0), (0.001, 1e-5, 0))
    out = kvferry("plan", "--profile", str(profile), *PLAN, "--output", str(tmp_path / "plan"))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "plan.json").read_text())
    assert [(h["name"], h["layout"], h["share"]) for h in result["hardware"]] == [("profile", "tp1pp1", 1.0)]
    assert all(set(c["layout"].values()) == {"tp1pp1"} for c in result["candidates"])
    assert "layout_choice" not in result and "layout:" not in out.stdout


def test_simulate_steps_each_pool_by_the_layout_it_is_given(tmp_path):
    profile = two_layout_profile(tmp_path / "p.json")
    sim = ["simulate", "--profile", str(profile), "--workload", "random", "--input-len", "256", "--output-len", "8",
           "--num-requests", "10", "--rate", "1", "--config", "prefill:1,decode:1", "--json"]

    def ttft_p50(*extra: str) -> float:
        out = kvferry(*sim, *extra)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["summary"]["ttft_ms"]["p50"]

    first, tp2 = ttft_p50(), ttft_p50("--layout", "tp2pp1", "--decode-layout", "tp1pp1")
    assert first == ttft_p50("--layout", "tp1pp1")  # the default is the profile's first layout
    assert tp2 < first / 2  # TP 2 prefills 4x as fast (each step also pays a 2 ms intercept)
    out = kvferry(*sim, "--decode-layout", "tp8pp1")
    assert out.returncode == 2
    assert "--decode-layout" in out.stderr and "tp1pp1, tp2pp1" in out.stderr
