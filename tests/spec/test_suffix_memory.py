"""Suffix decoding's memory where nothing proposes: at a large batch the
default drafts nothing, so the proposer is never asked and its queued
work never runs; finished requests must still keep to each tenant's
budget (before, every one's tokens stayed queued until a proposal)."""
from __future__ import annotations

from kvferry.core.request import RequestStatus
from kvferry.spec import SuffixProposer
from tests.spec.test_suffix import request


def finish(proposer: SuffixProposer, rid: str, tokens: list[int], tenant: str) -> None:
    req = request(rid, tokens, tenant=tenant)
    req.status = RequestStatus.FINISHED_STOPPED
    proposer.finished(req)


def test_requests_finished_while_nothing_proposes_keep_to_the_budget():
    proposer = SuffixProposer(4, max_cached_tokens=1000, max_cached_requests=5)
    for i in range(400):
        finish(proposer, f"r{i}", list(range(i, i + 300)), tenant="ab"[i % 2])
    queued = sum(len(job.tokens or ()) for job in proposer._jobs)
    assert queued <= 2 * 1000, queued  # each tenant's budget: 3 requests of 300 tokens
    assert len(proposer._jobs) <= 2 * 5 + 2 * 64 + 2, len(proposer._jobs)
    # Once the queue runs (proposals do it in slices), the newest requests draft, the evicted ones are gone.
    proposer.work(None)
    assert proposer.propose(request("q", list(range(399, 399 + 20)), tenant="b")) == [419, 420, 421, 422]
    assert len(proposer._jobs) == 0 and proposer._pending == {} and proposer._dropped == 0
    assert proposer.cached_tokens("a") == 900 and proposer.cached_tokens("b") == 900
    proposer.check_integrity()
