"""Scheduler counters the engine reports (for /metrics). No torch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0  # cumulative
    num_swapped_out: int = 0  # cumulative preemptions that swapped
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queries: int = 0  # cumulative tokens
    prefix_hits: int = 0
    prefix_hits_public: int = 0  # of prefix_hits, tokens in declared public prefixes
    # Per cache owner (tenant, or the public pool under its namespace): the
    # columns of kv_manager.OWNER_STAT_FIELDS (queries, hits, public_hits,
    # refused_blocks, evicted_blocks, cached_blocks).
    prefix_by_owner: dict[str, list[int]] = field(default_factory=dict)
    num_drafts: int = 0  # cumulative verified proposals (steps that carried drafts)
    num_draft_tokens: int = 0  # cumulative
    num_accepted_tokens: int = 0  # cumulative drafts accepted
    # Cumulative drafts accepted at each draft position (index 0: the first draft).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Cumulative prompt positions the target's forward pass computed, and the
    # draft model's (method "draft"). A decode core that received a prompt's
    # KV (and its draft's) computes none of them.
    num_prompt_tokens_computed: int = 0
    num_draft_prompt_tokens_computed: int = 0
    # The node's KV store below the device pool (cumulative tokens / blocks).
    kv_store_queries: int = 0  # tokens looked up past the device hit
    kv_store_hits: int = 0  # of those, tokens some tier held
    kv_loaded_tokens: int = 0  # tokens whose KV a load filled
    kv_partial_loads: int = 0  # loads that came back short (the rest recomputed)
    kv_saved_blocks: int = 0  # blocks ordered written down
    # Cumulative engine steps that ran a batch, and the seconds they took (the
    # core's own clock: schedule, forward pass, update). Busy time as the core
    # sees it, without HTTP, IPC or idle waits; a simulator's step model
    # can be checked against it run by run.
    num_steps: int = 0
    step_seconds: float = 0.0
    # Per tier, from the store's own stats (hits, misses, bytes read and
    # written, quarantined, refused writes, load seconds); empty without a store.
    kv_tiers: dict[str, dict[str, float]] = field(default_factory=dict)
    # Which store those come from (its address): cores of one node share one,
    # on a Ray cluster each node has its own; merged once per store.
    kv_store_id: str = ""
    # Per tier, per tenant: [hits, misses] (blocks, cumulative).
    kv_tier_tenants: dict[str, dict[str, list[int]]] = field(default_factory=dict)
