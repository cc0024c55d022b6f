"""What the scheduler asks of speculative decoding: a proposer of draft
tokens and a budget that sets each request's k. Implemented in ``spec/``
(n-gram, reserved slots for the runner's drafters, the adaptive
controller); typed here so the scheduler stays free of ``spec/``. No torch.
"""
from __future__ import annotations

from typing import Protocol

from kvferry.core.request import Request


class DraftProposer(Protocol):
    """Proposes draft tokens for a running request (n-gram, suffix, draft
    model, heads). The scheduler verifies at most ``num_speculative_tokens``
    of them. A proposer that learns across requests (suffix decoding) also
    has ``finished(request)``, which the scheduler calls as each request
    finishes, its status set and its tokens final."""

    def propose(self, request: Request) -> list[int]: ...


class DraftBudget(Protocol):
    """Decides each request's k per step and learns from verification
    (``kvferry.spec.AdaptiveSpecController``)."""

    def num_drafts(self, request_id: str, num_running: int, tenant: str = "") -> int:
        """k for the request's next step (``tenant``: whose record it starts from)."""
        ...

    def max_drafts(self, num_running: int) -> int:
        """The most drafts any request may get at this batch size (no side
        effects): what KV to keep spare for drafts (0: none pays here)."""
        ...

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None: ...

    def forget(self, request_id: str) -> None: ...
