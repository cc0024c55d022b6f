"""Room on the Ray cluster for the cores a scale adds, reserved before any
of them starts, all or none.

    groups = await reserve([("engine-2", "engine", {"CPU": 1.0}), ...], timeout_s=60)
    # {name: PlacementGroup}: each new core's actor is created in its group
    release(groups.values())

Each new core gets a one-bundle placement group of its role's resources.
Ray keeps a request no node can meet pending (an autoscaler may add a node
for it), so an actor created straight away would wait, unplaced, until the
engine start timeout (10 minutes by default) with the scale and every later
one blocked behind it. Reserving first bounds that wait by
``--scale-timeout-s`` and makes the scale all or none: when one core cannot
be placed, every group this call made is removed again and
CorePlacementError names the core, what it needs and what the cluster has
free, so the pools stay as they were. A cancel (the server stopping) removes
them too.

A tensor- or pipeline-parallel core's room is one group of a bundle per
rank (bundle 0: the core's own actor), packed on one node (STRICT_PACK) or
spread (SPREAD) by --ray-rank-placement; its start reserves it too
(``reserve_now``), bounded by --scale-timeout-s, so that a group the
cluster cannot place fails in time, naming what it needs.

Imports ray: only ``kvferry serve --ray`` imports this module.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from kvferry.router.scaling import CorePlacementError

logger = logging.getLogger(__name__)

# How often a pending group's state is read from Ray's control store: each
# read is one small RPC; a scale waits seconds at least (a model load).
_POLL_S = 0.25


def bundle_of(resources: dict[str, float]) -> dict[str, float] | None:
    """A core's resources as a placement group bundle: the amounts > 0
    (Ray refuses a bundle of zeros). None when there is nothing to reserve
    (an actor asking for no resource is placed anywhere at once)."""
    bundle = {name: amount for name, amount in resources.items() if amount > 0}
    return bundle or None


def _amount(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _resources(values: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {_amount(amount)}" for name, amount in values.items()) + "}"


def why_unplaced(name: str, role: str, bundle: dict[str, float], free: dict[str, float],
                 total: dict[str, float], ranks: int = 1, strategy: str = "STRICT_PACK") -> str:
    """One line: which core, what it needs, what the cluster has free of
    what it has, e.g. "cannot place engine core engine-2: needs {CPU: 1},
    cluster has {CPU: 0} free of 2". Memory amounts are bytes, as Ray's."""
    has = _resources({k: free.get(k, 0.0) for k in bundle})
    of = _resources({k: total.get(k, 0.0) for k in bundle})
    if len(bundle) == 1:
        of = _amount(total.get(next(iter(bundle)), 0.0))
    if ranks > 1:
        on = "all on one node" if strategy == "STRICT_PACK" else "over the nodes"
        group = f"its {ranks} ranks need {_resources(bundle)} each, {on} ({strategy}; --ray-rank-placement)"
        return (f"cannot place {role} core {name}: {group}, cluster has {has} free of {of}"
                f" (ray status lists each node's resources)")
    line = f"cannot place {role} core {name}: needs {_resources(bundle)}, cluster has {has} free of {of}"
    missing = [k for k in bundle if total.get(k, 0.0) < bundle[k]]
    if missing:
        line += f" (no node offers {', '.join(missing)} enough: ray status lists each node's resources)"
    elif all(free.get(k, 0.0) >= v for k, v in bundle.items()):
        line += " (free across nodes, but no single node has it all)"
    return line


async def reserve(cores: list[tuple[str, str, dict[str, float]]], timeout_s: float,
                  shapes: dict[str, tuple[int, str]] | None = None) -> dict[str, PlacementGroup]:
    """A placement group for each (name, role, resources) with resources to
    reserve, all created together; returns once every one is placed.
    ``shapes``: a role's (ranks, strategy) when its cores are TP/PP groups. Raises
    CorePlacementError (after removing every group made here) when one is
    not placed within ``timeout_s``; a cancel removes them all as well."""
    groups: dict[str, PlacementGroup] = {}
    wanted: dict[str, tuple[str, dict[str, float]]] = {}
    try:
        for name, role, resources in cores:
            bundle = bundle_of(resources)
            if bundle is not None:
                # STRICT_PACK: the one bundle on one node, as the actor needs it.
                # Unnamed: two servers on one cluster both have an "engine-1".
                ranks, strategy = (shapes or {}).get(role, (1, "STRICT_PACK"))
                groups[name] = placement_group([bundle] * ranks, strategy=strategy)
                wanted[name] = (role, bundle)
        deadline = time.monotonic() + timeout_s
        pending = dict(groups)
        while pending:
            states = await asyncio.to_thread(lambda: {n: placement_group_table(g)["state"]
                                                      for n, g in pending.items()})
            pending = {n: g for n, g in pending.items() if states[n] != "CREATED"}
            if pending and time.monotonic() >= deadline:
                name = next(iter(pending))
                role, bundle = wanted[name]
                # Read while this scale's other groups still hold their share:
                # what was free to the core that could not be placed.
                free, total = await asyncio.to_thread(lambda: (ray.available_resources(), ray.cluster_resources()))
                placed = len(groups) - len(pending)
                line = why_unplaced(name, role, bundle, free, total, *(shapes or {}).get(role, (1, "STRICT_PACK")))
                if len(groups) > 1:
                    line += f"; {placed} of this scale's {len(groups)} new cores could be placed"
                raise CorePlacementError(f"{line}; no core was added (waited {timeout_s:g} s, --scale-timeout-s)")
            if pending:
                await asyncio.sleep(_POLL_S)
    except BaseException:
        release(groups.values())
        raise
    return groups


def reserve_now(name: str, role: str, resources: dict[str, float], ranks: int, strategy: str,
                timeout_s: float) -> PlacementGroup | None:
    """A TP/PP core's group at the server's start (no event loop runs yet):
    ``ranks`` bundles of ``resources``, placed by ``strategy``; None when
    there is nothing to reserve. Raises CorePlacementError (the group
    removed) when it is not placed within ``timeout_s``."""
    bundle = bundle_of(resources)
    if bundle is None:
        return None
    group = placement_group([bundle] * ranks, strategy=strategy)
    deadline = time.monotonic() + timeout_s
    while placement_group_table(group)["state"] != "CREATED":
        if time.monotonic() >= deadline:
            release([group])
            line = why_unplaced(name, role, bundle, ray.available_resources(), ray.cluster_resources(), ranks,
                                strategy)
            raise CorePlacementError(f"{line} (waited {timeout_s:g} s, --scale-timeout-s)")
        time.sleep(_POLL_S)
    return group


def release(groups: Iterable[PlacementGroup]) -> None:
    """Remove placement groups (and whatever actor runs in one); a group
    already gone is no error."""
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception as exc:  # noqa: BLE001 - Ray raises several kinds; gone or unreachable, nothing to do
            logger.debug("placement group %s: %s", group.id.hex(), exc)
