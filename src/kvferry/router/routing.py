"""Choosing the worker for a request, from what the router knows now.

``policy.py`` holds the pure cost functions; ``Router`` feeds them: it
gathers the live workers of a role from the membership, the request's
cached overlap on each (its block hashes against the prefix index) and
their load, and records which worker was chosen (the round-robin
tie-break). Kept apart from the client so that the choice can be checked
without any core running.
"""
from __future__ import annotations

import random

from kvferry.core.hashing import ChainKeys, extend_block_hashes
from kvferry.messages import EngineCoreRequest
from kvferry.router.config import RouterConfig
from kvferry.router.membership import Membership
from kvferry.router.policy import Candidate, choose_decode, choose_prefill, uncached_tokens
from kvferry.router.prefix_index import PrefixIndex
from kvferry.router.worker import Worker


class Router:
    """Picks workers for requests; raises the membership's reason when a
    role has no live worker (EngineRestartingError / EngineDeadError)."""

    def __init__(self, members: Membership, config: RouterConfig, index: PrefixIndex,
                 rng: random.Random | None = None) -> None:
        self.members = members
        self.config = config
        self.index = index
        self._rng = rng or random.Random(0)
        self._num_choices = 0

    def choose(self, request: EngineCoreRequest, role: str = "engine") -> tuple[Worker, int]:
        """The worker (of ``role``) to compute this prompt, and the prompt
        tokens it will compute."""
        live = self.members.live(role)
        if not live:
            # A dead fleet answers with its own error, not a role's.
            raise self.members.dead_error or self.members.unavailable(role)
        num_prompt = len(request.prompt_token_ids)
        block_size = self.members.reference.block_size
        if len(live) == 1 and not self.config.slo.enabled:
            chosen = live[0]  # nothing to weigh: skip hashing (today's single-core speed)
            return chosen, uncached_tokens(num_prompt, 0, block_size)
        hashes = self.block_hashes(request)
        candidates = [Candidate(
            name=w.name, cached_blocks=self.index.overlap_blocks(w.name, hashes),
            queued_prefill_tokens=w.queued_prefill_tokens, active_kv_tokens=w.stats.kv_blocks_used * block_size,
            num_in_flight=len(w.requests), kv_usage=w.kv_usage, num_running=w.stats.num_running,
            last_chosen=w.last_chosen) for w in live]
        best = choose_prefill(candidates, num_prompt, block_size, self.config.overlap_weight)
        chosen = self.members.workers[best.name]
        self._num_choices += 1
        chosen.last_chosen = self._num_choices
        return chosen, uncached_tokens(num_prompt, best.cached_blocks, block_size)

    def choose_decode(self) -> Worker:
        """The decode core for a disaggregated request (power of two choices)."""
        live = self.members.live("decode")
        if not live:
            raise self.members.unavailable("decode")
        best = choose_decode([Candidate(w.name, 0, 0, 0, len(w.requests), w.kv_usage, w.stats.num_running)
                              for w in live], self._rng)
        return self.members.workers[best.name]

    def block_hashes(self, request: EngineCoreRequest) -> list[bytes]:
        """The request's own chain, keyed exactly as its core keys it: rooted
        in its namespace, so only its own tenant's (and public) blocks match."""
        ready = self.members.reference
        keys = ChainKeys.of(request.cache_scope, ready.model_fingerprint, ready.kv_dtype)
        hashes: list[bytes] = []
        extend_block_hashes(hashes, request.prompt_token_ids, ready.block_size, keys)
        return hashes
