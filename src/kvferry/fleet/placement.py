"""Where the engine cores of ``kvferry serve --ray ADDRESS`` run: the Ray
cluster's address and the Ray resources each role's actor asks for. Plain
data, validated here (ValueError naming the flag); ray is not imported.

    --ray auto --mode disagg --ray-prefill-resources '{"GPU": 1}' --ray-decode-resources '{"dnode": 1}'
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

DEFAULT_RESOURCES = {"CPU": 1.0}
# Where a TP/PP core's ranks go (--ray-rank-placement): all on one node
# (shared memory, ipc) or over the nodes (tcp with CURVE, docs/parallelism.md).
RANK_PLACEMENTS = ("pack", "spread")
# Ray's placement group strategy for each: a packed group must be on one
# node (its ranks share memory), a spread one goes as wide as Ray can.
RANK_STRATEGIES = {"pack": "STRICT_PACK", "spread": "SPREAD"}
# How long a scale waits for the cluster to place the cores it adds (--scale-timeout-s).
DEFAULT_SCALE_TIMEOUT_S = 60.0
# host:port, [v6]:port, or "auto" (the cluster this node belongs to).
_ADDRESS = re.compile(r"^(auto|[A-Za-z0-9_.-]+:\d{1,5}|\[[0-9A-Fa-f:.]+\]:\d{1,5})$")


def parse_resources(text: str, flag: str) -> dict[str, float]:
    """A JSON object of Ray resource name -> amount >= 0, e.g. '{"GPU": 1}'.
    Raises ValueError naming ``flag``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f'{flag}: must be a JSON object of resource amounts, e.g. {{"GPU": 1}}; got {text!r}')
    resources = {}
    for name, amount in value.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount) or amount < 0:
            raise ValueError(f"{flag}: {name!r} must be a number >= 0, got {amount!r}")
        resources[name] = float(amount)
    return resources


def check_address(address: str) -> str:
    if not _ADDRESS.match(address):
        raise ValueError(f"--ray: must be 'auto' or HOST:PORT of a running Ray cluster, got {address!r}")
    return address


def check_scale_timeout(seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise ValueError(f"--scale-timeout-s: must be a number of seconds > 0, got {seconds!r}")
    return float(seconds)


@dataclass(frozen=True, slots=True)
class RayPlacement:
    address: str  # "auto" or the head's HOST:PORT
    # Ray resources of each role's actor (colocated: engine; disagg: prefill, decode).
    engine_resources: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_RESOURCES))
    prefill_resources: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_RESOURCES))
    decode_resources: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_RESOURCES))
    # A scale whose new cores are not all placed within this fails, naming what is missing.
    scale_timeout_s: float = DEFAULT_SCALE_TIMEOUT_S
    rank_placement: str = "pack"

    def __post_init__(self) -> None:
        check_address(self.address)
        check_scale_timeout(self.scale_timeout_s)
        if self.rank_placement not in RANK_PLACEMENTS:
            raise ValueError(f"--ray-rank-placement: must be one of {', '.join(RANK_PLACEMENTS)}, "
                             f"got {self.rank_placement!r}")

    def resources_of(self, role: str) -> dict[str, float]:
        return {"engine": self.engine_resources, "prefill": self.prefill_resources,
                "decode": self.decode_resources}[role]


def actor_resources(resources: dict[str, float]) -> dict:
    """Ray's actor options for a resource dict: CPU, GPU and memory have
    options of their own, the rest are custom resources. A resource not
    named is not asked for (an actor placed by '{"pnode": 1}' takes no CPU)."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    options: dict = {"num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0)}
    if "memory" in resources:
        options["memory"] = resources["memory"]
    if custom:
        options["resources"] = custom
    return options


def placement_from_args(args) -> RayPlacement | None:
    """RayPlacement from the serve flags; None without --ray. Raises ValueError naming the flag."""
    scale_timeout_s = check_scale_timeout(getattr(args, "scale_timeout_s", DEFAULT_SCALE_TIMEOUT_S))
    if not getattr(args, "ray", None):
        return None
    return RayPlacement(
        check_address(args.ray),
        parse_resources(args.ray_engine_resources, "--ray-engine-resources"),
        parse_resources(args.ray_prefill_resources, "--ray-prefill-resources"),
        parse_resources(args.ray_decode_resources, "--ray-decode-resources"),
        scale_timeout_s,
        getattr(args, "ray_rank_placement", "pack"),
    )


@dataclass(frozen=True, slots=True)
class RankRoom:
    """A TP/PP core's placement group, as its actor gets it: bundle 0 holds
    the core (rank 0), bundles 1..N-1 its other ranks, each with the role's
    ``resources``; ``placement`` is "pack" or "spread"."""

    group: object  # ray.util.placement_group.PlacementGroup (ray is not imported here)
    placement: str
    resources: dict[str, float]
