"""How many drafts each request gets this step.

Two rules, both cheap and deterministic:

- **Acceptance.** Each request keeps an EWMA of accepted / proposed drafts
  (starting optimistic, at 1). Its k is ``floor(ewma * (k_max + 1))``,
  capped at k_max: a request whose drafts keep failing drops to k = 0 and
  stops paying for verification. A request at k = 0 probes with one draft
  every ``probe_interval`` decode steps, so a text that turns repetitive
  later (a quoted passage, code) wins its drafts back.
- **Marginal cost.** Once both step costs of a batch-size bucket are
  measured (below), the acceptance rule above gives way to an expected-gain
  rule: with per-token acceptance a (accepted drafts over accepted drafts
  plus rejections, EWMAs) and a measured marginal cost c of one draft
  token relative to a plain step, k maximizes
  ``(1 + a + a^2 + .. + a^k) / (1 + c k)``. Where a verify window costs
  about what a plain step does (batch 1 on a bandwidth-bound decode, c near
  0) a rejected draft costs nothing and k stays high even at modest
  acceptance; where it costs (c large) only well-accepted drafts pay.
- **Batch size.** Verification costs ``k + 1`` token slots per request.
  Drafts are cut so that ``num_running * (k + 1)`` stays within
  ``batch_token_threshold``: at large batches decode is already
  compute-efficient, and drafts would only slow every request down.
- **Measured cost** (``cost_aware``). The engine reports each decode-only
  step's wall time (``observe_step``). Per batch-size bucket (powers of
  two) the controller keeps EWMAs of the plain step's seconds, the
  speculative step's seconds (draft + verify) and the tokens a request gains
  per speculative step (1 + accepted). Speculation pays while
  ``gain * plain / speculative >= 1``; where it does not, the bucket stops
  drafting. Every ``cost_probe_steps`` steps a bucket runs one step the
  other way, so both costs stay measured and a bucket can switch back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class _BucketCost:
    """EWMAs for one batch-size bucket; None until first measured."""

    plain_s: float | None = None  # seconds per decode step without drafts
    spec_s: float | None = None  # seconds per decode step with drafts
    gain: float | None = None  # tokens per request per speculative step
    drafts: float | None = None  # draft tokens per request per speculative step
    steps: int = 0  # decode steps seen in this bucket

    def draft_cost(self) -> float | None:
        """c: one draft token's cost as a fraction of a plain step."""
        if self.plain_s is None or self.spec_s is None or not self.drafts:
            return None
        return max(0.0, self.spec_s / self.plain_s - 1.0) / self.drafts

    def pays(self) -> bool:
        if self.plain_s is None or self.spec_s is None or self.gain is None:
            return True  # not measured both ways yet: try
        return self.gain * self.plain_s >= self.spec_s


@dataclass(slots=True)
class _RequestSpecState:
    acceptance: float = 1.0  # EWMA of accepted / proposed
    steps_without_drafts: int = 0  # decode steps at k = 0 since the last probe
    # EWMAs of accepted drafts and of rejections per verified proposal:
    # per-token acceptance = accepted / (accepted + rejected). Optimistic start.
    accepted: float = 1.0
    rejected: float = 0.0

    def token_acceptance(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1e-9)


class AdaptiveSpecController:
    def __init__(self, k_max: int, batch_token_threshold: int, ewma_alpha: float = 0.5,
                 probe_interval: int = 8, adaptive: bool = True, cost_aware: bool = True,
                 cost_probe_steps: int = 32, cost_alpha: float = 0.2) -> None:
        self.k_max = k_max
        self.batch_token_threshold = batch_token_threshold
        self.ewma_alpha = ewma_alpha
        self.probe_interval = probe_interval
        self.adaptive = adaptive
        self.cost_aware = cost_aware
        self.cost_probe_steps = cost_probe_steps
        self.cost_alpha = cost_alpha
        self._states: dict[str, _RequestSpecState] = {}
        self._costs: dict[int, _BucketCost] = {}
        self._step_accepted = 0  # accepted drafts reported since the last observe_step

    def batch_cap(self, num_running: int) -> int:
        """Most drafts per request while ``num_running`` requests decode."""
        if num_running < 1:
            return self.k_max
        cap = max(0, min(self.k_max, self.batch_token_threshold // num_running - 1))
        if cap == 0 or not self.cost_aware:
            return cap
        cost = self._costs.get(num_running.bit_length())
        if cost is None or cost.spec_s is None:
            return cap  # measure a speculative step first
        if cost.plain_s is None:
            return 0  # then a plain one, at once
        # A probe step runs the other way from what the measurements say.
        probe = cost.steps % self.cost_probe_steps == self.cost_probe_steps - 1
        return cap if cost.pays() != probe else 0

    def observe_step(self, num_decodes: int, num_draft_tokens: int, seconds: float) -> None:
        """One decode-only step's wall time (the engine calls this after
        the step's outputs were applied, so ``observe`` already counted its
        accepted drafts)."""
        accepted, self._step_accepted = self._step_accepted, 0
        if num_decodes < 1 or seconds <= 0:
            return
        cost = self._costs.setdefault(num_decodes.bit_length(), _BucketCost())
        cost.steps += 1
        a = self.cost_alpha
        if num_draft_tokens == 0:
            cost.plain_s = seconds if cost.plain_s is None else (1 - a) * cost.plain_s + a * seconds
            return
        gain = 1.0 + accepted / num_decodes
        drafts = num_draft_tokens / num_decodes
        cost.spec_s = seconds if cost.spec_s is None else (1 - a) * cost.spec_s + a * seconds
        cost.gain = gain if cost.gain is None else (1 - a) * cost.gain + a * gain
        cost.drafts = drafts if cost.drafts is None else (1 - a) * cost.drafts + a * drafts

    def speedup(self, num_running: int) -> float | None:
        """Measured tokens/s with drafts over without, for this batch size's bucket."""
        cost = self._costs.get(num_running.bit_length())
        if cost is None or cost.plain_s is None or cost.spec_s is None or cost.gain is None:
            return None
        return cost.gain * cost.plain_s / cost.spec_s

    def num_drafts(self, request_id: str, num_running: int) -> int:
        """k for this request's next decode step (call once per step)."""
        cap = self.batch_cap(num_running)
        if cap == 0:
            return 0
        if not self.adaptive:
            return cap
        state = self._states.setdefault(request_id, _RequestSpecState())
        cost = self._costs.get(num_running.bit_length()) if self.cost_aware else None
        c = cost.draft_cost() if cost is not None else None
        if c is not None:
            k = best_k(state.token_acceptance(), c, cap)
        else:
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
        self._step_accepted += max(num_accepted, 0)
        if num_drafts <= 0 or not self.adaptive:
            return
        state = self._states.setdefault(request_id, _RequestSpecState())
        a = self.ewma_alpha
        state.acceptance = (1 - a) * state.acceptance + a * num_accepted / num_drafts
        state.accepted = (1 - a) * state.accepted + a * num_accepted
        state.rejected = (1 - a) * state.rejected + a * (num_accepted < num_drafts)

    def acceptance(self, request_id: str) -> float:
        state = self._states.get(request_id)
        return state.acceptance if state is not None else 1.0

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)


def best_k(acceptance: float, draft_cost: float, cap: int) -> int:
    """The k in [0, cap] with the most expected tokens per unit of step
    cost, ``(1 + a + .. + a^k) / (1 + c k)`` for per-token acceptance a and
    marginal draft cost c (ties: the smaller k)."""
    best, best_rate, tokens, power = 0, 1.0, 1.0, 1.0
    for k in range(1, cap + 1):
        power *= acceptance
        tokens += power
        rate = tokens / (1.0 + draft_cost * k)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best
