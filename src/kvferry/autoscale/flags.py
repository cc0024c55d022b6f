"""The ``--autoscale*`` flags of ``kvferry serve`` and their defaults.

Imports nothing but the standard library: the argument parser builds these
flags on every start, with or without ``--autoscale``, and the planner that
a decision needs is ``policy.py``'s to import.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

DEFAULT_INTERVAL_S = 30.0
DEFAULT_WINDOW_S = 60.0
DEFAULT_MAX_CORES = 8
DEFAULT_DOWN_AFTER = 3
DEFAULT_COOLDOWN_S = 120.0
DEFAULT_MIN_REQUESTS = 10
DEFAULT_MIN_ATTAINMENT = 90.0
DEFAULT_HISTORY = 100


def _positive(value: Any, flag: str, allow_zero: bool = False) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value >= 0 if allow_zero else value > 0)):
        raise ValueError(f"{flag} must be a number {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def parse_counts(text: str, flag: str) -> dict[str, int]:
    """``engine=2`` or ``prefill=1,decode=2`` -> counts; ValueError naming ``flag``."""
    out: dict[str, int] = {}
    for part in text.split(","):
        role, eq, value = part.partition("=")
        role = role.strip()
        if not eq or role not in ("engine", "prefill", "decode") or not value.strip().isdigit():
            raise ValueError(f"{flag}: expected ROLE=N[,ROLE=N] with ROLE engine, prefill or decode, got {text!r}")
        if role in out:
            raise ValueError(f"{flag}: {role} is given twice in {text!r}")
        out[role] = int(value)
    return out


def add_autoscale_args(parser: argparse.ArgumentParser) -> None:
    """The ``--autoscale*`` flags of ``kvferry serve``."""
    g = parser.add_argument_group("autoscaling (cores per role follow the measured load)")
    g.add_argument("--autoscale", default=None, metavar="PROFILE",
                   help="scale the cores to the measured arrival rate and lengths: every interval, kvferry plan's "
                        "analytic model with this kvferry profile JSON picks the fewest cores that keep the SLO "
                        "(--autoscale-slo); decisions are logged and listed by GET /v1/admin/scale")
    g.add_argument("--autoscale-slo", default=None, metavar="ttft:MS,tpot:MS",
                   help="the SLO the layout must keep (also e2e, itl); default: --ttft-slo-ms and --tpot-slo-ms")
    g.add_argument("--autoscale-min", default=None, metavar="ROLE=N[,ROLE=N]",
                   help="fewest cores per role: engine=N (colocated) or prefill=P,decode=D (disagg); default 1 each")
    g.add_argument("--autoscale-max", default=None, metavar="ROLE=N[,ROLE=N]",
                   help="most cores per role, as --autoscale-min; default: --autoscale-max-cores less the other "
                        "roles' minimum")
    g.add_argument("--autoscale-max-cores", type=int, default=DEFAULT_MAX_CORES,
                   help="most cores in all roles together")
    g.add_argument("--autoscale-interval-s", type=float, default=DEFAULT_INTERVAL_S,
                   help="seconds between decisions")
    g.add_argument("--autoscale-window-s", type=float, default=DEFAULT_WINDOW_S,
                   help="the measured rate and lengths are those of the requests that arrived in the last this "
                        "many seconds")
    g.add_argument("--autoscale-down-after", type=int, default=DEFAULT_DOWN_AFTER, metavar="K",
                   help="scale down only after a smaller layout has been the answer for K consecutive intervals "
                        "(scaling up is immediate)")
    g.add_argument("--autoscale-cooldown-s", type=float, default=DEFAULT_COOLDOWN_S,
                   help="and only this many seconds after the last change")
    g.add_argument("--autoscale-min-requests", type=int, default=DEFAULT_MIN_REQUESTS,
                   help="fewer finished requests in the window than this: too few to plan from, keep the counts")
    g.add_argument("--autoscale-min-attainment", type=float, default=DEFAULT_MIN_ATTAINMENT,
                   help="percent of requests a layout must keep within the SLO (as kvferry plan --min-attainment)")
    g.add_argument("--autoscale-allow-poor-fit", action="store_true",
                   help="use a profile whose fits are poor (a busy machine's) instead of refusing it; a warning "
                        "says so")
