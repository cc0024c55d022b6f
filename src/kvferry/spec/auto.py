"""Method "auto": per request, the drafts of whichever proposer has been
right more often lately: suffix decoding, n-gram prompt lookup and, where
one is configured (``{"method": "auto", "model": HEAD}``), the draft head.

Suffix decoding and prompt lookup propose at every step; each remembers its
draft. At the request's next proposal the tokens appended since then are
known (the accepted drafts and the target's token), so each one's draft is
scored by how many of its leading tokens match them: an EWMA per proposer
and request of tokens it would have had accepted. The request gets the
draft of the proposer with the higher EWMA (suffix, then n-gram, then the
head on ties: the cheaper first), and the next where the chosen one has
none. The two disagree usefully: suffix decoding follows the most frequent
continuation (a tenant's habits), prompt lookup the latest one (the newest
version of a file edited over several turns).

The head drafts in the runner, after the scheduler's plan, so its drafts
are not known here: choosing it reserves k slots (placeholders, as
``ReservedDraftSlots``) and names the request in ``head_requests``, which
the runner reads to fill those slots, and only those. Its score is its
verified acceptance (``observe``, from the controller), counted only when
it drafted; it always has a draft, so it drafts where text gives the other
two no match (chat), and it wins a request back whenever their scores
fall below its own.

Under the adaptive controller (``selection``) the choice is priced: the
request verifies as many of the chosen draft as that method's acceptance
pays (``AdaptiveSpecController.allowed``: the request's own record of the
method, else its tenant's), so that a chat request of a tenant whose
suffix drafts hold, finding no match, does not draft by a head that fails
for the tenant; and a probe is not paid by a head with no record at all.
A new request's scores start from its tenant's record per method, so it
starts on what held for the tenant.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvferry.core.request import Request
from kvferry.spec.ngram import NgramProposer
from kvferry.spec.reserved import ReservedDraftSlots
from kvferry.spec.suffix import SuffixProposer
from kvferry.spec.tree import held

HEAD = "head"


class DraftSelection(Protocol):
    """The controller's side of auto's choice (``spec.adaptive``)."""

    def allowed(self, request_id: str, method: str, num_drafts: int) -> int:
        """How many of a draft by ``method`` the request verifies this step."""
        ...

    def record(self, request_id: str) -> dict[str, float]:
        """The acceptance per method where anything is on record (the
        request's tenant's or its own); empty where nothing is."""
        ...


@dataclass(slots=True)
class _AutoState:
    base: int = 0  # len(all_token_ids) when the drafts below were made
    drafts: dict[str, list[int]] = field(default_factory=dict)
    score: dict[str, float] = field(default_factory=dict)  # EWMA of leading draft tokens that held
    chosen: str = ""  # whose draft the request got last


class AutoProposer:
    def __init__(self, suffix: SuffixProposer, ngram: NgramProposer, ewma_alpha: float = 0.3,
                 head: ReservedDraftSlots | None = None) -> None:
        # In order of preference on ties.
        self.proposers: dict[str, SuffixProposer | NgramProposer | ReservedDraftSlots] = {"suffix": suffix,
                                                                                           "ngram": ngram}
        if head is not None:
            self.proposers[HEAD] = head
        self.suffix = suffix
        self.k = suffix.k  # drafts a proposal makes at most (a tenant's record's scale: ``_start_scores``)
        self.alpha = ewma_alpha
        self._states: dict[str, _AutoState] = {}
        self.num_chosen = {name: 0 for name in self.proposers}  # proposals each one won (stats, tests)
        # Requests whose slots of this step are the head's to fill (the runner reads it).
        self.head_requests: set[str] = set()
        # The adaptive controller, where one runs (``spec.speculation`` sets it):
        # it trims the chosen draft to what that method's acceptance pays.
        self.selection: DraftSelection | None = None

    @property
    def has_head(self) -> bool:
        return HEAD in self.proposers

    def propose(self, request: Request) -> list[int]:
        rid = request.request_id
        state = self._states.get(rid)
        if state is None:
            state = self._states[rid] = _AutoState(score=self._start_scores(rid))
        tokens = request.all_token_ids
        if state.drafts and len(tokens) > state.base:
            new = tokens[state.base : state.base + max(len(d) for d in state.drafts.values())]
            for name, draft in state.drafts.items():
                kept = held(draft, getattr(draft, "parents", None), new)  # a tree: its branch that held
                state.score[name] = (1 - self.alpha) * state.score[name] + self.alpha * kept
        # The head's draft is made later, in the runner: not scored above.
        state.drafts = {name: proposer.propose(request) for name, proposer in self.proposers.items() if name != HEAD}
        state.base = len(tokens)
        ranked = sorted(self.proposers, key=lambda name: -state.score[name])  # stable: ties keep the order
        chosen = next((name for name in ranked if name == HEAD or state.drafts[name]), ranked[0])
        self.num_chosen[chosen] += 1
        state.chosen = chosen
        draft = self.proposers[HEAD].propose(request) if chosen == HEAD else state.drafts[chosen]
        if self.selection is not None and draft:
            draft = draft[: self.selection.allowed(rid, chosen, len(draft))]
        if chosen == HEAD and draft:
            self.head_requests.add(rid)
        else:
            self.head_requests.discard(rid)
        return draft

    def _start_scores(self, rid: str) -> dict[str, float]:
        """A new request's scores: where the controller has a record for it
        (its tenant's), the tokens a proposal of k drafts held at each
        method's acceptance, so that a tenant's request starts on what held
        for the tenant; else as if each held one token a proposal (the order
        of preference breaks ties)."""
        record = self.selection.record(rid) if self.selection is not None else {}
        return {name: record[name] * self.k if name in record else 1.0 for name in self.proposers}

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verified proposal's outcome: the head's score, when it drafted."""
        state = self._states.get(request_id)
        if state is None or state.chosen != HEAD or num_drafts <= 0:
            return
        state.score[HEAD] = (1 - self.alpha) * state.score[HEAD] + self.alpha * num_accepted

    def finished(self, request: Request) -> None:
        self._states.pop(request.request_id, None)
        self.head_requests.discard(request.request_id)
        self.suffix.finished(request)

    def purge_tenant(self, tenant: str) -> int:
        return self.suffix.purge_tenant(tenant)

    def check_integrity(self) -> None:
        self.suffix.check_integrity()
