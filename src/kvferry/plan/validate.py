"""Simulator validation: the same requests, measured and predicted.

A ``kvferry bench`` run records every request's send time and token counts;
the prompts' token ids (from the server's ``/tokenize``) give the prefix
structure. ``trace_lines`` turns both into a Mooncake-format trace whose
blocks are the engine's KV blocks, so ``kvferry simulate --trace`` replays
exactly that request list::

    record i:  start_s, prompt_tokens, completion_tokens      (bench JSON)
    prompt i:  token ids  ──blocks of block_size──▶ hash_ids   (equal blocks, equal ids)
    trace i:   {"timestamp": 1000 * start_s, "input_length", "output_length", "hash_ids"}

``measured_summary`` computes the measured side with the simulator's
definitions (goodput over first arrival -> last finish), ``error_rows`` the
relative errors, ``markdown_table`` and ``plot_validation`` show them.
Pure functions, no I/O but the plot.
"""
from __future__ import annotations

import hashlib

import numpy as np

METRICS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "goodput")


def block_hash_ids(token_ids: list[int], block_size: int) -> list[int]:
    """One id per block of ``block_size`` tokens (the last one partial): equal
    token blocks give equal ids, on every run (sha256, not Python's hash)."""
    ids = []
    for start in range(0, len(token_ids), block_size):
        block = ",".join(map(str, token_ids[start:start + block_size])).encode()
        ids.append(int.from_bytes(hashlib.sha256(block).digest()[:7], "big"))  # 56 bits: no sign issues
    return ids


def trace_lines(records: list[dict], prompts: list[list[int]], block_size: int) -> list[dict]:
    """Mooncake trace lines for the completed ``records`` (bench JSON
    records, in send order) with ``prompts[i]`` the token ids of record i.
    A prompt whose length differs from the server's usage count means the
    two lists are not aligned: ValueError."""
    if len(prompts) < len(records):
        raise ValueError(f"prompts: {len(prompts)} prompts for {len(records)} records")
    lines = []
    for rec, ids in zip(records, prompts):
        if rec.get("error") is not None:
            continue
        if rec["prompt_tokens"] and rec["prompt_tokens"] != len(ids):
            raise ValueError(f"prompts: request {rec['request_id']} has {rec['prompt_tokens']} prompt tokens "
                             f"on the server but {len(ids)} here: the request lists are not aligned")
        lines.append({"timestamp": 1000.0 * rec["start_s"], "input_length": len(ids),
                      "output_length": max(int(rec["completion_tokens"]), 1),
                      "hash_ids": block_hash_ids(ids, block_size)})
    if not lines:
        raise ValueError("records: no completed request to replay")
    lines.sort(key=lambda d: d["timestamp"])
    return lines


def _tpot(rec: dict) -> float | None:
    n = rec["completion_tokens"]
    if n < 2 or rec.get("ttft_s") is None or rec.get("e2e_s") is None:
        return None
    return (rec["e2e_s"] - rec["ttft_s"]) / (n - 1)


def _pct_ms(values: list[float], p: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1000.0, p)) if values else None


def measured_summary(records: list[dict], slo: dict[str, float]) -> dict[str, float | None]:
    """TTFT/TPOT p50/p99 (ms) and goodput (req/s) of bench records, as the
    simulator defines them: goodput counts requests meeting every SLO over
    the span from the first send to the last finish."""
    ok = [r for r in records if r.get("error") is None and r.get("e2e_s") is not None]
    ttft = [r["ttft_s"] for r in ok]
    tpot = [t for r in ok if (t := _tpot(r)) is not None]
    good = 0
    for r in ok:
        values = {"ttft": r["ttft_s"], "tpot": _tpot(r) or 0.0, "e2e": r["e2e_s"], "itl": _tpot(r) or 0.0}
        good += all(values[k] <= limit for k, limit in slo.items())
    span = (max(r["start_s"] + r["e2e_s"] for r in ok) - min(r["start_s"] for r in records)) if ok else 0.0
    return {"ttft_p50": _pct_ms(ttft, 50), "ttft_p99": _pct_ms(ttft, 99),
            "tpot_p50": _pct_ms(tpot, 50), "tpot_p99": _pct_ms(tpot, 99),
            "goodput": good / span if slo and span > 0 else None}


def _in_flight_at(records: list[dict], rec: dict) -> bool:
    """Did another request hold the server when ``rec`` was sent?"""
    t = rec["start_s"]
    return any(o is not rec and o["start_s"] <= t < o["start_s"] + o["e2e_s"] for o in records)


def request_breakdown(records: list[dict], sim_requests: list[dict]) -> dict:
    """Where the error sits, request by request: completed ``records`` in
    send order pair with ``sim_requests`` (``kvferry simulate --per-request``)
    in arrival order, as ``trace_lines`` built them. A request sent to an
    idle server measures service alone (the step model and the per-request
    overhead); one sent while others ran adds queueing and batching. Mean
    relative error of TTFT over each kind, of TPOT over all."""
    ok = sorted((r for r in records if r.get("error") is None and r.get("e2e_s") is not None),
                key=lambda r: r["start_s"])
    sims = sorted(sim_requests, key=lambda r: r["arrival_s"])
    if len(ok) != len(sims):
        raise ValueError(f"sim_requests: {len(sims)} simulated requests for {len(ok)} completed records")
    errs: dict[str, list[float]] = {"ttft_idle": [], "ttft_busy": [], "tpot": []}
    for rec, sim in zip(ok, sims):
        if (e := relative_error(rec["ttft_s"] * 1000.0, sim["ttft_ms"])) is not None:
            errs["ttft_busy" if _in_flight_at(ok, rec) else "ttft_idle"].append(e)
        tpot = _tpot(rec)
        if (e := relative_error(None if tpot is None else tpot * 1000.0, sim["tpot_ms"])) is not None:
            errs["tpot"].append(e)
    return {k: {"mean_rel_error": float(np.mean(v)) if v else None, "n": len(v)} for k, v in errs.items()}


def breakdown_table(breakdowns: dict[str, dict]) -> str:
    """Runs down: mean TTFT error of requests that found the server idle
    (service) and busy (queueing too), and mean TPOT error, with counts."""
    lines = ["| run | TTFT err, idle server (n) | TTFT err, busy server (n) | TPOT err (n) |", "|---|---|---|---|"]
    for run, b in breakdowns.items():
        cells = [f"{_cell(b[k]['mean_rel_error'], True)} ({b[k]['n']})" for k in ("ttft_idle", "ttft_busy", "tpot")]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_table(speed: dict[str, dict]) -> str:
    """Runs down: the server's engine busy seconds in the run, the
    simulator's for the same requests, and their ratio (the step-time scale
    a calibrated simulation applies); with a probe before the run
    (``probe_scale``), the same ratio over the probe's requests too."""
    probes = any("probe_scale" in s for s in speed.values())
    head = "| run | engine busy, measured (s) | simulated (s) | measured / simulated |"
    lines = [head + (" probe before the run: measured / simulated |" if probes else ""),
             "|---|---|---|---|" + ("---|" if probes else "")]
    for run, s in speed.items():
        line = f"| {run} | {s['measured_busy_s']:.2f} | {s['simulated_busy_s']:.2f} | {s['scale']:.3f} |"
        if probes:
            line += f" {s['probe_scale']:.3f} |" if s.get("probe_scale") is not None else " - |"
        lines.append(line)
    return "\n".join(lines)


def predicted_summary(sim_result: dict) -> dict[str, float | None]:
    """The same numbers from a ``kvferry simulate --json`` result."""
    s = sim_result["summary"]
    return {"ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "tpot_p50": s["tpot_ms"]["p50"], "tpot_p99": s["tpot_ms"]["p99"], "goodput": s["goodput"]}


def predicted_spread(sim_result: dict) -> dict[str, float | None]:
    """Per metric, the relative standard deviation of the simulator's seeded
    runs of the same requests (``seed_summaries``): how far one run is
    expected to land from the mean of many when only the steps' noise
    differs. None with fewer than two seeds or a zero mean."""
    runs = [predicted_summary({"summary": s}) for s in sim_result.get("seed_summaries") or ()]
    out: dict[str, float | None] = {}
    for m in METRICS:
        values = [r[m] for r in runs]
        mean = float(np.mean(values)) if len(values) >= 2 and None not in values else 0.0
        out[m] = float(np.std(values)) / mean if mean > 0 else None
    return out


def spread_table(spreads: dict[str, dict]) -> str:
    """Runs down, metrics across: the simulator's seed-to-seed spread
    (``predicted_spread``), then its mean over the runs."""
    lines = ["| run | " + " | ".join(METRICS) + " |", "|" + "---|" * (len(METRICS) + 1)]
    for run, s in spreads.items():
        lines.append(f"| {run} | " + " | ".join("-" if s[m] is None else f"{100 * s[m]:.1f}%" for m in METRICS) + " |")
    means = []
    for m in METRICS:
        values = [s[m] for s in spreads.values() if s[m] is not None]
        means.append(f"{100 * np.mean(values):.1f}%" if values else "-")
    lines.append("| **mean** | " + " | ".join(means) + " |")
    return "\n".join(lines)


def relative_error(measured: float | None, predicted: float | None) -> float | None:
    """(predicted - measured) / measured; None when either is missing or the
    measured value is 0 (no relative error of nothing)."""
    if measured is None or predicted is None or measured == 0:
        return None
    return (predicted - measured) / measured


def error_rows(name: str, measured: dict, predicted: dict) -> list[dict]:
    """One row per metric of one configuration run."""
    return [{"run": name, "metric": m, "measured": measured.get(m), "predicted": predicted.get(m),
             "rel_error": relative_error(measured.get(m), predicted.get(m))} for m in METRICS]


def _cell(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:+.1f}%" if pct else f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def markdown_table(rows: list[dict]) -> str:
    """Runs down, metrics across: 'measured / predicted (error)' per cell, and
    a last line with the mean and largest absolute error per metric."""
    runs = list(dict.fromkeys(r["run"] for r in rows))
    by = {(r["run"], r["metric"]): r for r in rows}
    head = "| run | " + " | ".join(f"{m} meas / pred (err)" for m in METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 1)]
    for run in runs:
        cells = []
        for m in METRICS:
            r = by.get((run, m))
            cells.append("-" if r is None else
                         f"{_cell(r['measured'])} / {_cell(r['predicted'])} ({_cell(r['rel_error'], True)})")
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    cells = []
    for m in METRICS:
        errs = [abs(r["rel_error"]) for r in rows if r["metric"] == m and r["rel_error"] is not None]
        cells.append(f"mean {100 * np.mean(errs):.1f}%, max {100 * max(errs):.1f}%" if errs else "-")
    lines.append("| **abs. error** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sittings_comparison(sittings: dict[str, list[dict]]) -> dict:
    """Several sittings of the same validation (the same request lists, so
    only the machine and the time differ): how reproducible the measurement
    itself is, and the simulator's error against it.

    ``sittings`` maps a sitting's name to its ``error_rows``. Only the
    (run, metric) pairs measured in every sitting count. Returns
    ``spread[run][metric]``, the measured values' relative standard
    deviation over the sittings (ddof 1), and per sitting and metric the
    mean over runs of three absolute relative errors:

    - ``own``: its prediction against its own measurement (the validation's figure);
    - ``prediction_vs_mean``: its prediction against the mean measurement of all sittings;
    - ``mean_vs_own``: that mean measurement against its own measurement,
      what a predictor that knew the real system's average would score.
    """
    names = list(sittings)
    if len(names) < 2:
        raise ValueError(f"sittings: need at least two to compare, got {len(names)}")
    by = {name: {(r["run"], r["metric"]): r for r in rows} for name, rows in sittings.items()}
    keys = [k for k in by[names[0]]
            if all(k in by[n] and by[n][k]["measured"] and by[n][k]["predicted"] is not None for n in names)]
    spread: dict[str, dict[str, float]] = {}
    errs = {n: {kind: {m: [] for m in METRICS} for kind in ("own", "prediction_vs_mean", "mean_vs_own")}
            for n in names}
    for run, metric in keys:
        measured = np.array([by[n][(run, metric)]["measured"] for n in names], dtype=float)
        mean = float(measured.mean())
        spread.setdefault(run, {})[metric] = float(measured.std(ddof=1) / mean)
        for n, own in zip(names, measured):
            predicted = by[n][(run, metric)]["predicted"]
            errs[n]["own"][metric].append(abs(predicted - own) / own)
            errs[n]["prediction_vs_mean"][metric].append(abs(predicted - mean) / mean)
            errs[n]["mean_vs_own"][metric].append(abs(mean - own) / own)
    per_sitting = {n: {kind: {m: (float(np.mean(v)) if v else None) for m, v in kinds.items()}
                       for kind, kinds in errs[n].items()} for n in names}
    return {"sittings": names, "spread": spread, "per_sitting": per_sitting}


def sittings_table(comparison: dict) -> str:
    """``sittings_comparison`` as markdown: the measured spread per run, then
    per sitting the three mean errors for each metric."""
    metrics = [m for m in METRICS if any(m in s for s in comparison["spread"].values())]
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    lines = ["| run | " + " | ".join(f"{m} spread" for m in metrics) + " |", "|" + "---|" * (len(metrics) + 1)]
    for run, s in comparison["spread"].items():
        lines.append(f"| {run} | " + " | ".join(pct(s.get(m)) for m in metrics) + " |")
    means = [np.mean([s[m] for s in comparison["spread"].values() if m in s]) for m in metrics]
    lines.append("| **mean** | " + " | ".join(pct(float(v)) for v in means) + " |")
    lines += ["", "| sitting | error | " + " | ".join(metrics) + " |", "|---|" + "---|" * (len(metrics) + 1)]
    labels = {"own": "prediction vs own run", "prediction_vs_mean": "prediction vs mean of sittings",
              "mean_vs_own": "mean of sittings vs own run"}
    for name in comparison["sittings"]:
        for kind, label in labels.items():
            row = comparison["per_sitting"][name][kind]
            lines.append(f"| {name} | {label} | " + " | ".join(pct(row[m]) for m in metrics) + " |")
    return "\n".join(lines)


def plot_validation(rows: list[dict], path, title: str = "kvferry simulate vs measured") -> None:
    """Predicted against measured, one panel per metric (log-log), y = x and
    a +-10% band; a run with a zero value is left out of that panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 4.4))
    configs = sorted({r["run"].rsplit("@", 1)[0] for r in rows})
    colors = dict(zip(configs, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    units = {"goodput": "req/s"}
    for ax, m in zip(axes, METRICS):
        # log-log: errors are ratios, and a run's values span orders of magnitude (a zero has no place)
        pts = [r for r in rows if r["metric"] == m and (r["measured"] or 0) > 0 and (r["predicted"] or 0) > 0]
        values = [v for r in pts for v in (r["measured"], r["predicted"])] or [1.0]
        lo, hi = min(values) / 1.5, max(values) * 1.5
        ax.fill_between([lo, hi], [0.9 * lo, 0.9 * hi], [1.1 * lo, 1.1 * hi], color="0.85", label="±10%")
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        for cfg in configs:
            sel = [r for r in pts if r["run"].rsplit("@", 1)[0] == cfg]
            ax.plot([r["measured"] for r in sel], [r["predicted"] for r in sel], "o", color=colors[cfg],
                    label=cfg)
        unit = units.get(m, "ms")
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel=f"measured ({unit})",
               ylabel=f"predicted ({unit})", title=m)
        ax.grid(alpha=0.3, which="both")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_minor_formatter(NullFormatter())  # labels on decades only
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
