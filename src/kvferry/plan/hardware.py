"""Hardware pools and their price: what ``kvferry plan --hardware`` lays
out, and the cost lens it ranks placements by.

A hardware is a name, a ``kvferry profile`` JSON measured on it (its step
times) and a price per instance per hour (any currency unit)::

    --hardware fast=h200.json:4.5 --hardware cheap=l4.json:0.8

A placement puts each pool on one hardware: colocated ``C`` instances of
one, or ``P`` prefill instances of one and ``D`` decode instances of
another (the same or not: a mixed layout). Its cost per million useful
tokens is

    sum of instance prices (per hour) * run hours / useful output tokens * 1e6

where the run is the simulated span (first arrival to last finish) and a
useful token is an output token of a request that met every SLO: a fleet
that misses the SLO pays for tokens nobody can use (the formula is
``bench.metrics.cost_per_million_useful_tokens``, which ``kvferry bench
--price-per-hour`` uses too). No torch, no I/O but reading the profiles.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvferry.plan.latency import PlanError, StepCostModel, check_profile_fits

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    profile: str  # path of its kvferry profile JSON
    price_per_hour: float | None  # per instance; None: not priced (plain --profile)
    cost: StepCostModel
    device: str = ""  # what the profile was measured on ("cpu", "cuda"); "": it does not say
    # The parallel layout of its instances (plan/layouts.py): "tp2pp1"; "" for a profile of one layout.
    layout: str = ""
    # What one instance of this layout uses, in instances of the profile's first layout (its ranks'
    # CPUs or GPUs over the first's): what --gpus counts and the price scales by.
    share: float = 1.0
    # The weight format its profile ran ("bf16", "int8", "Q4_K_M"; plan/formats.py): a prefill pool and a
    # decode pool pair only within one format. "": the profile does not say.
    weight_format: str = ""

    @property
    def base_name(self) -> str:
        """The hardware's name without its layout ("fast" of "fast:tp2pp1")."""
        if not self.layout:
            return self.name
        return "profile" if self.name == self.layout else self.name.removesuffix(":" + self.layout)

    def to_json(self) -> dict:
        return {"name": self.name, "profile": self.profile, "price_per_hour": self.price_per_hour,
                "device": self.device, "layout": self.layout or "tp1pp1", "share": self.share,
                "weight_format": self.weight_format}


def profile_device(path: str) -> str:
    """The ``device`` a ``kvferry profile`` JSON names ("cpu", "cuda", ...);
    "" when it names none (a served profile: the client cannot see it)."""
    return _profile_text(path, "device")


def profile_weight_format(path: str) -> str:
    """The ``weight_format`` a ``kvferry profile`` JSON names ("bf16",
    "Q4_K_M", ...); "" when it names none (written before profiles did)."""
    return _profile_text(path, "weight_format")


def _profile_text(path: str, key: str) -> str:
    try:
        value = json.loads(Path(path).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return ""  # StepCostModel.from_profile reports an unreadable profile
    return value if isinstance(value, str) else ""


@dataclass(frozen=True, slots=True)
class DeviceUnit:
    """What one instance of a placement is, in the plan's words: a CPU
    profile's instance is an engine core on the threads it was profiled
    with, not a GPU."""

    singular: str
    plural: str
    column: str  # the table's heading over the instance count

    @classmethod
    def of(cls, devices: Iterable[str]) -> DeviceUnit:
        kinds = {"gpu" if d.startswith("cuda") else d for d in devices}
        if kinds == {"gpu"}:
            return cls("GPU", "GPUs", "GPUs")
        if kinds == {"cpu"}:
            return cls("CPU instance", "CPU instances", "CPU inst")
        return cls("device", "devices", "devices")  # unnamed, or several kinds

    def to_json(self) -> dict:
        return {"singular": self.singular, "plural": self.plural, "column": self.column}


def parse_hardware_spec(text: str) -> tuple[str, str, float]:
    """``NAME=PROFILE.json:PRICE`` -> (name, path, price). The price follows
    the last colon, so a path may hold colons."""
    name, eq, rest = text.partition("=")
    path, colon, price_text = rest.rpartition(":")
    form = f"expected NAME=PROFILE.json:PRICE_PER_HOUR, got {text!r}"
    if not eq or not colon or not path:
        raise PlanError(f"--hardware: {form}")
    if not _NAME.match(name):
        raise PlanError(f"--hardware: the name must be letters, digits, '_', '.' or '-' (at most 64), "
                        f"got {name!r} in {text!r}")
    try:
        price = float(price_text)
    except ValueError:
        price = -1.0
    if not (price >= 0 and math.isfinite(price)):
        raise PlanError(f"--hardware: the price per hour must be a finite number >= 0, got {price_text!r} "
                        f"in {text!r}")
    return name, path, price


def load_hardware(specs: list[str], allow_poor_fit: bool) -> list[Hardware]:
    """Each ``--hardware`` spec with its profile read and checked."""
    out: list[Hardware] = []
    for spec in specs:
        name, path, price = parse_hardware_spec(spec)
        if any(h.name == name for h in out):
            raise PlanError(f"--hardware: {name!r} is given twice")
        check_profile_fits(path, allow_poor_fit, "plan")
        out.append(Hardware(name, path, price, StepCostModel.from_profile(path), profile_device(path),
                            weight_format=profile_weight_format(path)))
    return out


def pick(hardware: list[Hardware], names: str | None, flag: str) -> list[Hardware]:
    """The hardware a pool may use: all, or the comma list ``names``."""
    if names is None:
        return hardware
    chosen: list[Hardware] = []
    for name in (n.strip() for n in names.split(",")):
        # NAME picks each of its layouts (NAME:tp2pp1, plan/layouts.py); NAME:tp2pp1 picks one
        matched = [h for h in hardware if h.name == name or h.name.startswith(name + ":")]
        if not matched:
            known = ", ".join(h.name for h in hardware) or "none: give --hardware NAME=PROFILE.json:PRICE"
            raise PlanError(f"{flag}: no hardware named {name!r} (known: {known})")
        chosen += [h for h in matched if h not in chosen]
    return chosen


def fleet_price_per_hour(counts_and_hardware: list[tuple[int, Hardware]]) -> float | None:
    """The fleet's price per hour; None when any pool is unpriced."""
    if any(h.price_per_hour is None for _, h in counts_and_hardware):
        return None
    return sum(n * h.price_per_hour for n, h in counts_and_hardware)
