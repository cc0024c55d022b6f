"""Attention/FFN disaggregation's settings (``--mode afd``; no torch: config.py
imports it, and ``kvferry serve``'s preflight reads it before anything starts).

    AFDConfig(ffn_workers, folder)   0 FFN workers: off (the core runs its own MLPs); folder
                                     "ray:NAME": the workers are Ray actors (kvferry serve --ray)
    add_ray_ffn_args(group)          --ray-ffn-resources
    check_afd(config)                ValueError (one line) for the first thing it does not run with yet

The engine side is kvferry.engine.afd_leader (the FFN processes and their
sockets) and afd_runner (the attention core's step); docs/parallelism.md
has the picture.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class AFDConfig:
    """``ffn_workers``: processes that hold the feed-forward half of every
    layer (a dense MLP's intermediate columns, or whole experts, split over
    them); 0: off. ``folder``: the 0700 folder of their ipc sockets, shared
    by every attention core of one server (they batch all of them); None:
    the core makes a private one and its FFN workers serve it alone;
    ``ray:NAME`` under ``kvferry serve --ray``: the workers are Ray actors,
    published by the server's board actor NAME (fleet/ffn_actors.py), as
    the cores of other nodes cannot share a folder."""

    ffn_workers: int = 0
    folder: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ffn_workers, bool) or not isinstance(self.ffn_workers, int) or self.ffn_workers < 0:
            raise ValueError(f"ffn must be an integer >= 0 (FFN workers of --mode afd), got {self.ffn_workers!r}")

    @property
    def enabled(self) -> bool:
        return self.ffn_workers > 0

    @property
    def board(self) -> str | None:
        """The Ray actor that publishes the workers (``folder`` "ray:NAME"), or None: a folder."""
        return self.folder[len(RAY_BOARD):] if self.folder and self.folder.startswith(RAY_BOARD) else None


RAY_BOARD = "ray:"  # AFDConfig.folder's prefix for workers placed by Ray


def add_ray_ffn_args(group: Any) -> None:
    """``--ray-ffn-resources``: where the FFN workers of ``--mode afd --ray`` go, as the cores' flags say theirs."""
    group.add_argument("--ray-ffn-resources", default='{"CPU": 1}', metavar="JSON",
                       help='--mode afd under --ray: Ray resources of each FFN worker\'s actor, e.g. a custom node '
                            'resource \'{"fnode": 1}\' to put them on the nodes that offer it; a worker on an '
                            'attention core\'s node talks to it over ipc, one on another node over tcp with CURVE')


def afd_refusals(config: Any) -> list[str]:
    """What an EngineConfig asks that attention/FFN disaggregation does not
    run with yet (an empty list: it runs)."""
    if not config.parallel.afd.enabled:
        return []
    par = config.parallel
    refused = [
        (config.model.device != "cpu", f"device {config.model.device!r} (FFN workers run on the CPU)"),
        # an FFN worker batches every core's rows, through matmuls that are not the batch-invariant ones
        (config.model.deterministic, "deterministic"),
        (par.tensor_parallel_size > 1, f"tensor_parallel_size {par.tensor_parallel_size}"),
        (par.pipeline_parallel_size > 1, f"pipeline_parallel_size {par.pipeline_parallel_size}"),
    ]
    return [f"attention/FFN disaggregation (ffn {par.afd.ffn_workers}) does not work with {what} yet"
            for bad, what in refused if bad]


def check_afd(config: Any) -> None:
    """EngineConfig's check: the first of ``afd_refusals`` as a ValueError."""
    for refusal in afd_refusals(config)[:1]:
        raise ValueError(refusal)
