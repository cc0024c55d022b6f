"""``kvferry plan`` over a profile with a TP x PP layout: every pool,
colocated, prefill and decode, may run it (``serve --mode disagg`` takes a
pool of both, docs/parallelism.md), so a plan of that layout alone places
prefill and decode pools on it. Real CLI processes over synthetic profile
files."""
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


def test_tp_pp_layouts_serve_every_pool(tmp_path):
    profile = tp_pp_profile(tmp_path / "p.json")
    out = kvferry("plan", "--hardware", f"gpu={profile}:1", *PLAN[:-1], "8", "--output", str(tmp_path / "plan"))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "plan.json").read_text())
    layouts = [c["layout"] for c in result["candidates"]]
    assert any(lay.get("colocated") == "tp2pp2" for lay in layouts), layouts
    assert any("tp2pp2" in (lay.get("prefill"), lay.get("decode")) for lay in layouts), layouts
    assert any(lay.get("prefill") == "tp1pp1" for lay in layouts), layouts


def test_a_plan_of_tp_pp_pools_alone_places_prefill_and_decode_on_them(tmp_path):
    profile = tp_pp_profile(tmp_path / "p.json", ("tp2pp2",))
    out = kvferry("plan", "--hardware", f"gpu={profile}:1", "--colocated-hardware", "none", *PLAN,
                  "--output", str(tmp_path / "plan"))
    assert out.returncode == 0, out.stderr
    layouts = [c["layout"] for c in json.loads((tmp_path / "plan.json").read_text())["candidates"]]
    assert layouts and all((lay.get("prefill"), lay.get("decode")) == ("tp2pp2", "tp2pp2") for lay in layouts), \
        layouts
