"""``kvferry profile`` on a tiny MoE model fits the MoE step and the AFD
hop (a second real process over the pipeline's transport), and ``kvferry
plan`` searches AFD units from that very profile. One short profile."""
from __future__ import annotations

import json

from tests.plan.test_cli import kvferry
from tests.tiny_moe_models import make_tiny_moe_checkpoint


def test_profile_of_an_moe_model_fits_the_moe_step_and_the_hop_and_plan_uses_them(tmp_path):
    model = make_tiny_moe_checkpoint(tmp_path, "qwen2_moe_top2")  # 8 experts, top-2, shared expert, 2 layers
    out_json = tmp_path / "moe-profile.json"
    out = kvferry("profile", "--model", str(model), "--threads", "1", "--new-tokens", "16,32",
                  "--cached-tokens", "0,16", "--batch-sizes", "1,2,4", "--context-lens", "16", "--decode-steps", "2",
                  "--repeats", "1", "--kv-cache-memory-gb", "0.02", "--moe-active-experts", "1,8",
                  "--moe-tokens-per-expert", "1,8", "--afd-hop-tokens", "1,64,256", "--output", str(out_json),
                  timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out_json.read_text())
    moe = data["moe"]
    assert moe["fit"]["terms"] == ["1", "experts", "experts*tokens_per_expert"]
    assert (moe["num_experts"], moe["top_k"], moe["num_layers"], moe["num_moe_layers"]) == (8, 2, 2, 2)
    assert moe["shared_expert"] is True and moe["threads"] == 1  # timed at the engine's --threads
    assert [(p["experts"], p["tokens_per_expert"]) for p in moe["points"]] == [(1, 2.0), (1, 8.0), (8, 1.0),
                                                                              (8, 8.0)]
    assert all(p["time_s"] > 0 for p in moe["points"]) and min(moe["fit"]["coef"]) >= 0
    hop = data["afd_hop"]
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[hop["dtype"]]
    assert hop["dtype"] == moe["dtype"] and hop["bytes_per_token"] == hidden * size  # the model's hidden state
    assert [(p["tokens"], p["bytes"]) for p in hop["points"]] == [(t, t * hidden * size) for t in (1, 64, 256)]
    assert all(p["time_s"] > 0 for p in hop["points"]) and "ipc://" in hop["transport"]
    assert "MoE step (per layer) fit:" in out.stdout and "AFD hop (round trip) fit:" in out.stdout
    # a loaded machine may scatter the tiny model's step fits: the plan is told to take them anyway
    plan = kvferry("plan", "--profile", str(out_json), "--allow-poor-fit", "--workload", "random",
                   "--input-len", "32", "--output-len", "8", "--num-requests", "20", "--rate", "2",
                   "--slo", "ttft:5000,tpot:1000", "--gpus", "3", "--afd-shapes", "1+1,2+1", "--fast",
                   "--output", str(tmp_path / "plan"))
    assert plan.returncode == 0, plan.stderr
    result = json.loads((tmp_path / "plan.json").read_text())
    assert {c["afd"].get("colocated") for c in result["candidates"]} >= {"afd1+1", "afd2+1"}
    assert result["best_afd"]["afd"]
