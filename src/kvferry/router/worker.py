"""One engine core as the router sees it: how to reach it, what it told us,
what we routed to it, and whether it still answers."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvferry.types.stats import SchedulerStats
from kvferry.engine.core_client import CoreConnection, CoreProcess
from kvferry.messages import EngineCoreReady
from kvferry.router.admission import StepTimeModel


@dataclass(eq=False)
class Worker:
    name: str  # "engine-0", also its process title after "kvferry: "
    role: str  # see config.ROLES
    address: str  # how it was reached (a base address, or its input address)
    connection: CoreConnection
    ready: EngineCoreReady
    # The process, when this server started it; None for a joined core.
    process: CoreProcess | None = None
    # Started or handed over by this server: shut down with it. A joined core
    # is left running (its requests are aborted) when the server stops.
    owned: bool = True
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    step_model: StepTimeModel = field(default_factory=StepTimeModel)
    # Child request id -> prompt tokens it still had to compute when routed;
    # dropped at its first token (or its end).
    queued_prefill: dict[str, int] = field(default_factory=dict)
    # Parent request ids routed here and not finished.
    requests: set[str] = field(default_factory=set)
    num_routed: int = 0  # cumulative
    last_chosen: int = 0
    alive: bool = True
    accepting: bool = True  # False once it is leaving
    dead_reason: str | None = None
    # Dead, and the server is starting its process again (a started core only).
    restarting: bool = False
    num_restarts: int = 0  # how often this core's process was started again
    last_heard: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.stats.kv_blocks_total == 0:
            self.stats = SchedulerStats(kv_blocks_total=self.ready.num_kv_blocks)

    @property
    def queued_prefill_tokens(self) -> int:
        return sum(self.queued_prefill.values())

    @property
    def kv_usage(self) -> float:
        return self.stats.kv_blocks_used / max(1, self.stats.kv_blocks_total)

    def describe(self, num_index_blocks: int) -> dict:
        """The admin view (GET /v1/admin/workers)."""
        s = self.stats
        return {
            "name": self.name, "role": self.role, "address": self.address, "alive": self.alive,
            "accepting": self.accepting, "error": self.dead_reason, "restarting": self.restarting,
            "num_restarts": self.num_restarts,
            "pid": self.ready.pid, "num_requests": len(self.requests), "num_routed": self.num_routed,
            "queued_prefill_tokens": self.queued_prefill_tokens, "cached_blocks": num_index_blocks,
            "num_running": s.num_running, "num_waiting": s.num_waiting,
            "kv_blocks_used": s.kv_blocks_used, "kv_blocks_total": s.kv_blocks_total,
            "prefix_queries": s.prefix_queries, "prefix_hits": s.prefix_hits,
            "speculative": self.ready.speculative, "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_tokens,
            "prompt_tokens_computed": s.num_prompt_tokens_computed,
            "draft_prompt_tokens_computed": s.num_draft_prompt_tokens_computed,
            "step_model": self.step_model.fit(),
            "tensor_parallel_size": max(1, (len(self.ready.ranks) - self.ready.ffn_workers)
                                        // self.ready.pipeline_parallel_size),
            "pipeline_parallel_size": self.ready.pipeline_parallel_size,
            "ffn_workers": self.ready.ffn_workers,
            "ranks": self.describe_ranks(),
        }

    def describe_ranks(self) -> list[dict]:
        """Its tensor-parallel ranks as of the last heartbeat, rank 0 first
        ([]: one process). A dead core's ranks are dead with it (its group
        ends whole), whatever its last beat said."""
        return [{"rank": r.rank, "pid": r.pid, "cpu_threads": r.cpu_threads, "alive": r.alive and self.alive,
                 "node": r.node or None} for r in self.ready.ranks]
