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

Both are fitted robustly (``fit``: Huber-weighted least squares on relative
residuals, every coefficient >= 0), and ``fit_quality`` reports how well.

Prompts are random token ids, fresh per point so that nothing is cached by
accident; the cached part is prefilled first by a one-token request, and the
engine's ``num_cached_tokens`` confirms the hit.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

# The model and its fit live in bench/step_cost.py; re-exported for the profile's callers.
from kvferry.bench.step_cost import (DECODE_TERMS, FIT_RMS_WARN, HUBER_K, MIXED_TERMS, PREFILL_TERMS,  # noqa: F401
                                     _nonnegative_lstsq, fit, fit_mixed, fit_quality, poor_fits, predict,
                                     warn_quality)
from kvferry.bench.plots import readable_title
from kvferry.sampling import SamplingParams


@dataclass(slots=True)
class ProfileGrid:
    new_tokens: list[int]
    cached_tokens: list[int]
    batch_sizes: list[int]
    context_lens: list[int]
    decode_steps: int = 8
    repeats: int = 3
    seed: int = 0
    # --url: how long the server idles before each first-token-delay request
    idle_gap_s: float = 0.5


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
    result = {"prefill": {"points": prefill, "fit": fit(prefill, PREFILL_TERMS)},
              "decode": {"points": decode, "fit": fit(decode, DECODE_TERMS)}}
    quality = fit_quality(result)
    warn_quality(quality)
    return {**result, "quality": quality}


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
    # short: the two panels' titles sit side by side (dots and lines are explained in the suptitle)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=f"{name} (R² {part['fit']['r2']:.3f})")


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

    fig.suptitle(f"{readable_title(title, 100)}\ndots: measured; lines: fitted", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
