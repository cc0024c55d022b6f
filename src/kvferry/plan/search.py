"""DistServe-style placement search.

For a workload at a given rate and SLOs, simulate every split of at most
``gpus`` instances (one GPU each; with a CPU profile, one engine core on
the threads it was profiled with: ``DeviceUnit`` names it) into ``P`` prefill + ``D`` decode
instances, and every colocated count ``C``; score each by goodput per GPU:

    goodput = offered rate * SLO attainment,   score = goodput / (P + D)

Only placements that keep at least ``min_attainment`` of the requests
within the SLOs qualify (DistServe's attainment target; a lone overloaded
instance must not win on a per-GPU basis); among them the best score wins,
ties going to fewer GPUs, then higher attainment. The best disaggregated
placement is compared with the best colocated one. When none qualifies,
the plan says so and lists the nearest (highest attainment) with what each
misses: each SLO metric at the attainment target's percentile against its
limit.

Heterogeneous pools (``--hardware NAME=PROFILE.json:PRICE``, ``hardware.py``):
each pool of a candidate runs on one hardware with its own profile's step
times, colocated counts on each hardware and disaggregated splits on each
(prefill, decode) pair. With every hardware priced the ranking is by cost
per million useful tokens (fleet price * run hours / output tokens of the
requests that met the SLO), qualifying placements first, then goodput per
GPU; ``best_mixed`` is the best layout whose prefill and decode pools run
on different hardware.

Parallel layouts (``layouts.py``): a profile measured at several (TP, PP)
layouts is one hardware per layout, so every pool is searched on each; an
instance counts its layout's ``share`` against ``gpus`` and in the price.
``layout_choice`` names each pool's chosen layout and each layout's best
placement beside it (the reason).

Weight formats (``formats.py``): a prefill pool pairs with a decode pool of
the same format only, and with several formats ``format_choice`` sets each
format's best placement and cost per million useful tokens side by side.

The rate is the user's (``--rate``) wherever it is printed and in goodput;
the sampled arrivals' own mean rate (a Poisson sample of 200 requests at
8 req/s may come out at 7.7) is kept as ``offered_rate``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvferry.bench.metrics import cost_per_million_useful_tokens
from kvferry.plan.formats import format_choice, format_choice_text, formats_of, same_format
from kvferry.plan.afd import AFDStepCost, afd_breakdown
from kvferry.plan.hardware import DeviceUnit, Hardware, fleet_price_per_hour
from kvferry.plan.instance import InstanceConfig
from kvferry.plan.latency import KVTransferModel
from kvferry.plan.layouts import units
from kvferry.plan.report import at_percentile_ms, meets
from kvferry.plan.simulator import ClusterConfig, RequestResult, Simulation
from kvferry.plan.workload import SimRequest


def offered_rate(requests: list[SimRequest]) -> float:
    times = sorted(r.arrival_s for r in requests)
    span = times[-1] - times[0]
    return (len(times) - 1) / span if span > 0 else float(len(times))


@dataclass(frozen=True, slots=True)
class Pools:
    """The hardware each pool may use: colocated candidates enumerate
    ``colocated``, disaggregated ones every (prefill, decode) pair."""

    colocated: list[Hardware]
    prefill: list[Hardware]
    decode: list[Hardware]

    @property
    def all(self) -> list[Hardware]:
        out: list[Hardware] = []
        for h in self.colocated + self.prefill + self.decode:
            if h not in out:
                out.append(h)
        return out

    @property
    def priced(self) -> bool:
        return all(h.price_per_hour is not None for h in self.all)


def run_span_s(results: list[RequestResult]) -> float:
    """What the fleet is paid for: first arrival to the last finish (or the
    last arrival, should every late request fail)."""
    start = min(r.request.arrival_s for r in results)
    end = max([r.request.arrival_s for r in results] + [r.finish_s for r in results if r.finish_s is not None])
    return max(end - start, 1e-9)


def evaluate(requests: list[SimRequest], slo: dict[str, float], cluster: ClusterConfig,
             front: Hardware, back: Hardware | None = None, rate: float | None = None,
             target_pct: float = 90.0) -> dict:
    """One placement's attainment and goodput (at ``rate``, default the
    arrivals' own), each SLO metric at the ``target_pct`` percentile
    (``at_target_ms``: what to compare with the SLO when it falls short),
    and its cost per million useful tokens (None when unpriced or when no
    request met the SLO). ``front``: the colocated or prefill pool's
    hardware; ``back``: the decode pool's."""
    decode_cost = back.cost if back is not None and back is not front else None
    results = list(Simulation(cluster, front.cost, decode_cost=decode_cost).run(_fresh(requests)).values())
    good = [r for r in results if meets(r, slo)]
    attainment = len(good) / len(results)
    goodput = (rate or offered_rate(requests)) * attainment
    if cluster.disaggregated:
        pools = {"prefill": (cluster.num_prefill, front), "decode": (cluster.num_decode, back or front)}
    else:
        pools = {"colocated": (cluster.num_colocated, front)}
    hardware = {pool: hw.name for pool, (_, hw) in pools.items()}
    # the pools that are AFD units (plan/afd.py): their shape, "afd2+1"
    afd = {pool: hw.layout for pool, (_, hw) in pools.items() if isinstance(hw.cost, AFDStepCost)}
    price = fleet_price_per_hour(list(pools.values()))
    # what the placement uses, in the units --gpus counts: a layout's instance is its share (plan/layouts.py)
    used = sum(units(n, hw) for n, hw in pools.values())
    used = int(used) if float(used).is_integer() else used
    span, useful = run_span_s(results), sum(r.num_output_tokens for r in good)
    return {"kind": "disaggregated" if cluster.disaggregated else "colocated",
            "num_prefill": cluster.num_prefill, "num_decode": cluster.num_decode,
            "num_colocated": cluster.num_colocated, "gpus": used,
            "hardware": hardware, "afd": afd, "mixed_hardware": len({hw.base_name for _, hw in pools.values()}) > 1,
            "layout": {pool: hw.layout or "tp1pp1" for pool, (_, hw) in pools.items()},
            "weight_format": front.weight_format,  # the pools' one format (formats.same_format)
            "slo_attainment_pct": 100.0 * attainment, "goodput": goodput,
            "goodput_per_gpu": goodput / used,
            "at_target_ms": at_percentile_ms(results, slo, target_pct),
            "price_per_hour": price, "run_s": span, "useful_output_tokens": useful,
            "cost_per_million_useful_tokens": cost_per_million_useful_tokens(price, span, useful)}


def _fresh(requests: list[SimRequest]) -> list[SimRequest]:
    """Copies (token ids shared): a simulation owns its requests' state."""
    return [replace(r) for r in requests]


def _rank(c: dict) -> tuple:
    return (not c["qualifies"], -round(c["goodput_per_gpu"], 9), c["gpus"], -c["slo_attainment_pct"])


def _rank_by_cost(c: dict) -> tuple:
    """Cheapest useful token first (no useful token: last), then as _rank."""
    cost = c["cost_per_million_useful_tokens"]
    return (not c["qualifies"], math.inf if cost is None else round(cost, 9), *_rank(c)[1:])


def search_placement(requests: list[SimRequest], pools: Pools, slo: dict[str, float], gpus: int,
                     instance: InstanceConfig, transfer: Callable[[Hardware, Hardware], KVTransferModel],
                     router: str, fast: bool, min_attainment_pct: float = 90.0, instances_per_host: int = 1,
                     rate: float | None = None, equal_cost: bool = False) -> dict:
    """Every colocated count on each of ``pools.colocated`` and every
    prefill/decode split on each (prefill, decode) hardware pair, at most
    ``gpus`` instances in all. Ranked by cost per million useful tokens
    when every hardware is priced, else by goodput per GPU (qualifying
    placements first either way). ``transfer(prefill hw, decode hw)``: the
    hand-over between the two pools.
    ``instances_per_host``: every candidate's instances are packed onto
    hosts of that many (``host.place``: prefill-0, decode-0, prefill-1, ...;
    colocated engine-0, engine-1, ...), slowing each other by the profile's
    ``host_sharing`` while both step; 1 (the default): each its own host.
    ``rate``: the rate the user asked for (None: the arrivals' own).
    ``equal_cost``: only placements that use exactly ``gpus`` units (every
    candidate the same fleet size, so the same price per hour with one
    priced hardware): layouts compared at equal cost.
    AFD units (``plan/afd.py``) are hardware of the colocated and decode
    pools like any other; ``best_colocated`` and ``best_disaggregated`` are
    the best without them, ``best_afd`` the best with one."""
    base = dict(instance=instance, router=router, fast=fast, instances_per_host=instances_per_host)
    fits = 1e-9  # float shares (CPU layouts) must not lose a placement to rounding

    def counts(hw: Hardware, budget: float) -> range:
        """1.. the most instances of ``hw`` within ``budget`` units."""
        return range(1, int(budget / hw.share + fits) + 1)

    layouts = [(ClusterConfig(num_colocated=c, **base), hw, None)
               for hw in pools.colocated for c in counts(hw, gpus)]
    layouts += [(ClusterConfig(num_colocated=0, num_prefill=p, num_decode=d, transfer=transfer(ph, dh), **base),
                 ph, dh)
                for ph in pools.prefill for dh in pools.decode if same_format(ph, dh)
                for p in counts(ph, gpus - dh.share) for d in counts(dh, gpus - units(p, ph))]
    if equal_cost:
        layouts = [lay for lay in layouts if abs(_units_of(*lay) - gpus) < 1e-6]
    if not layouts:
        if not any(same_format(ph, dh) for ph in pools.prefill for dh in pools.decode):
            raise ValueError("no prefill hardware has a decode hardware of its weight format (prefill: "
                             f"{_formats_text(pools.prefill)}; decode: {_formats_text(pools.decode)}): a "
                             "decode pool takes its prefill pool's KV, so both run one format")
        raise ValueError(f"--gpus {gpus} with no colocated hardware leaves no placement (a disaggregated one "
                         "needs 2 instances)" + (", or none uses exactly --gpus units (--equal-cost)"
                                                 if equal_cost else ""))
    candidates = [evaluate(requests, slo, cluster, front, back, rate, min_attainment_pct)
                  for cluster, front, back in layouts]
    for c in candidates:
        c["qualifies"] = c["slo_attainment_pct"] >= min_attainment_pct
    rank = _rank_by_cost if pools.priced else _rank
    best = {kind: min((c for c in candidates if c["kind"] == kind and not c["afd"]), key=rank, default=None)
            for kind in ("colocated", "disaggregated")}
    best["afd"] = min((c for c in candidates if c["afd"]), key=rank, default=None)
    overall = min((b for b in best.values() if b is not None), key=rank)
    # nearest: highest attainment first, then fewer GPUs
    nearest = sorted(candidates, key=lambda c: (-c["slo_attainment_pct"], c["gpus"]))[:NEAREST]
    hardware = pools.all
    out = {"mode": "fast-analytic" if fast else "scheduler", "rate": rate or offered_rate(requests),
           "offered_rate": offered_rate(requests),
           "num_requests": len(requests), "slo_ms": {k: v * 1000 for k, v in slo.items()}, "gpus": gpus,
           "min_attainment_pct": min_attainment_pct, "instances_per_host": instances_per_host,
           "hardware": [h.to_json() for h in hardware],
           # "gpus" and "goodput_per_gpu" keep their names; the text and plot say what an instance is
           "device_unit": DeviceUnit.of(h.device for h in hardware).to_json(),
           "ranked_by": "cost_per_million_useful_tokens" if pools.priced else "goodput_per_gpu",
           "candidates": sorted(candidates, key=rank), "best_colocated": best["colocated"],
           "best_disaggregated": best["disaggregated"], "best": overall, "equal_cost": equal_cost,
           # False: no placement keeps min_attainment_pct within the SLO ("best" is then only the
           # least bad by the ranking; "nearest" are the closest by attainment)
           "meets_slo": overall["qualifies"], "nearest": [] if overall["qualifies"] else nearest}
    if len({h.base_name for h in hardware}) > 1:  # the best disaggregated layout, pools on different hardware
        out["best_mixed"] = min((c for c in candidates if c["mixed_hardware"]), key=rank, default=None)
    if any(h.layout for h in hardware):
        out["layout_choice"] = layout_choice(candidates, rank)
    if len(formats_of(hardware)) > 1:  # the same model in several formats: each one's best, side by side
        out["format_choice"] = format_choice(candidates, rank, label)
    if best["afd"] is not None:
        out["best_afd"] = best["afd"]
        out["afd_breakdown"] = _afd_breakdown(best["afd"], hardware, requests, instance)
    return out


def _format_prefix(h: dict) -> str:
    """"Q4_K_M, " for a hardware whose profile names its weight format."""
    return f"{h['weight_format']}, " if h.get("weight_format") else ""


def _formats_text(hardware: list[Hardware]) -> str:
    return ", ".join(f"{h.name} {h.weight_format or 'unnamed'}" for h in hardware)


def _units_of(cluster: ClusterConfig, front: Hardware, back: Hardware | None) -> float:
    if cluster.disaggregated:
        return units(cluster.num_prefill, front) + units(cluster.num_decode, back)
    return units(cluster.num_colocated, front)


def _afd_breakdown(best_afd: dict, hardware: list[Hardware], requests: list[SimRequest],
                   instance: InstanceConfig) -> dict:
    """Each AFD unit, step by step (``afd.afd_breakdown``), best_afd's
    first, at a few batch sizes and the workload's mean decode context:
    where its step stands against the same sequences on colocated nodes."""
    pool = "decode" if "decode" in best_afd["afd"] else "colocated"
    first = best_afd["hardware"][pool]
    units = sorted((h for h in hardware if isinstance(h.cost, AFDStepCost)), key=lambda h: h.name != first)
    context = int(sum(r.input_len + r.output_len / 2 for r in requests) / len(requests))
    rows = []
    for unit in units:
        node = next((h for h in hardware if h.profile == unit.profile and not isinstance(h.cost, AFDStepCost)
                     and h.layout in ("", "tp1pp1")), None)
        if node is None:
            continue
        most = instance.max_num_seqs * unit.cost.attention
        batches = sorted({b for b in (1, 8, 32, most // 4, most) if 1 <= b <= most})
        rows += [{"unit": unit.name, **r} for r in afd_breakdown(unit.cost, node.cost, batches, context)]
    return {"best": first, "micro_batches": units[0].cost.micro_batches if units else None,
            "mean_context": context, "rows": rows}


def layout_choice(candidates: list[dict], rank) -> dict:
    """Per pool (colocated, prefill, decode): the best placement on each of
    its hardware/layouts, and the layout chosen (the best of those: the one
    the pool's best placement runs). Why: each alternative's best placement,
    its cost per million useful tokens and goodput per unit, side by side."""
    out: dict = {}
    for pool in ("colocated", "prefill", "decode"):
        best: dict[str, dict] = {}
        for c in candidates:
            if (name := c["hardware"].get(pool)) is not None and (name not in best or rank(c) < rank(best[name])):
                best[name] = c
        if not best:
            continue
        chosen = min(best, key=lambda name: rank(best[name]))
        out[pool] = {"chosen": chosen, "layout": best[chosen]["layout"][pool],
                     "by_hardware": {name: {"layout": c["layout"][pool], "placement": label(c, True),
                                            "cost_per_million_useful_tokens": c["cost_per_million_useful_tokens"],
                                            "goodput_per_gpu": c["goodput_per_gpu"],
                                            "slo_attainment_pct": c["slo_attainment_pct"],
                                            "qualifies": c["qualifies"]}
                                     for name, c in sorted(best.items(), key=lambda kv: rank(kv[1]))}}
    return out


def layout_choice_text(result: dict, per: str) -> list[str]:
    """One line per pool: the chosen layout and why (each layout's best placement)."""
    lines = []
    priced = result.get("ranked_by") == "cost_per_million_useful_tokens"
    for pool, choice in (result.get("layout_choice") or {}).items():
        alternatives = []
        for name, c in choice["by_hardware"].items():
            if priced and c["cost_per_million_useful_tokens"] is None:
                score = "no useful token"
            else:
                score = (f"{_cost_text(c)} per million useful tokens" if priced
                         else f"{c['goodput_per_gpu']:.3f} req/s {per}")
            alternatives.append(f"{name} {score} at its best ({c['placement']}"
                                + ("" if c["qualifies"] else ", below target") + ")")
        lines.append(f"{pool + ' layout':>19}: {choice['chosen']}, of " + "; ".join(alternatives))
    return lines


NEAREST = 3  # placements listed when none meets the SLO


def label(c: dict, with_hardware: bool = False) -> str:
    """3C, 1P2D; with the hardware: 3C@cheap, 1P@fast+2D@cheap."""
    if c["kind"] == "disaggregated":
        if with_hardware:
            return f"{c['num_prefill']}P@{c['hardware']['prefill']}+{c['num_decode']}D@{c['hardware']['decode']}"
        return f"{c['num_prefill']}P{c['num_decode']}D"
    return f"{c['num_colocated']}C@{c['hardware']['colocated']}" if with_hardware else f"{c['num_colocated']}C"


def _with_hardware(result: dict) -> bool:
    return len(result.get("hardware") or ()) > 1


def _cost_text(c: dict) -> str:
    cost = c.get("cost_per_million_useful_tokens")
    return "-" if cost is None else f"{cost:.4g}"


def _duration(ms: float | None) -> str:
    """2.1 s, 850 ms, 12.5 ms; None: "no finish" (requests that failed)."""
    if ms is None:
        return "no finish"
    if ms >= 1000:
        return f"{ms / 1000:.3g} s"
    return f"{ms:.3g} ms"


def slo_text(slo_ms: dict[str, float]) -> str:
    """TTFT <= 1 s, TPOT <= 50 ms."""
    return ", ".join(f"{k.upper()} <= {_duration(v)}" for k, v in slo_ms.items())


def misses(c: dict, slo_ms: dict[str, float], pct: float) -> str:
    """What a placement misses: each SLO metric over its limit at the
    attainment target's percentile ("TTFT p90 2.1 s vs 1 s")."""
    at = c.get("at_target_ms") or {}
    over = [f"{k.upper()} p{pct:g} {_duration(at[k])} vs {_duration(limit)}" for k, limit in slo_ms.items()
            if k in at and (at[k] is None or at[k] > limit)]
    if over:
        return "; ".join(over)
    # each limit alone holds at the percentile, but different requests miss different ones
    return f"each limit holds for {pct:g}% of requests alone, not all at once"


def no_placement_text(result: dict) -> str:
    """The plain statement that nothing meets the SLO, and the nearest ones."""
    pct = result["min_attainment_pct"]
    hw = _with_hardware(result)
    head = (f"no placement meets the SLO at {result['rate']:g} req/s ({pct:g}% of requests within "
            f"{slo_text(result['slo_ms'])}) with up to {result['gpus']} {_unit(result)['plural']}; nearest:")
    rows = [f"  {label(c, hw)}, {c['slo_attainment_pct']:.1f}% within SLO: {misses(c, result['slo_ms'], pct)}"
            for c in result["nearest"]]
    return "\n".join([head, *rows, "  (try a lower --rate, more --gpus or a looser --slo)"])


TABLE_ROWS = 15  # placements the table shows; the JSON holds every one


def _unit(result: dict) -> dict:
    """What one instance is (DeviceUnit's JSON); a result saved before the
    plan named it counted GPUs."""
    return result.get("device_unit") or DeviceUnit.of(["cuda"]).to_json()


def format_plan(result: dict) -> str:
    hw = _with_hardware(result)
    priced = result.get("ranked_by") == "cost_per_million_useful_tokens"
    unit = _unit(result)
    shown = result["candidates"][:TABLE_ROWS]
    width = max([10] + [len(label(c, hw)) for c in shown])
    count_w, per = max(5, len(unit["column"])), f"per {unit['singular']}"
    per_w = max(9, len(per))
    lines = [f"===== kvferry plan ({result['mode']}): {result['num_requests']} requests at "
             f"{result['rate']:g} req/s, SLO {slo_text(result['slo_ms'])}, up to {result['gpus']} {unit['plural']}"
             + (f" ({result['instances_per_host']} per host)" if result.get("instances_per_host", 1) > 1 else "")
             + f", attainment >= {result['min_attainment_pct']:g}% =====",
             f"{'placement':>{width}} {unit['column']:>{count_w}} {'attain%':>8} {'goodput':>9} {per:>{per_w}}"
             + (f" {'price/h':>8} {'cost/M useful tok':>17}" if priced else "")]
    if priced:
        lines.insert(1, "hardware: " + ", ".join(f"{h['name']} ({_format_prefix(h)}{h['price_per_hour']:g}/h, "
                                                 f"{h['profile']})" for h in result["hardware"])
                     + "; ranked by cost per million useful tokens")
    for c in shown:
        lines.append(f"{label(c, hw):>{width}} {c['gpus']:>{count_w}g} {c['slo_attainment_pct']:>8.1f} "
                     f"{c['goodput']:>9.3f} {c['goodput_per_gpu']:>{per_w}.3f}"
                     + (f" {c['price_per_hour']:>8.4g} {_cost_text(c):>17}" if priced else "")
                     + ("" if c["qualifies"] else "  (below target)"))
    if (left := len(result["candidates"]) - len(shown)) > 0:
        lines.append(f"({left} of {len(result['candidates'])} placements not shown: they rank below these; "
                     "the JSON lists every one)")
    for name in ("best_colocated", "best_disaggregated", "best_afd", "best_mixed", "best"):
        c = result.get(name)
        if c is None or (name == "best" and not c["qualifies"]):
            continue
        lines.append(f"{name:>19}: {label(c, hw)} ({c['goodput_per_gpu']:.3f} req/s {per}, "
                     + (f"{_cost_text(c)} per million useful tokens, " if priced else "")
                     + f"{c['slo_attainment_pct']:.1f}% within SLO)" + ("" if c["qualifies"] else "  (below target)"))
    lines += layout_choice_text(result, per)
    lines += format_choice_text(result, per)
    lines += afd_text(result)
    if not result["best"]["qualifies"]:
        lines.append(no_placement_text(result))
    return "\n".join(lines)


def afd_text(result: dict) -> list[str]:
    """Each AFD unit's step against colocated nodes (``_afd_breakdown``)."""
    b = result.get("afd_breakdown")
    if not b or not b["rows"]:
        return []
    width = max(len(r["unit"]) for r in b["rows"])
    lines = [f"AFD units ({b['micro_batches']} micro-batches, context {b['mean_context']}; best: {b['best']}): "
             "per layer attention / FFN / hop, the unit's step, and tokens/s per node against the same sequences "
             "on colocated nodes",
             f"{'unit':>{width}} {'batch':>6} {'attn ms':>8} {'ffn ms':>8} {'hop ms':>7} {'step ms':>8} "
             f"{'colo ms':>8} {'AFD tok/s/node':>15} {'colo tok/s/node':>16}"]
    for r in b["rows"]:
        lines.append(f"{r['unit']:>{width}} {r['batch']:>6} {r['attention_ms']:>8.3f} {r['ffn_ms']:>8.3f} "
                     f"{r['hop_ms']:>7.3f} {r['afd_step_ms']:>8.2f} {r['colocated_step_ms']:>8.2f} "
                     f"{r['afd_tok_s_per_node']:>15.1f} {r['colocated_tok_s_per_node']:>16.1f}")
    return lines


def plot_plan(result: dict, path) -> None:
    """Write ``plan_figure(result)`` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = plan_figure(result)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_figure(result: dict):  # -> matplotlib.figure.Figure (matplotlib is optional)
    """Goodput per instance of every candidate, or, when ranked by cost,
    each one's cost per million useful tokens. When no placement meets the
    SLO there is nothing to rank: the figure says so, with the nearest
    placements and what they miss, in place of bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not result["best"]["qualifies"]:
        text = no_placement_text(result).replace("; nearest:", ";\nnearest:")
        fig = plt.figure(figsize=(10, 0.3 + 0.2 * (text.count("\n") + 1)))
        fig.text(0.01, 0.5, text, va="center", family="monospace", fontsize=8)
        return fig
    hw = _with_hardware(result)
    priced = result.get("ranked_by") == "cost_per_million_useful_tokens"
    unit = _unit(result)

    def value(c: dict) -> float:
        if not priced:
            return c["goodput_per_gpu"]
        cost = c["cost_per_million_useful_tokens"]
        return math.nan if cost is None else cost

    cands = sorted(result["candidates"], key=lambda c: (c["kind"], c["gpus"], c["num_prefill"], label(c, hw)))
    fig, ax = plt.subplots(figsize=(max(6, (0.65 if hw else 0.45) * len(cands)), 4.5))
    colors = ["tab:purple" if c.get("afd") else "tab:blue" if c["kind"] == "colocated"
              else "tab:green" if c.get("mixed_hardware") else "tab:orange" for c in cands]
    bars = ax.bar(range(len(cands)), [value(c) for c in cands], color=colors)
    for bar, c in zip(bars, cands):  # below the attainment target: hatched, pale
        if not c["qualifies"]:
            bar.set(hatch="//", alpha=0.4)
    best = result["best"]
    for i, c in enumerate(cands):
        if c is best or c == best:
            ax.annotate("best", (i, value(c)), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(cands)), [label(c, hw) for c in cands], rotation=60, fontsize=8)
    ax.set(ylabel="cost per million useful tokens" if priced else f"goodput per {unit['singular']} (req/s)",
           xlabel="placement (C: colocated, P/D: prefill/decode)\nhatched: below the attainment target"
           + ("; green: mixed hardware" if hw else "") + ("; purple: AFD units" if result.get("best_afd") else ""))
    # Two short lines: one long line overran a narrow figure (few candidates).
    ax.set_title(f"kvferry plan: {result['rate']:g} req/s, up to {result['gpus']} {unit['plural']}\n"
                 f"SLO {slo_text(result['slo_ms'])} for {result['min_attainment_pct']:g}%", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
