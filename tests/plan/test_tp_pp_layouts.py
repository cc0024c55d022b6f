"""``kvferry plan`` over a profile with a TP x PP layout: colocated
instances may run it (one core of both, docs/parallelism.md), prefill and
decode pools may not (``serve --mode disagg`` refuses a pool of both for
now), and a plan left with no pool at all says so in one line. Real CLI
processes over synthetic profile files."""
from __future__ import annotations

import json

from tests.plan.test_cli import kvferry
from tests.plan.test_layouts import PLAN, _fits


def tp_pp_profile(path, layouts=("tp1pp1", "tp2pp2")):
    """A GPU profile: TP 2 x PP 2 (four GPUs) prefills 8x as fast as TP 1."""
    fits = {"tp1pp1": _fits((0.002, 1e-3, 0, 0), (0.004, 1e-4, 0)),
            "tp2pp2": _fits((0.002, 1.25e-4, 0, 0), (0.004, 1e-4, 0))}
    entries = [{"name": name, "tensor_parallel_size": int(name[2]), "pipeline_parallel_size": int(name[5]),
                "ranks": int(name[2]) * int(name[5]), **fits[name]} for name in layouts]
    path.write_text(json.dumps({"device": "cuda", **{k: entries[0][k] for k in ("prefill", "decode")},
                                "layouts": entries}))
    return path


def test_tp_pp_layouts_serve_colocated_pools_only(tmp_path):
    profile = tp_pp_profile(tmp_path / "p.json")
    out = kvferry("plan", "--hardware", f"gpu={profile}:1", *PLAN[:-1], "8", "--output", str(tmp_path / "plan"))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "plan.json").read_text())
    layouts = [c["layout"] for c in result["candidates"]]
    assert any(lay.get("colocated") == "tp2pp2" for lay in layouts), layouts
    assert not [lay for lay in layouts if "tp2pp2" in (lay.get("prefill"), lay.get("decode"))], layouts
    assert any(lay.get("prefill") == "tp1pp1" for lay in layouts), layouts


def test_a_plan_of_tp_pp_pools_alone_is_refused_in_one_line(tmp_path):
    profile = tp_pp_profile(tmp_path / "p.json", ("tp2pp2",))
    out = kvferry("plan", "--hardware", f"gpu={profile}:1", "--colocated-hardware", "none", *PLAN,
                  "--output", str(tmp_path / "plan"))
    assert out.returncode == 2, out.stderr
    assert "a prefill/decode pool runs TP or PP, not both" in out.stderr and out.stderr.count("\n") == 1
