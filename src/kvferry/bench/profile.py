"""``kvferry profile``: how long a prefill and a decode step take on this
machine, measured on the in-process engine and fitted with small linear
models (the inputs a simulator or planner needs).

- Prefill of ``new`` tokens after ``cached`` tokens already in the prefix
  cache (one engine step, max_num_batched_tokens large enough not to chunk):
      t = a + b * new + c * new * cached + d * new^2
  (linear work per new token; attention of each new token over the cached
  ones and over the other new ones).
- A decode step of ``batch`` sequences at context ``context`` each:
      t = a + b * batch + c * batch * context
  (per-sequence work; KV read over every sequence's context).

Prompts are random token ids, fresh per point so that nothing is cached by
accident; the cached part is prefilled first by a one-token request, and the
engine's ``num_cached_tokens`` confirms the hit.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

PREFILL_TERMS = ("1", "new", "new*cached", "new^2")
DECODE_TERMS = ("1", "batch", "batch*context")
# A mixed step (prefill chunks and decodes in one forward pass) costs the two
# fits' sum plus this: ``new`` is the step's prefill tokens, ``batch`` its decodes.
MIXED_TERMS = ("1", "batch", "new")


@dataclass(slots=True)
class ProfileGrid:
    new_tokens: list[int]
    cached_tokens: list[int]
    batch_sizes: list[int]
    context_lens: list[int]
    decode_steps: int = 8
    repeats: int = 3
    seed: int = 0


class _Prompts:
    """Fresh random token ids (special tokens are the low ids in the usual vocabularies)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.lo, self.hi = min(256, vocab_size // 4), vocab_size - 1

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randint(self.lo, self.hi) for _ in range(n)]


def _run_to_end(engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


def measure_prefill(engine, prompts: _Prompts, new: int, cached: int, repeats: int) -> dict:
    from kvferry.sampling import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times, hits = [], []
    for i in range(repeats):
        prefix = prompts(cached)
        if cached:
            engine.add_request(f"warm-{new}-{cached}-{i}", prefix, one)
            _run_to_end(engine)
        engine.add_request(f"prefill-{new}-{cached}-{i}", prefix + prompts(new), one)
        start = time.perf_counter()
        outs = engine.step()  # the whole prompt in one step (no chunking: see max_num_batched_tokens)
        times.append(time.perf_counter() - start)
        outs.extend(_run_to_end(engine))
        hits.append(outs[-1].num_cached_tokens)
    return {"new": new, "cached": cached, "time_s": statistics.median(times), "num_cached_tokens": min(hits)}


def measure_decode(engine, prompts: _Prompts, batch: int, context: int, steps: int) -> dict:
    from kvferry.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    ids = [f"decode-{batch}-{context}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, prompts(context), params)
    started: set[str] = set()
    while len(started) < batch:  # prefill every sequence first
        started.update(o.request_id for o in engine.step())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_request(ids)
    return {"batch": batch, "context": context, "time_s": statistics.median(times)}


def fit(points: list[dict], terms: tuple[str, ...]) -> dict:
    """Non-negative least-squares coefficients (seconds per unit of each
    term), R^2 and each point's prediction."""
    import numpy as np

    x = np.array([_term_values(p, terms) for p in points])                 # [num_points, num_terms]
    y = np.array([p["time_s"] for p in points])            # [num_points]
    coef = _nonnegative_lstsq(x, y)
    pred = x @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return {"terms": list(terms), "coef": [float(c) for c in coef], "r2": r2, "predicted_s": pred.tolist()}


def fit_mixed(points: list[dict], prefill_fit: dict, decode_fit: dict) -> dict:
    """What a mixed step costs beyond the sum of the prefill and decode fits
    (as the simulator adds them: one intercept, the larger), fitted over
    ``MIXED_TERMS``: each point (keys new, cached, batch, context, time_s)
    keeps that sum as ``sum_s`` and the rest as ``extra_s``. Non-negative: a
    mixed step never costs less than its parts' fits say."""
    from kvferry.plan.latency import StepCostModel

    parts = StepCostModel(tuple(prefill_fit["coef"]), tuple(decode_fit["coef"]))
    extra = []
    for p in points:
        p["sum_s"] = parts.step([(p["new"], p["cached"])], p["batch"], p["batch"] * p["context"])
        p["extra_s"] = p["time_s"] - p["sum_s"]
        extra.append({"new": p["new"], "batch": p["batch"], "time_s": p["extra_s"]})
    if not extra:
        return {"terms": list(MIXED_TERMS), "coef": [0.0] * len(MIXED_TERMS), "r2": None, "predicted_s": []}
    return fit(extra, MIXED_TERMS)


def _nonnegative_lstsq(x, y):
    """Least squares with every coefficient >= 0: each term is a cost, and on
    a noisy (shared) machine a free fit trades a negative slope for a large
    intercept, which predicts nonsense off the grid. Terms whose coefficient
    comes out negative are dropped and the rest refitted (few terms: this
    active-set loop ends in at most ``num_terms`` rounds)."""
    import numpy as np

    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sub, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sub >= 0).all():
            coef[active] = sub
            break
        active = [a for a, c in zip(active, sub) if c >= 0] if (sub >= 0).any() else []
    return coef


def _term_values(p: dict, terms) -> list[float]:
    new, cached, batch, context = (float(p.get(k, 0)) for k in ("new", "cached", "batch", "context"))
    values = {"1": 1.0, "new": new, "new*cached": new * cached, "new^2": new * new,
              "batch": batch, "batch*context": batch * context}
    return [values[t] for t in terms]


def predict(model: dict, p: dict) -> float:
    """A fitted model's time (s) at one point (keys: new, cached or batch, context)."""
    return sum(c * v for c, v in zip(model["coef"], _term_values(p, model["terms"])))


def run_profile(engine, grid: ProfileGrid, on_point=lambda kind, p: None) -> dict:
    prompts = _Prompts(engine.core.loaded.config.vocab_size, grid.seed)
    # warm-up: first calls build kernels and allocate
    measure_prefill(engine, prompts, min(grid.new_tokens), 0, 1)
    prefill = []
    for cached in grid.cached_tokens:
        for new in grid.new_tokens:
            prefill.append(measure_prefill(engine, prompts, new, cached, grid.repeats))
            on_point("prefill", prefill[-1])
    decode = []
    for context in grid.context_lens:
        for batch in grid.batch_sizes:
            decode.append(measure_decode(engine, prompts, batch, context, grid.decode_steps))
            on_point("decode", decode[-1])
    return {"prefill": {"points": prefill, "fit": fit(prefill, PREFILL_TERMS)},
            "decode": {"points": decode, "fit": fit(decode, DECODE_TERMS)}}


def _plot_fit(ax, plt, part: dict, series_key: str, x_key: str, label: str, xlabel: str, ylabel: str,
              name: str) -> None:
    """Measured points and fitted lines of one fit, a series per value of ``series_key``."""
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, value in enumerate(sorted({p[series_key] for p in part["points"]})):
        pts = sorted((p for p in part["points"] if p[series_key] == value), key=lambda p: p[x_key])
        c = colors[i % len(colors)]
        ax.plot([p[x_key] for p in pts], [1000 * p["time_s"] for p in pts], "o", color=c)
        ax.plot([p[x_key] for p in pts], [1000 * predict(part["fit"], p) for p in pts], "-", color=c,
                label=label.format(value))
    ax.set(xlabel=xlabel, ylabel=ylabel,
           title=f"{name}: points measured, lines fitted (R² {part['fit']['r2']:.3f})")


def plot_profile(result: dict, title: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    _plot_fit(left, plt, result["prefill"], "cached", "new", "{} cached", "new (prefilled) tokens",
              "prefill step (ms)", "Prefill")
    _plot_fit(right, plt, result["decode"], "context", "batch", "context {}", "batch size (sequences)",
              "decode step (ms)", "Decode")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
        ax.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
