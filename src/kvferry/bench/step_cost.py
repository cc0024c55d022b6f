"""The step-cost model, in one place: the terms a step's time is fitted
over, the robust fit itself, how far to trust a fit, and the formula that
turns fitted coefficients into one step's seconds.

``kvferry profile`` (``bench/profile.py``, ``bench/profile_served.py``)
measures points and fits them here; the simulator and planner
(``plan/latency.py`` ``StepCostModel``) predict with ``step_seconds``. The
model lives below both so that ``plan/`` imports ``bench/`` and never the
other way round.

A step runs prefill chunks and decodes together (chunked prefill)::

    t = a_pre * [any prefill] + sum over chunks (b * new + c * new * cached + d * new^2)
      + a_dec * [any decode] + b_dec * batch + c_dec * sum(context)
      + [both] * (m_1 + m_batch * batch + m_new * sum(new))
"""
from __future__ import annotations

import statistics
import sys
from itertools import combinations

import numpy as np

PREFILL_TERMS = ("1", "new", "new*cached", "new^2")
DECODE_TERMS = ("1", "batch", "batch*context")
# A mixed step (prefill chunks and decodes in one forward pass) costs the two
# fits' sum plus this: ``new`` is the step's prefill tokens, ``batch`` its decodes.
MIXED_TERMS = ("1", "batch", "new")


# Huber's tuning constant: 95% efficiency on Gaussian residuals; a residual
# beyond HUBER_K robust standard deviations counts as HUBER_K * scale / |r| of a point.
HUBER_K = 1.345
# Floor of the robust residual scale, relative to the times fitted: points
# within about this of the fit are never downweighted (an exact grid would
# otherwise make every small residual an "outlier").
_MIN_REL_SCALE = 0.02


def fit(points: list[dict], terms: tuple[str, ...], relative: bool = True) -> dict:
    """Robust, non-negative fit of ``time_s`` over ``terms`` (seconds per unit
    of each term): iteratively reweighted least squares with Huber weights,
    each coefficient >= 0.

    ``relative`` (the step-time fits): each point's residual counts relative
    to its own time, so a 10 ms point and a 300 ms one are fitted to the same
    percentage rather than the small ones being left to absorb what the large
    ones' absolute error allows; the simulator's errors are relative too.
    Huber weights bound what one point can pull: a point that a slow spell of
    the machine (or a fast one) moved far from the rest weighs
    ``HUBER_K * scale / |residual|`` of a normal point, ``scale`` being the
    residuals' robust spread (1.4826 * median |residual|, at least 2%),
    taken from a least-absolute-deviations start (a least-squares start's
    residuals are inflated by the very points it should discount).
    Plain least squares lets such a point move every coefficient; with a
    handful of points (8 decode points, 3 terms) that is the whole fit.

    Returns the coefficients, R^2 (of the plain residuals: a decode fit's
    is low whenever batch barely matters, so it is no quality measure on its
    own), each point's prediction, relative residual and final weight
    (``weights`` < 1: a point the fit discounted), and ``rms_rel_error`` /
    ``max_rel_error`` over the points (see ``fit_quality``)."""
    x = np.array([_term_values(p, terms) for p in points], dtype=float)  # [num_points, num_terms]
    y = np.array([p["time_s"] for p in points], dtype=float)             # [num_points]
    if relative:
        # each point's own time (floored: a point the overhead subtraction clamped to ~0 must not dominate)
        denom = np.maximum(np.abs(y), max(0.05 * float(np.median(np.abs(y))), 1e-6))
        min_scale = _MIN_REL_SCALE
    else:  # e.g. the mixed fit's extras: near zero or negative, no scale of their own
        denom = np.ones_like(y)
        min_scale = max(_MIN_REL_SCALE * float(np.median(np.abs(y))), 1e-6)

    def reweighted(coef, weight_of, rounds: int):
        """Weighted non-negative least squares, reweighted from the residuals until it settles."""
        for _ in range(rounds):
            sw = np.sqrt(weight_of((y - x @ coef) / denom)) / denom
            new = _nonnegative_lstsq(x * sw[:, None], y * sw)
            if np.allclose(new, coef, rtol=1e-7, atol=1e-12):
                return new
            coef = new
        return coef

    # 1. least absolute (relative) deviations: a start that outliers have not pulled yet
    coef = reweighted(_nonnegative_lstsq(x / denom[:, None], y / denom),
                      lambda r: 1.0 / np.maximum(np.abs(r), 0.1 * min_scale), 100)
    # 2. Huber from there, at the start's robust residual scale
    r = (y - x @ coef) / denom
    cut = HUBER_K * max(1.4826 * float(np.median(np.abs(r))), min_scale)

    def huber(r):
        return np.minimum(1.0, cut / np.maximum(np.abs(r), 1e-300))

    coef = reweighted(coef, huber, 50)
    weights = huber((y - x @ coef) / denom)
    pred = x @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    rel = [float((t - q) / q) if q > 0 else None for t, q in zip(y, pred)]
    known = [abs(r) for r in rel if r is not None]
    return {"terms": list(terms), "coef": [float(c) for c in coef], "r2": r2, "predicted_s": pred.tolist(),
            "method": "huber-irls-relative" if relative else "huber-irls",
            "rel_residuals": [None if r is None else round(r, 4) for r in rel],
            "weights": [round(float(w), 4) for w in weights],
            "rms_rel_error": float(np.sqrt(np.mean(np.square(known)))) if known else None,
            "max_rel_error": max(known) if known else None}


# What fit_quality warns about (the simulator's target is 10% error).
FIT_RMS_WARN = 0.10     # a fit's points further than this (rms, relative) from it
# A poor fit (``poor_fits``: simulate and plan refuse the profile without
# --allow-poor-fit): R^2 under POOR_R2 with its points more than POOR_RMS
# (rms, relative) from it. R^2 alone would flag a good decode fit whose
# batch size barely matters (little variance to explain, so noise of a few
# percent pulls R^2 down); the scatter condition keeps those.
POOR_R2 = 0.9
POOR_RMS = 0.05
POINT_WARN = 0.25       # one point further than this from its fit
DRIFT_WARN = 0.10       # decode rounds whose typical step differs by more than this
NOISE_MEAN_WARN = 1.15  # step noise whose mean ratio is this far above its fit


def fit_quality(result: dict) -> dict:
    """How far to trust a profile (``quality`` in its JSON): per fit, R^2,
    the rms and largest relative distance of its points from it and how many
    points it discounted (Huber weight < 0.5); for a served profile, the
    decode rounds' trend (each round's median over the points of its time
    over the point's median: a server whose speed drifted during the profile
    shows rounds apart) and each step noise's mean ratio (what the simulator
    multiplies the fit by on average). ``warnings`` lists what crosses the
    thresholds above (``poor_fits`` among them); ``ok`` is True when none
    does. R^2 alone warns of nothing: a decode fit's is low whenever batch
    size barely matters."""
    quality: dict = {"warnings": []}
    warn = quality["warnings"].append
    for kind in ("prefill", "decode"):
        f = result[kind]["fit"]
        q = {k: f.get(k) for k in ("r2", "rms_rel_error", "max_rel_error")}
        q["discounted_points"] = sum(1 for w in f.get("weights", ()) if w < 0.5)
        quality[kind] = q
        if (q["rms_rel_error"] or 0) > FIT_RMS_WARN:
            warn(f"{kind} fit: its points are {100 * q['rms_rel_error']:.0f}% (rms) from it "
                 f"(over {100 * FIT_RMS_WARN:.0f}%): the step times scatter")
        if (q["max_rel_error"] or 0) > POINT_WARN:
            warn(f"{kind} fit: a point is {100 * q['max_rel_error']:.0f}% from it (over {100 * POINT_WARN:.0f}%)")
    for line in poor_fits(result):
        warn(line)
    rounds = [p["rounds_s"] for p in result["decode"]["points"] if len(p.get("rounds_s", ())) > 1]
    if rounds and len({len(r) for r in rounds}) == 1:
        trend = [statistics.median(r[i] / statistics.median(r) for r in rounds) for i in range(len(rounds[0]))]
        quality["decode"]["round_trend"] = [round(t, 3) for t in trend]
        if max(trend) - min(trend) > DRIFT_WARN:
            warn(f"decode rounds: the typical step went {' -> '.join(f'{t:.2f}' for t in trend)} of its median "
                 f"over the profile (more than {100 * DRIFT_WARN:.0f}% apart): the server's speed drifted")
    noise = result.get("step_noise") or {}
    for kind in ("prefill", "decode"):
        if ratios := noise.get(kind):
            mean = sum(ratios) / len(ratios)
            quality[kind]["noise_mean"] = round(mean, 3)
            if mean > NOISE_MEAN_WARN:
                warn(f"{kind} step noise: mean ratio {mean:.2f} (over {NOISE_MEAN_WARN:.2f}): simulated {kind} "
                     f"steps take {100 * (mean - 1):.0f}% longer than the fit on average")
    quality["ok"] = not quality["warnings"]
    return quality


def poor_fits(result: dict) -> list[str]:
    """One line per poor step-time fit of a profile (its ``prefill`` and
    ``decode`` fits; see POOR_R2), naming the fit and what to do. A fit
    without R^2 (a hand-written profile) is taken as it is."""
    lines = []
    for kind in ("prefill", "decode"):
        f = (result.get(kind) or {}).get("fit") or {}
        r2, rms = f.get("r2"), f.get("rms_rel_error")
        if r2 is None or r2 >= POOR_R2 or (rms is not None and rms <= POOR_RMS):
            continue
        scatter = f", its points {100 * rms:.0f}% (rms) from it" if rms is not None else ""
        lines.append(f"{kind} fit is poor (R² {r2:.2f} < {POOR_R2}{scatter}): the machine was busy; "
                     "rerun on a quiet machine")
    return lines


def warn_quality(quality: dict) -> None:
    """What ``fit_quality`` warns about, on stderr, one line each."""
    for line in quality["warnings"]:
        print(f"kvferry profile: WARNING: {line}", file=sys.stderr, flush=True)


def fit_mixed(points: list[dict], prefill_fit: dict, decode_fit: dict) -> dict:
    """What a mixed step costs beyond the sum of the prefill and decode fits
    (as the simulator adds them: one intercept, the larger), fitted over
    ``MIXED_TERMS``: each point (keys new, cached, batch, context, time_s)
    keeps that sum as ``sum_s`` and the rest as ``extra_s``. Non-negative: a
    mixed step never costs less than its parts' fits say."""
    prefill, decode = tuple(prefill_fit["coef"]), tuple(decode_fit["coef"])
    extra = []
    for p in points:
        p["sum_s"] = step_seconds(prefill, decode, _NO_MIXED, [(p["new"], p["cached"])], p["batch"],
                                  p["batch"] * p["context"])
        p["extra_s"] = p["time_s"] - p["sum_s"]
        extra.append({"new": p["new"], "batch": p["batch"], "time_s": p["extra_s"]})
    if not extra:
        return {"terms": list(MIXED_TERMS), "coef": [0.0] * len(MIXED_TERMS), "r2": None, "predicted_s": [],
                "method": "none"}
    return fit(extra, MIXED_TERMS, relative=False)


def _nonnegative_lstsq(x, y):
    """Least squares with every coefficient >= 0: each term is a cost, and on
    a noisy (shared) machine a free fit trades a negative slope for a large
    intercept, which predicts nonsense off the grid. Exact for the few terms
    fitted here: the best of the unconstrained fits over every subset of
    terms whose coefficients all come out >= 0 (the others held at 0)."""

    n = x.shape[1]
    best, best_sse = np.zeros(n), float((y ** 2).sum())
    for size in range(1, n + 1):
        for active in combinations(range(n), size):
            sub, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            if (sub < 0).any():
                continue
            coef = np.zeros(n)
            coef[list(active)] = sub
            sse = float(((y - x @ coef) ** 2).sum())
            if sse < best_sse - 1e-15 * max(best_sse, 1e-300):
                best, best_sse = coef, sse
    return best


def _term_values(p: dict, terms) -> list[float]:
    new, cached, batch, context = (float(p.get(k, 0)) for k in ("new", "cached", "batch", "context"))
    values = {"1": 1.0, "new": new, "new*cached": new * cached, "new^2": new * new,
              "batch": batch, "batch*context": batch * context}
    # the MoE step's and the AFD hop's fits (bench/profile_moe.py)
    experts, per_expert = float(p.get("experts", 0)), float(p.get("tokens_per_expert", 0))
    values.update({"experts": experts, "experts*tokens_per_expert": experts * per_expert,
                   "bytes": float(p.get("bytes", 0))})
    return [values[t] for t in terms]


def predict(model: dict, p: dict) -> float:
    """A fitted model's time (s) at one point (keys: new, cached or batch, context)."""
    return sum(c * v for c, v in zip(model["coef"], _term_values(p, model["terms"])))


_NO_MIXED = (0.0, 0.0, 0.0)


def prefill_chunk_seconds(prefill: tuple[float, ...], new: int, cached: int) -> float:
    """Variable cost of one prefill chunk (no intercept) under the
    ``PREFILL_TERMS`` coefficients ``prefill``."""
    _, b, c, d = prefill
    return max(b * new + c * new * cached + d * new * new, 0.0)


def step_seconds(prefill: tuple[float, ...], decode: tuple[float, ...], mixed: tuple[float, ...],
                 chunks: list[tuple[int, int]], decode_batch: int, decode_context: int) -> float:
    """One step: prefill ``chunks`` of (new, cached) tokens plus ``decode_batch``
    decodes whose contexts sum to ``decode_context``, under the coefficients
    of ``PREFILL_TERMS``, ``DECODE_TERMS`` and ``MIXED_TERMS``. The two
    intercepts are fixed per-step costs (launch, sampling); a mixed step
    pays the larger one only, since it is one forward pass, plus ``mixed``."""
    t = 0.0
    base = 0.0
    if chunks:
        base = prefill[0]
        t += sum(prefill_chunk_seconds(prefill, n, c) for n, c in chunks)
    if decode_batch:
        base = max(base, decode[0])
        t += decode[1] * decode_batch + decode[2] * decode_context
    if chunks and decode_batch:
        t += mixed[0] + mixed[1] * decode_batch + mixed[2] * sum(n for n, _ in chunks)
    return max(base + t, 1e-9)


def layouts_of(data: dict) -> list[dict]:
    """A profile's parallel layouts (``bench/profile_layouts.py``): its
    ``layouts`` list, or (a profile written before layouts, or a served one)
    its top-level fits as TP 1 PP 1."""
    layouts = data.get("layouts")
    if layouts:
        return list(layouts)
    threads = data.get("threads")
    return [{"name": "tp1pp1", "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "ranks": 1,
             "threads_per_rank": threads, "cpus": threads, **{k: data[k] for k in ("prefill", "decode")},
             **({"quality": data["quality"]} if "quality" in data else {})}]
