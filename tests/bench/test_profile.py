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
    # near the measured batch-1 steps (50 and 52 ms), not a large intercept's nonsense
    assert predict(model, {"batch": 1, "context": 100}) == pytest.approx(0.049, abs=0.002)


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


@pytest.mark.parametrize("args,flag", [(["--cached-tokens", "0,10", "--block-size", "16"], "--cached-tokens"),
                                       (["--idle-gap", "-1"], "--idle-gap"), (["--idle-gap", "nan"], "--idle-gap"),
                                       (["--idle-gap", "inf"], "--idle-gap")])
def test_profile_bad_grid_is_one_line(capsys, args, flag):
    assert main(["profile", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err


# -- the robust fit ---------------------------------------------------------------
DECODE_TRUTH = (0.035, 0.002, 4e-6)  # 35 ms a step, 2 ms a sequence, 4 us per sequence-token of context


def _decode_points(outlier: tuple[int, int] | None = None, factor: float = 1.4) -> list[dict]:
    """The validation's decode grid on the true model, with +-1% of
    alternating scatter, and one point a slow spell moved by ``factor``."""
    points = []
    for i, (context, batch) in enumerate((c, b) for c in (96, 320) for b in (1, 2, 4, 8)):
        t = DECODE_TRUTH[0] + DECODE_TRUTH[1] * batch + DECODE_TRUTH[2] * batch * context
        t *= 1 + 0.01 * (-1) ** i
        if (batch, context) == outlier:
            t *= factor
        points.append({"batch": batch, "context": context, "time_s": t})
    return points


def _true_decode(batch: int, context: int) -> float:
    return DECODE_TRUTH[0] + DECODE_TRUTH[1] * batch + DECODE_TRUTH[2] * batch * context


def test_one_slow_point_barely_moves_the_robust_fit_and_moves_least_squares_a_lot():
    points = _decode_points(outlier=(1, 96))
    model = fit(points, DECODE_TERMS)
    x = np.array([[1, p["batch"], p["batch"] * p["context"]] for p in points])
    plain = np.linalg.lstsq(x, np.array([p["time_s"] for p in points]), rcond=None)[0]
    assert (plain >= 0).all()  # plain least squares is non-negative here: the difference is the loss alone
    assert model["coef"] == pytest.approx(DECODE_TRUTH, rel=0.08)
    assert abs(plain[0] / DECODE_TRUTH[0] - 1) > 0.10  # its intercept absorbs the outlier
    # where the simulated runs decode (batch 1-4, context ~150): within 2% robustly; plainly 7% off at batch 1
    for batch in (1, 2, 4):
        truth = _true_decode(batch, 150)
        assert predict(model, {"batch": batch, "context": 150}) == pytest.approx(truth, rel=0.02)
    assert abs(plain @ [1, 1, 150] / _true_decode(1, 150) - 1) > 0.06
    # the fit says which point it discounted, and how far it sits
    heavy = [w for w, p in zip(model["weights"], points) if (p["batch"], p["context"]) != (1, 96)]
    assert min(heavy) == 1.0 and model["weights"][0] < 0.2
    assert model["rel_residuals"][0] == pytest.approx(0.4 * 1.01, abs=0.03)
    assert model["max_rel_error"] == pytest.approx(model["rel_residuals"][0], abs=1e-4)


@pytest.mark.parametrize("outlier", [(2, 96), (2, 320), (4, 96)])
def test_a_fast_point_is_discounted_too(outlier):
    model = fit(_decode_points(outlier=outlier, factor=0.7), DECODE_TERMS)
    for batch in (1, 2, 4):
        assert predict(model, {"batch": batch, "context": 150}) == pytest.approx(_true_decode(batch, 150), rel=0.03)


def test_the_fit_is_relative_small_prefills_are_not_sacrificed_to_large_ones():
    """A prefill grid from 16 to 320 new tokens whose largest point is 20%
    slow: least squares on absolute times bends the whole line to share out
    that 20 ms miss, which moves a 16-token prefill (4 ms) by more than 10%;
    fitted on relative residuals (and robustly) it stays within 3%."""
    truth = {"1": 0.002, "new": 1.2e-4, "new*cached": 1e-8, "new^2": 2e-7}
    model_truth = {"terms": list(truth), "coef": list(truth.values())}
    points = [{"new": n, "cached": c} for c in (0, 256) for n in (16, 64, 128, 256, 320)]
    for p in points:
        p["time_s"] = predict(model_truth, p) * (1.2 if (p["new"], p["cached"]) == (320, 256) else 1.0)
    model = fit(points, PREFILL_TERMS)
    x = np.array([[1, p["new"], p["new"] * p["cached"], p["new"] ** 2] for p in points])
    plain = np.linalg.lstsq(x, np.array([p["time_s"] for p in points]), rcond=None)[0]
    small = {"new": 16, "cached": 0}
    assert predict(model, small) == pytest.approx(predict(model_truth, small), rel=0.03)
    assert abs(plain @ [1, 16, 0, 256] / predict(model_truth, small) - 1) > 0.10


def test_nonnegative_least_squares_is_exact():
    """Against scipy's NNLS on random problems with negative free solutions
    (the old drop-the-negatives loop could stop at a worse subset)."""
    from scipy.optimize import nnls

    from kvferry.bench.profile import _nonnegative_lstsq

    rng = np.random.default_rng(0)
    for _ in range(200):
        x = rng.uniform(0, 1, (8, 4))
        y = x @ rng.normal(0, 1, 4) + rng.normal(0, 0.1, 8)
        ours, ref = _nonnegative_lstsq(x, y), nnls(x, y)[0]
        assert (ours >= 0).all()
        assert ((y - x @ ours) ** 2).sum() == pytest.approx(((y - x @ ref) ** 2).sum(), rel=1e-7, abs=1e-12)


def test_fit_quality_warns_of_scatter_drift_and_skewed_noise():
    from kvferry.bench.profile import fit_quality

    clean = _decode_points()
    for p in clean:
        p["rounds_s"] = [p["time_s"]] * 3
    prefill = [{"new": n, "cached": 0, "time_s": 0.002 + 1e-4 * n} for n in (16, 64, 128, 256)]
    result = {"prefill": {"points": prefill, "fit": fit(prefill, PREFILL_TERMS)},
              "decode": {"points": clean, "fit": fit(clean, DECODE_TERMS)},
              "step_noise": {"prefill": [0.9, 1.0, 1.1], "decode": [1.0, 1.02]}}
    q = fit_quality(result)
    assert q["ok"] and q["warnings"] == []
    assert q["decode"]["round_trend"] == [1.0, 1.0, 1.0] and q["decode"]["noise_mean"] == pytest.approx(1.01)
    assert q["decode"]["rms_rel_error"] == pytest.approx(0.01, abs=0.003)

    # the server slowed down by 20% over the profile, one point is 40% off, and the noise is skewed
    scattered = _decode_points(outlier=(1, 96))
    for p in scattered:
        p["rounds_s"] = [p["time_s"] * f for f in (0.9, 1.0, 1.1)]
    result["decode"] = {"points": scattered, "fit": fit(scattered, DECODE_TERMS)}
    result["step_noise"]["prefill"] = [1.0, 1.0, 1.6]
    q = fit_quality(result)
    assert not q["ok"]
    text = "\n".join(q["warnings"])
    assert "decode fit: a point is 4" in text and "drifted" in text and "prefill step noise: mean ratio 1.20" in text
    assert q["decode"]["round_trend"] == pytest.approx([0.9, 1.0, 1.1]) and q["decode"]["discounted_points"] == 1
