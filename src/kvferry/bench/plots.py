"""PNG figures of a run: latency CDFs (one panel per metric, SLO lines
dashed) and, for a sweep, goodput and latency against the offered rate.
matplotlib is imported here only (Agg backend: no display needed)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from kvferry.bench.metrics import RequestRecord


_PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency"))


def readable_title(text: str, width: int = 70) -> str:
    """A figure title that fits: absolute paths shortened to their last
    part (a model cache path is most of a long title), then wrapped into
    lines of ``width`` characters instead of running off the figure."""
    words = [w.rstrip("/").rsplit("/", 1)[-1] if w.startswith("/") and len(w) > 24 else w for w in text.split(" ")]
    return "\n".join(textwrap.wrap(" ".join(words), width)) or text


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _values_ms(records: list[RequestRecord], metric: str) -> list[float]:
    ok = [r for r in records if r.ok]
    if metric == "itl":
        return [g * 1000 for r in ok for g in r.itl_s]
    values = [getattr(r, f"{metric}_s") for r in ok]
    return [v * 1000 for v in values if v is not None]


def plot_latency_cdfs(records: list[RequestRecord], summary: dict, title: str, path: Path) -> Path:
    """A 2x2 grid of CDFs with p50/p90/p99 marked and the SLO as a dashed line."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    slo = summary.get("slo_ms") or {}
    for ax, (metric, label) in zip(axes.flat, _PANELS):
        values = np.sort(np.asarray(_values_ms(records, metric)))
        ax.set_title(label, fontsize=12, fontweight="bold")
        ax.set_xlabel("milliseconds")
        ax.set_ylabel("fraction of " + ("tokens" if metric == "itl" else "requests"))
        ax.grid(alpha=0.3)
        if not len(values):
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        # the CDF climbs from 0 at the smallest value to 1 at the largest
        xs = np.concatenate([values[:1], values])
        ys = np.concatenate([[0.0], np.arange(1, len(values) + 1) / len(values)])
        ax.step(xs, ys, where="post", color="tab:blue", lw=2, label=f"n = {len(values)}")
        ax.set_ylim(0, 1.02)
        for p, style in ((50, ":"), (90, "-."), (99, "--")):
            v = float(np.percentile(values, p))
            ax.axvline(v, color="gray", ls=style, lw=1)
            ax.annotate(f"p{p} {v:.0f}", (v, p / 100), xytext=(4, -12), textcoords="offset points",
                        fontsize=8, color="dimgray")
        if metric in slo:
            within = 100.0 * float(np.mean(values <= slo[metric]))
            ax.axvline(slo[metric], color="tab:red", ls="--", lw=1.5,
                       label=f"SLO {slo[metric]:.0f} ms ({within:.0f}% within)")
        ax.legend(loc="lower right", fontsize=9)
    fig.suptitle(readable_title(title, 90), fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(points: list[dict], title: str, path: Path) -> Path:
    """``points``: one summary per offered rate (key ``rate``). Left: request
    throughput and goodput vs rate (with the ideal y = x); right: p50/p90
    TTFT and TPOT vs rate."""
    from matplotlib import ticker

    plt = _pyplot()
    rates = [p["rate"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    if points and points[0].get("goodput") is not None:  # drawn first: throughput stays visible on top
        left.plot(rates, [p["goodput"] for p in points], "s-", color="tab:green", lw=4, alpha=0.6,
                  label="goodput (req/s within SLO)")
        for r, p in zip(rates, points):
            left.annotate(f"{p['slo_attainment_pct']:.0f}%", (r, p["goodput"]), xytext=(0, 7),
                          textcoords="offset points", ha="center", fontsize=8, color="tab:green")
    left.plot(rates, [p["request_throughput"] for p in points], "o-", color="tab:blue", lw=1.5,
              label="throughput (req/s)")
    left.plot(rates, rates, ":", color="gray", label="offered rate")
    left.set_xlabel("offered rate (req/s)")
    left.set_ylabel("requests / s")
    left.set_title("Throughput and goodput", fontweight="bold")
    left.legend(fontsize=9)
    left.grid(alpha=0.3)
    for metric, color in (("ttft", "tab:blue"), ("tpot", "tab:orange")):
        right.plot(rates, [p[f"{metric}_ms"]["p50"] or 0 for p in points], "o-", color=color,
                   label=f"{metric.upper()} p50")
        right.plot(rates, [p[f"{metric}_ms"]["p90"] or 0 for p in points], "o--", color=color, alpha=0.6,
                   label=f"{metric.upper()} p90")
        slo = (points[0].get("slo_ms") or {}).get(metric) if points else None
        if slo:
            right.axhline(slo, color=color, ls=":", lw=1.5, label=f"{metric.upper()} SLO")
    right.set_yscale("log")
    right.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    right.yaxis.set_minor_formatter(ticker.NullFormatter())
    right.set_xlabel("offered rate (req/s)")
    right.set_ylabel("milliseconds (log)")
    right.set_title("Latency", fontweight="bold")
    right.legend(fontsize=8)
    right.grid(alpha=0.3, which="both")
    fig.suptitle(readable_title(title, 90), fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
