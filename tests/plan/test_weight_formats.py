"""A profile is per weight format: ``kvferry profile`` records the format its
model ran in (bf16, float32, int8, a GGUF file's type), and ``kvferry plan``
given profiles of two formats of one model on one machine sets each
format's cost per million useful tokens side by side and never pairs a
prefill pool of one format with a decode pool of the other (the decode pool
takes the prefill pool's KV). Real processes, real files: hand-made
profiles for the plan, one short live profile of a tiny Q8_0 GGUF and one
of int8 weights."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.plan.helpers import write_profile, write_trace
from tests.plan.test_cli import kvferry
from tests.plan.test_cost import per_million
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf

# The same model on the same machine: Q4_K_M decodes 2.5x as fast (the step reads its 4-bit bytes),
# prefills a little slower (its tiles are dequantized first).
#   bf16:   1 ms/prompt token (16 ms prefill), 5 ms a decode step  -> a request alone: 116 ms
#   Q4_K_M: 1.25 ms/prompt token (20 ms),      2 ms a decode step  -> a request alone:  60 ms
BF16, Q4 = ((0, 0.001, 0, 0), (0.005, 0, 0)), ((0, 0.00125, 0, 0), (0.002, 0, 0))
SLO = "ttft:100,tpot:12"


def _profile(path, fits, fmt: str | None):
    write_profile(path, *fits)
    data = json.loads(path.read_text())
    if fmt is not None:
        data["weight_format"] = fmt
    path.write_text(json.dumps(data))
    return path


def _plan(tmp_path, hardware: list[str], *extra: str) -> tuple[dict, str]:
    # 10 requests 1 s apart: each alone on any instance, every placement meets the SLO.
    trace = write_trace(tmp_path / "t.jsonl", [(1000 * i, 16, 21, [1000 + i]) for i in range(10)])
    out = kvferry("plan", *hardware, "--trace", str(trace), "--trace-block-size", "16", "--slo", SLO,
                  "--gpus", "3", "--output", str(tmp_path / "plan"), *extra)
    assert out.returncode == 0, out.stderr
    return json.loads((tmp_path / "plan.json").read_text()), out.stdout


@pytest.fixture(scope="module")
def two_formats(tmp_path_factory) -> tuple[list[str], dict, str]:
    """The two formats' --hardware flags, and the plan of the two (one run for the module's tests)."""
    tmp_path = tmp_path_factory.mktemp("two-formats")
    bf16 = _profile(tmp_path / "bf16.json", BF16, "bf16")
    q4 = _profile(tmp_path / "q4.json", Q4, "Q4_K_M")
    hardware = ["--hardware", f"cpu-bf16={bf16}:1.0", "--hardware", f"cpu-q4={q4}:1.0"]
    return hardware, *_plan(tmp_path, hardware)


def test_plan_sets_each_formats_cost_side_by_side(two_formats):
    _, result, text = two_formats
    assert [(h["name"], h["weight_format"]) for h in result["hardware"]] == [("cpu-bf16", "bf16"),
                                                                            ("cpu-q4", "Q4_K_M")]
    choice = result["format_choice"]
    assert list(choice) == ["Q4_K_M", "bf16"]  # the cheaper first
    # one instance of each, 1.0/h: the run spans 9 s plus the last request (60 ms, 116 ms), 210 useful tokens
    assert choice["Q4_K_M"]["placement"] == "1C@cpu-q4"
    assert choice["Q4_K_M"]["cost_per_million_useful_tokens"] == pytest.approx(per_million(1.0, 9.060, 210))
    assert choice["bf16"]["placement"] == "1C@cpu-bf16"
    assert choice["bf16"]["cost_per_million_useful_tokens"] == pytest.approx(per_million(1.0, 9.116, 210))
    assert result["best"]["weight_format"] == "Q4_K_M"
    assert "weight formats: each format's best placement" in text
    lines = [line.strip() for line in text.splitlines()]
    q4_cost = choice["Q4_K_M"]["cost_per_million_useful_tokens"]
    bf16_cost = choice["bf16"]["cost_per_million_useful_tokens"]
    assert f"Q4_K_M: {q4_cost:.4g} per million useful tokens at its best (1C@cpu-q4, 100.0% within SLO)" in lines
    assert f"bf16: {bf16_cost:.4g} per million useful tokens at its best (1C@cpu-bf16, 100.0% within SLO)" in lines
    assert "cpu-q4 (Q4_K_M, 1/h," in text


def test_a_prefill_pool_never_pairs_with_a_decode_pool_of_another_format(tmp_path, two_formats):
    hardware, result, _ = two_formats
    pairs = {(c["hardware"]["prefill"], c["hardware"]["decode"]) for c in result["candidates"]
             if c["kind"] == "disaggregated"}
    assert pairs == {("cpu-bf16", "cpu-bf16"), ("cpu-q4", "cpu-q4")}
    assert all(not c["mixed_hardware"] for c in result["candidates"])
    # Only across formats: one's prefill, the other's decode is no placement at all.
    out = kvferry("plan", *hardware, "--prefill-hardware", "cpu-bf16", "--decode-hardware", "cpu-q4",
                  "--colocated-hardware", "none", "--workload", "random", "--slo", SLO, "--gpus", "2",
                  "--output", str(tmp_path / "none"))
    assert out.returncode == 2
    err = out.stderr.strip()
    assert "\n" not in err and "no prefill hardware has a decode hardware of its weight format" in err
    assert "cpu-bf16 bf16" in err and "cpu-q4 Q4_K_M" in err


def test_profiles_that_name_no_format_plan_as_before(tmp_path):
    a = _profile(tmp_path / "a.json", BF16, None)
    b = _profile(tmp_path / "b.json", Q4, None)
    result, text = _plan(tmp_path, ["--hardware", f"a={a}:1.0", "--hardware", f"b={b}:1.0"])
    assert "format_choice" not in result and "weight formats" not in text
    assert any(c["mixed_hardware"] for c in result["candidates"])  # pools of two hardware still pair


def test_a_live_profile_records_the_weight_format(tmp_path):
    """One short in-process profile of a tiny Q8_0 GGUF (served in its
    blocks) and one of the float checkpoint with --quantization int8."""
    folder = make_tiny_checkpoint(tmp_path / "m", arch="llama")
    gguf = write_tiny_gguf(folder, tmp_path / "tiny-q8.gguf", qtype="Q8_0")
    grid = ["--new-tokens", "16,32", "--cached-tokens", "0,16", "--batch-sizes", "1,2,4", "--context-lens", "16",
            "--decode-steps", "2", "--repeats", "1", "--kv-cache-memory-gb", "0.02", "--threads", "1"]
    models = {"q8": ["--model", str(gguf)], "int8": ["--model", str(folder), "--quantization", "int8"]}
    # Both at once (one thread each): two processes, one core each.
    with ThreadPoolExecutor(2) as pool:
        outs = dict(zip(models, pool.map(
            lambda name: kvferry("profile", *models[name], *grid, "--output", str(tmp_path / f"{name}.json"),
                                 timeout=300), models)))
    formats = {}
    for name, out in outs.items():
        assert out.returncode == 0, out.stderr[-3000:]
        data = json.loads((tmp_path / f"{name}.json").read_text())
        formats[name] = (data["weight_format"], data["layouts"][0]["weight_format"])
    assert formats == {"q8": ("Q8_0", "Q8_0"), "int8": ("int8", "int8")}
    plan, text = _plan(tmp_path, ["--hardware", f"q8={tmp_path / 'q8.json'}:1.0",
                                  "--hardware", f"int8={tmp_path / 'int8.json'}:1.0"], "--allow-poor-fit")
    assert set(plan["format_choice"]) == {"Q8_0", "int8"}


def test_weight_format_flags_are_refused_where_they_cannot_apply(tmp_path):
    argvs = [("--url", "http://127.0.0.1:9", "--quantization", "int8"),
             ("--weight-format", "bf16", "--output", str(tmp_path / "p.json")), ("--quantization", "awq")]
    with ThreadPoolExecutor(len(argvs)) as pool:  # three refusals at once: each is mostly its imports
        served, local, bad = pool.map(lambda argv: kvferry("profile", *argv), argvs)
    assert served.returncode == 2 and "--weight-format" in served.stderr
    assert local.returncode == 2 and "reads it from the loaded model" in local.stderr
    assert bad.returncode == 2 and "gguf" in bad.stderr and "int8" in bad.stderr


def test_a_layout_of_another_format_is_another_format(tmp_path):
    """A .gguf profiled at TP 1 and TP 2: its blocks at TP 1, expanded to
    float over the ranks. The two layouts never share a prefill/decode pair."""
    from tests.plan.test_layouts import PLAN, two_layout_profile

    path = two_layout_profile(tmp_path / "p.json")
    data = json.loads(path.read_text())
    data["weight_format"] = "Q4_K_M"
    data["layouts"][0]["weight_format"], data["layouts"][1]["weight_format"] = "Q4_K_M", "bf16"
    path.write_text(json.dumps(data))
    out = kvferry("plan", "--hardware", f"gpu={path}:1", *PLAN, "--output", str(tmp_path / "plan"))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "plan.json").read_text())
    assert {h["name"]: h["weight_format"] for h in result["hardware"]} == {"gpu:tp1pp1": "Q4_K_M",
                                                                          "gpu:tp2pp1": "bf16"}
    assert {tuple(c["layout"].values()) for c in result["candidates"] if c["kind"] == "disaggregated"} == {
        ("tp1pp1", "tp1pp1"), ("tp2pp1", "tp2pp1")}
    assert set(result["format_choice"]) == {"Q4_K_M", "bf16"}
