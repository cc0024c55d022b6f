"""``kvferry profile`` on a tiny random-weight checkpoint: the grid is
measured (with real prefix-cache hits), fitted, saved and plotted."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvferry.bench.profile import DECODE_TERMS, PREFILL_TERMS, fit, predict
from kvferry.cli import main
from tests.tiny_models import make_tiny_checkpoint


def test_fit_recovers_a_known_linear_model():
    truth = {"1": 0.002, "new": 1e-5, "new*cached": 2e-8, "new^2": 3e-9}
    points = [{"new": n, "cached": c} for n in (16, 64, 256) for c in (0, 128, 512)]
    for p in points:
        p["time_s"] = predict({"terms": list(truth), "coef": list(truth.values())}, p)
    model = fit(points, PREFILL_TERMS)
    assert model["r2"] == pytest.approx(1.0)
    assert model["coef"] == pytest.approx([truth[t] for t in PREFILL_TERMS], rel=1e-6)
    assert predict(model, {"new": 100, "cached": 50}) == pytest.approx(
        0.002 + 1e-3 + 2e-8 * 5000 + 3e-9 * 1e4)


def test_fit_keeps_every_cost_non_negative():
    """Noise that makes a larger batch look faster must not give a negative
    per-sequence cost (and a huge intercept): that term is dropped."""
    points = [{"batch": b, "context": c, "time_s": t}
              for b, c, t in ((1, 100, 0.050), (4, 100, 0.044), (1, 300, 0.052), (4, 300, 0.060), (8, 100, 0.047))]
    model = fit(points, DECODE_TERMS)
    free = np.linalg.lstsq(np.array([[1, p["batch"], p["batch"] * p["context"]] for p in points]),
                           np.array([p["time_s"] for p in points]), rcond=None)[0]
    assert free[1] < 0  # the case is one a free fit gets wrong
    assert model["coef"][1] == 0 and model["coef"][0] > 0 and model["coef"][2] > 0
    assert predict(model, {"batch": 1, "context": 100}) == pytest.approx(0.047, abs=0.001)


def test_profile_tiny_model(tmp_path, capsys, request):
    import torch

    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))  # --threads changes this process
    ckpt = make_tiny_checkpoint(tmp_path, "llama")
    out = tmp_path / "prof" / "tiny.json"
    code = main(["profile", "--model", str(ckpt), "--new-tokens", "8,24", "--cached-tokens", "0,32",
                 "--batch-sizes", "1,2,4", "--context-lens", "16", "--decode-steps", "2", "--repeats", "1",
                 "--threads", "1", "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["threads"] == 1
    pre, dec = data["prefill"], data["decode"]
    assert [(p["new"], p["cached"]) for p in pre["points"]] == [(8, 0), (24, 0), (8, 32), (24, 32)]
    # the cached part really came from the prefix cache
    assert [p["num_cached_tokens"] for p in pre["points"]] == [0, 0, 32, 32]
    assert [p["batch"] for p in dec["points"]] == [1, 2, 4] and all(p["time_s"] > 0 for p in dec["points"])
    assert pre["fit"]["terms"] == list(PREFILL_TERMS) and dec["fit"]["terms"] == list(DECODE_TERMS)
    for part in (pre, dec):
        assert part["fit"]["predicted_s"] == pytest.approx([predict(part["fit"], p) for p in part["points"]])
    png = out.with_suffix(".png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 20_000


def test_profile_bad_grid_is_one_line(capsys):
    assert main(["profile", "--cached-tokens", "0,10", "--block-size", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cached-tokens" in err
