"""Parallel layouts in the plan: a profile measured at several (TP, PP)
layouts (``kvferry profile --tensor-parallel-sizes 1,2``,
``bench/profile_layouts.py``) becomes one ``Hardware`` per layout, so that
the placement search tries each pool (colocated, prefill, decode) on each
layout as it tries each hardware.

- **Step time**: the layout's own fit. It was measured on the whole
  layout, so it already holds the all-reduces (TP), the stage hops and
  what the micro-batches overlap (PP): a PP instance's step is the
  measured pipeline step, not one stage's share recomputed. The profile's
  served overheads (request overhead, first-token delay, step noise, host
  sharing) apply to every layout.
- **Cost** (``share``): what one instance of the layout uses, counted in
  instances of the profile's first layout (TP 1 PP 1 when it was measured):
  on a GPU profile its ranks (one GPU each) over the first's; on a CPU
  profile its CPUs (ranks x threads per rank) over the first's. A CPU
  profile splits one budget over every layout's ranks, so each layout
  costs the same host and the plan compares their speed on it. ``--gpus``
  counts shares and a priced hardware's price is per share.

A profile of one TP 1 PP 1 layout (every profile written before layouts)
stays one hardware under its own name, as before.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from kvferry.bench.step_cost import layouts_of, poor_fits
from kvferry.plan.hardware import Hardware
from kvferry.plan.latency import PlanError, StepCostModel


def _share(layout: dict, first: dict, device: str) -> float:
    """One instance of ``layout`` in instances of ``first`` (see the module doc)."""
    if not device.startswith("cuda") and layout.get("cpus") and first.get("cpus"):
        return float(layout["cpus"]) / float(first["cpus"])
    return float(layout.get("ranks") or 1) / float(first.get("ranks") or 1)


def layout_hardware(hw: Hardware, allow_poor_fit: bool = False) -> list[Hardware]:
    """``hw`` once per layout of its profile (named ``NAME:tp2pp1``, or
    ``tp2pp1`` for a plain --profile), each with that layout's step fits,
    share and price. A layout whose fits are poor is refused unless
    ``allow_poor_fit`` (the profile's top-level fits are checked already)."""
    try:
        data = json.loads(Path(hw.profile).read_text())
        layouts = layouts_of(data)
        if len(layouts) == 1 and layouts[0].get("name", "tp1pp1") == "tp1pp1":
            return [hw]
        out = []
        for layout in layouts:
            name = str(layout["name"])
            if problems := poor_fits(layout):
                if not allow_poor_fit:
                    raise PlanError(f"--profile: {hw.profile}: layout {name}: {'; '.join(problems)} "
                                    "(or pass --allow-poor-fit to use it anyway)")
                print(f"kvferry: WARNING: --profile {hw.profile}: layout {name}: {'; '.join(problems)}; "
                      "--allow-poor-fit: using it anyway", file=sys.stderr, flush=True)
            share = _share(layout, layouts[0], hw.device)
            out.append(replace(hw, name=name if hw.price_per_hour is None and hw.name == "profile"
                               else f"{hw.name}:{name}",
                               cost=StepCostModel.from_json(data, layout), layout=name, share=share,
                               # a .gguf expanded over ranks ran another format than its TP 1 layout
                               weight_format=str(layout.get("weight_format") or hw.weight_format),
                               price_per_hour=None if hw.price_per_hour is None else hw.price_per_hour * share))
        return out
    except OSError as e:
        raise PlanError(f"--profile: cannot read {hw.profile}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise PlanError(f"--profile: {hw.profile}: its layouts are not a kvferry profile's: {e}") from None


def units(n: int, hw: Hardware) -> float:
    """What ``n`` instances of ``hw`` use, in the units --gpus counts."""
    return n * hw.share


def count_text(value: float) -> str:
    """2, 1.5: a whole count without its decimal point."""
    return f"{value:g}"
