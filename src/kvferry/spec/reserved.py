"""Scheduler side of proposers that run in the model runner (a draft model).

Their drafts come from a forward pass, so the scheduler cannot see them
when it plans a step. It reserves the slots instead: ``propose`` returns k
placeholder ids, the scheduler allocates KV for 1 + k tokens and trims k by
its budget as for any drafts, and the runner writes the real drafts over the
placeholders before verification. Acceptance is counted from how many
tokens come back, so the scheduler never needs the real ids.
"""
from __future__ import annotations

from kvferry.core.request import Request

PLACEHOLDER_ID = 0  # a valid id, so nothing that reads a placeholder by mistake indexes out of range


class ReservedDraftSlots:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    def propose(self, request: Request) -> list[int]:
        return [PLACEHOLDER_ID] * self.k
