"""Weight formats in the plan: a profile is per format.

``kvferry profile`` records the format its model ran in (``weight_format``:
"bf16", "float32", "int8", a GGUF file's type such as "Q4_K_M";
model/weight_format.py). The same model in two formats is two models to the
planner: different step times, and KV that does not carry from one to the
other (the int8 and block formats compute other numbers, and the engine's
fingerprint keeps their prefix caches apart). So:

- a disaggregated placement pairs a prefill pool with a decode pool of the
  same format only (``same_format``): one pool's KV must be the other's;
- when the hardware holds several formats, ``format_choice`` sets each
  format's best placement and its cost per million useful tokens side by
  side, as ``layout_choice`` does for layouts.

A profile that names no format (written before profiles did, or a served
one without ``--weight-format``) is format "": it pairs with others that
name none. No torch.
"""
from __future__ import annotations

from collections.abc import Callable

from kvferry.plan.hardware import Hardware

UNNAMED = "unnamed"  # how the text shows a profile without a format


def same_format(prefill: Hardware, decode: Hardware) -> bool:
    """Whether ``decode`` can take ``prefill``'s KV: the same weight format."""
    return prefill.weight_format == decode.weight_format


def formats_of(hardware: list[Hardware]) -> list[str]:
    """The distinct formats, in the hardware's order."""
    return list(dict.fromkeys(h.weight_format for h in hardware))


def format_choice(candidates: list[dict], rank: Callable[[dict], tuple],
                  label: Callable[[dict, bool], str]) -> dict:
    """Format -> its best placement (by ``rank``: qualifying first, then the
    plan's order), with its cost per million useful tokens, goodput per
    unit and attainment; formats in rank order of their best."""
    best: dict[str, dict] = {}
    for c in candidates:
        fmt = c["weight_format"]
        if fmt not in best or rank(c) < rank(best[fmt]):
            best[fmt] = c
    return {fmt: {"placement": label(c, True), "hardware": c["hardware"],
                  "cost_per_million_useful_tokens": c["cost_per_million_useful_tokens"],
                  "goodput_per_gpu": c["goodput_per_gpu"], "slo_attainment_pct": c["slo_attainment_pct"],
                  "qualifies": c["qualifies"]}
            for fmt, c in sorted(best.items(), key=lambda kv: rank(kv[1]))}


def format_choice_text(result: dict, per: str) -> list[str]:
    """One line per format: its best placement and what it costs."""
    choice = result.get("format_choice") or {}
    if not choice:
        return []
    priced = result.get("ranked_by") == "cost_per_million_useful_tokens"
    lines = ["     weight formats: each format's best placement (a pool pair never mixes formats)"]
    for fmt, c in choice.items():
        cost = c["cost_per_million_useful_tokens"]
        if priced:
            score = "no useful token" if cost is None else f"{cost:.4g} per million useful tokens"
        else:
            score = f"{c['goodput_per_gpu']:.3f} req/s {per}"
        lines.append(f"{fmt or UNNAMED:>19}: {score} at its best ({c['placement']}, "
                     f"{c['slo_attainment_pct']:.1f}% within SLO)" + ("" if c["qualifies"] else ", below target"))
    return lines
