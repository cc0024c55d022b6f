"""A fast analytic instance model for fleet-scale runs (``--fast``).

Per request, not per step, so a million requests over a thousand instances
take minutes rather than hours. What it keeps and what it drops:

- Prefill is one FCFS server per instance (an M/G/1 queue): a prompt starts
  when the previous one ends; its time is the profile's time of its chunks
  (``max_num_batched_tokens`` each) after the prefix-cache hit
  (``PrefixCache``, LRU over blocks).
- Decode is a batch whose size is the number of requests decoding when a
  request starts (capped by ``max_num_seqs``: beyond it a request waits for
  the earliest to finish); its TPOT is the decode step at that batch size
  and the batch's mean context, held for the request's whole decode.
- Colocated: each prefill chunk's step also carries the running decodes
  (their per-step cost is added, their tokens shrink the chunk), and a decode's TPOT is the mean
  step time given the share of time spent in mixed (prefill chunk +
  decodes) steps.
- A served profile's parts: the request overhead and the hand-over as in
  the scheduler mode; the mixed-step cost inside every step it prices; the
  step noise as its mean ratio (prefill and decode steps apart: a mean
  step, no drawn spread, so the p99s see no step-time tail); host sharing
  (``--instances-per-host`` > 1) as a prefill slowed by the whole prefill
  factor when an instance of its host is decoding as it starts, and a
  decode's steps slowed in proportion to the busy share of the prefills
  on its host (``1 + share * (factor - 1)``).
It ignores chunk boundaries, preemption, the exact batch evolution, the
disagg routing hop (a busy decode core admitting a request at its next
step) and the first-token delay; ``kvferry simulate`` without ``--fast``
runs the real scheduler.
"""
from __future__ import annotations

import heapq

from kvferry.plan.cache_model import PrefixCache
from kvferry.plan.instance import InstanceConfig
from kvferry.plan.latency import StepCostModel
from kvferry.plan.workload import SimRequest

_MAX_PREFILL_SHARE = 0.9


class AnalyticInstance:
    mode = "fast-analytic"

    def __init__(self, name: str, role: str, cost: StepCostModel, config: InstanceConfig,
                 cache_blocks: int | None) -> None:
        self.name, self.role, self.cost, self.config = name, role, cost, config
        self.cache = PrefixCache(cache_blocks)
        self.prefill_free_at = 0.0
        self.prefill_busy = 0.0
        self.first_arrival: float | None = None
        self.busy_time = 0.0
        self.decoding: list[tuple[float, int]] = []  # heap of (decode end, context at mid-decode)
        self.context_sum = 0
        self.ends: list[float] = []  # heap of outstanding requests' end times
        # the mean of the measured step spread (1 without one)
        noise = cost.noise
        self.prefill_scale = noise.mean(True) if noise is not None else 1.0
        self.decode_scale = noise.mean(False) if noise is not None else 1.0
        self.host_mates: list[AnalyticInstance] = []  # other instances of its host (host sharing applies)

    @property
    def num_outstanding(self) -> int:
        return len(self.ends)

    def expire(self, now: float) -> None:
        while self.ends and self.ends[0] <= now:
            heapq.heappop(self.ends)

    def prefill(self, req: SimRequest, now: float) -> float:
        """Queue the prompt; returns when its first token is out."""
        if self.first_arrival is None:
            self.first_arrival = now
        hit_blocks = self.cache.access(req.block_keys) if self.config.enable_prefix_caching else 0
        cached = min(hit_blocks * req.key_block_size, req.input_len - 1)
        new = req.input_len - cached
        start = max(now, self.prefill_free_at)
        batch = 0
        if self.role == "colocated":
            self._expire_decodes(start)
            batch = len(self.decoding)
        # chunks of what the step budget leaves after the decodes, each attending to the ones before
        budget = max(self.config.max_num_batched_tokens - batch, 1)
        t, done = 0.0, 0
        while done < new:
            chunk = min(budget, new - done)
            t += self.cost.step([(chunk, cached + done)], batch, self.context_sum if batch else 0)
            done += chunk
        t *= self.prefill_scale * self._prefill_sharing(start)
        self.prefill_free_at = start + t
        self.prefill_busy += t
        self.busy_time += t
        return self.prefill_free_at

    def decode(self, req: SimRequest, start: float, num_tokens: int) -> float:
        """Decode ``num_tokens`` tokens from ``start``; returns the end time."""
        if num_tokens <= 0:
            return start
        self._expire_decodes(start)
        while len(self.decoding) >= self.config.max_num_seqs:
            end, context = heapq.heappop(self.decoding)
            self.context_sum -= context
            start = max(start, end)
            self._expire_decodes(start)
        context = req.input_len + req.output_len // 2
        batch = len(self.decoding) + 1
        mean_context = (self.context_sum + context) / batch
        tpot = self.cost.decode_step(batch, mean_context) * self.decode_scale
        if self.role == "colocated" and self.first_arrival is not None and start > self.first_arrival:
            tpot = self._colocated_tpot(tpot, batch, mean_context, start)
        tpot *= self._decode_sharing(start)
        end = start + num_tokens * tpot
        heapq.heappush(self.decoding, (end, context))
        self.context_sum += context
        self.busy_time += num_tokens * tpot / batch  # this request's share of the decode steps
        return end

    def _colocated_tpot(self, decode_only: float, batch: int, mean_context: float, now: float) -> float:
        """Mean step time a decode sees: a share ``s`` of the time goes to
        mixed steps (a full prefill chunk plus the decodes, ``t_mixed``), the
        rest to decode-only steps; one token per step, so the mean over steps
        is the harmonic mix ``1 / (s / t_mixed + (1 - s) / t_decode)``."""
        share = min(self.prefill_busy / (now - self.first_arrival), _MAX_PREFILL_SHARE)
        chunk = max(self.config.max_num_batched_tokens - batch, 1)
        mixed = self.cost.step([(chunk, 0)], batch, int(batch * mean_context))
        return 1.0 / (share / mixed + (1.0 - share) / decode_only)

    def _prefill_sharing(self, start: float) -> float:
        """A prefill starting while an instance of its host decodes runs
        slower by the whole prefill factor."""
        sharing = self.cost.host_sharing
        if sharing is None or not self.host_mates:
            return 1.0
        for mate in self.host_mates:
            mate._expire_decodes(start)
        return sharing.prefill if any(mate.decoding for mate in self.host_mates) else 1.0

    def _decode_sharing(self, start: float) -> float:
        """Decode steps slow in proportion to the busy share of the prefills
        of its host so far."""
        sharing = self.cost.host_sharing
        if sharing is None or not self.host_mates:
            return 1.0
        share = 0.0
        for mate in self.host_mates:
            if mate.first_arrival is not None and start > mate.first_arrival:
                share = max(share, min(mate.prefill_busy / (start - mate.first_arrival), 1.0))
        return 1.0 + share * (sharing.decode - 1.0)

    def _expire_decodes(self, now: float) -> None:
        while self.decoding and self.decoding[0][0] <= now:
            self.context_sum -= heapq.heappop(self.decoding)[1]

    def track(self, end: float) -> None:
        heapq.heappush(self.ends, end)

    def cache_stats(self) -> tuple[int, int]:
        return self.cache.query_blocks, self.cache.hit_blocks
