"""DistServe-style placement search.

For a workload at a given rate and SLOs, simulate every split of at most
``gpus`` instances (one GPU each) into ``P`` prefill + ``D`` decode
instances, and every colocated count ``C``; score each by goodput per GPU:

    goodput = offered rate * SLO attainment,   score = goodput / (P + D)

Only placements that keep at least ``min_attainment`` of the requests
within the SLOs qualify (DistServe's attainment target; a lone overloaded
instance must not win on a per-GPU basis); among them the best score wins,
ties going to fewer GPUs, then higher attainment. The best disaggregated
placement is compared with the best colocated one.
"""
from __future__ import annotations

from dataclasses import replace

from kvferry.plan.instance import InstanceConfig
from kvferry.plan.latency import KVTransferModel, StepCostModel
from kvferry.plan.report import meets
from kvferry.plan.simulator import ClusterConfig, Simulation
from kvferry.plan.workload import SimRequest


def offered_rate(requests: list[SimRequest]) -> float:
    times = sorted(r.arrival_s for r in requests)
    span = times[-1] - times[0]
    return (len(times) - 1) / span if span > 0 else float(len(times))


def evaluate(requests: list[SimRequest], cost: StepCostModel, slo: dict[str, float],
             cluster: ClusterConfig) -> dict:
    results = Simulation(cluster, cost).run(_fresh(requests))
    attainment = sum(meets(r, slo) for r in results.values()) / len(results)
    goodput = offered_rate(requests) * attainment
    return {"kind": "disaggregated" if cluster.disaggregated else "colocated",
            "num_prefill": cluster.num_prefill, "num_decode": cluster.num_decode,
            "num_colocated": cluster.num_colocated, "gpus": cluster.num_gpus,
            "slo_attainment_pct": 100.0 * attainment, "goodput": goodput,
            "goodput_per_gpu": goodput / cluster.num_gpus}


def _fresh(requests: list[SimRequest]) -> list[SimRequest]:
    """Copies (token ids shared): a simulation owns its requests' state."""
    return [replace(r) for r in requests]


def _rank(c: dict) -> tuple:
    return (not c["qualifies"], -round(c["goodput_per_gpu"], 9), c["gpus"], -c["slo_attainment_pct"])


def search_placement(requests: list[SimRequest], cost: StepCostModel, slo: dict[str, float], gpus: int,
                     instance: InstanceConfig, transfer: KVTransferModel, router: str, fast: bool,
                     min_attainment_pct: float = 90.0, instances_per_host: int = 1) -> dict:
    """``instances_per_host``: every candidate's instances are packed onto
    hosts of that many (``host.place``: prefill-0, decode-0, prefill-1, ...;
    colocated engine-0, engine-1, ...), slowing each other by the profile's
    ``host_sharing`` while both step; 1 (the default): each its own host."""
    base = dict(instance=instance, transfer=transfer, router=router, fast=fast,
                instances_per_host=instances_per_host)
    clusters = [ClusterConfig(num_colocated=c, **base) for c in range(1, gpus + 1)]
    clusters += [ClusterConfig(num_colocated=0, num_prefill=p, num_decode=d, **base)
                 for p in range(1, gpus) for d in range(1, gpus - p + 1)]
    candidates = [evaluate(requests, cost, slo, cluster) for cluster in clusters]
    for c in candidates:
        c["qualifies"] = c["slo_attainment_pct"] >= min_attainment_pct
    best = {kind: min((c for c in candidates if c["kind"] == kind), key=_rank, default=None)
            for kind in ("colocated", "disaggregated")}
    overall = min((b for b in best.values() if b is not None), key=_rank)
    return {"mode": "fast-analytic" if fast else "scheduler", "rate": offered_rate(requests),
            "num_requests": len(requests), "slo_ms": {k: v * 1000 for k, v in slo.items()}, "gpus": gpus,
            "min_attainment_pct": min_attainment_pct, "instances_per_host": instances_per_host,
            "candidates": sorted(candidates, key=_rank), "best_colocated": best["colocated"],
            "best_disaggregated": best["disaggregated"], "best": overall}


def label(c: dict) -> str:
    return f"{c['num_prefill']}P{c['num_decode']}D" if c["kind"] == "disaggregated" else f"{c['num_colocated']}C"


def format_plan(result: dict) -> str:
    lines = [f"===== kvferry plan ({result['mode']}): {result['num_requests']} requests at "
             f"{result['rate']:.3f} req/s, SLO {result['slo_ms']}, up to {result['gpus']} GPUs"
             + (f" ({result['instances_per_host']} per host)" if result.get("instances_per_host", 1) > 1 else "")
             + f", attainment >= {result['min_attainment_pct']:g}% =====",
             f"{'placement':>10} {'GPUs':>5} {'attain%':>8} {'goodput':>9} {'per GPU':>9}"]
    for c in result["candidates"][:15]:
        lines.append(f"{label(c):>10} {c['gpus']:>5} {c['slo_attainment_pct']:>8.1f} {c['goodput']:>9.3f} "
                     f"{c['goodput_per_gpu']:>9.3f}" + ("" if c["qualifies"] else "  (below target)"))
    for name in ("best_colocated", "best_disaggregated", "best"):
        c = result[name]
        if c is not None:
            lines.append(f"{name:>19}: {label(c)} ({c['goodput_per_gpu']:.3f} req/s per GPU, "
                         f"{c['slo_attainment_pct']:.1f}% within SLO)")
    return "\n".join(lines)


def plot_plan(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = sorted(result["candidates"], key=lambda c: (c["kind"], c["gpus"], c["num_prefill"]))
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(cands)), 4.5))
    colors = ["tab:blue" if c["kind"] == "colocated" else "tab:orange" for c in cands]
    ax.bar(range(len(cands)), [c["goodput_per_gpu"] for c in cands], color=colors)
    best = result["best"]
    for i, c in enumerate(cands):
        if c is best or c == best:
            ax.annotate("best", (i, c["goodput_per_gpu"]), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(cands)), [label(c) for c in cands], rotation=60, fontsize=8)
    ax.set(ylabel="goodput per GPU (req/s)", xlabel="placement (C: colocated, P/D: prefill/decode)",
           title=f"kvferry plan: {result['rate']:.2f} req/s, SLO {result['slo_ms']}")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
