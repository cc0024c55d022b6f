"""How many drafts each request gets this step.

Two rules, both cheap and deterministic:

- **Acceptance.** Each request keeps an EWMA of accepted / proposed drafts
  (starting optimistic, at 1). Its k is ``floor(ewma * (k_max + 1))``,
  capped at k_max: a request whose drafts keep failing drops to k = 0 and
  stops paying for verification. A request at k = 0 probes with one draft
  every ``probe_interval`` decode steps, so a text that turns repetitive
  later (a quoted passage, code) wins its drafts back.
- **Batch size.** Verification costs ``k + 1`` token slots per request.
  Drafts are cut so that ``num_running * (k + 1)`` stays within
  ``batch_token_threshold``: at large batches decode is already
  compute-efficient, and drafts would only slow every request down.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class _RequestSpecState:
    acceptance: float = 1.0  # EWMA of accepted / proposed
    steps_without_drafts: int = 0  # decode steps at k = 0 since the last probe


class AdaptiveSpecController:
    def __init__(self, k_max: int, batch_token_threshold: int, ewma_alpha: float = 0.5,
                 probe_interval: int = 8, adaptive: bool = True) -> None:
        self.k_max = k_max
        self.batch_token_threshold = batch_token_threshold
        self.ewma_alpha = ewma_alpha
        self.probe_interval = probe_interval
        self.adaptive = adaptive
        self._states: dict[str, _RequestSpecState] = {}

    def batch_cap(self, num_running: int) -> int:
        """Most drafts per request while ``num_running`` requests decode."""
        if num_running < 1:
            return self.k_max
        return max(0, min(self.k_max, self.batch_token_threshold // num_running - 1))

    def num_drafts(self, request_id: str, num_running: int) -> int:
        """k for this request's next decode step (call once per step)."""
        cap = self.batch_cap(num_running)
        if cap == 0:
            return 0
        if not self.adaptive:
            return cap
        state = self._states.setdefault(request_id, _RequestSpecState())
        k = min(self.k_max, math.floor(state.acceptance * (self.k_max + 1)))
        if k > 0:
            return min(k, cap)
        state.steps_without_drafts += 1
        if state.steps_without_drafts >= self.probe_interval:
            state.steps_without_drafts = 0
            return 1
        return 0

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Record a verified proposal (only steps that proposed: no match
        found is not a rejection)."""
        if num_drafts <= 0 or not self.adaptive:
            return
        state = self._states.setdefault(request_id, _RequestSpecState())
        a = self.ewma_alpha
        state.acceptance = (1 - a) * state.acceptance + a * num_accepted / num_drafts

    def acceptance(self, request_id: str) -> float:
        state = self._states.get(request_id)
        return state.acceptance if state is not None else 1.0

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
