"""Method "auto": per request, the drafts of whichever proposer has been
right more often lately, suffix decoding or n-gram prompt lookup.

Both propose at every step; each remembers its draft. At the request's next
proposal the tokens appended since then are known (the accepted drafts and
the target's token), so each proposer's draft is scored by how many of its
leading tokens match them: an EWMA per proposer and request of tokens it
would have had accepted. The request gets the draft of the proposer with
the higher EWMA (suffix on ties, and the other where the chosen one has
none). The two disagree usefully: suffix decoding follows the most
frequent continuation (a tenant's habits), prompt lookup the latest one
(the newest version of a file edited over several turns).

Drafts of the runner's drafters (the head, a draft model) are not among
the choices: they are made after the scheduler's plan, per batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.core.request import Request
from kvferry.spec.ngram import NgramProposer
from kvferry.spec.suffix import SuffixProposer


@dataclass(slots=True)
class _AutoState:
    base: int = 0  # len(all_token_ids) when the drafts below were made
    drafts: dict[str, list[int]] = field(default_factory=dict)
    score: dict[str, float] = field(default_factory=dict)  # EWMA of leading draft tokens that held


class AutoProposer:
    def __init__(self, suffix: SuffixProposer, ngram: NgramProposer, ewma_alpha: float = 0.3) -> None:
        self.proposers = {"suffix": suffix, "ngram": ngram}  # in order of preference on ties
        self.suffix = suffix
        self.alpha = ewma_alpha
        self._states: dict[str, _AutoState] = {}
        self.num_chosen = {name: 0 for name in self.proposers}  # proposals each one won (stats, tests)

    def propose(self, request: Request) -> list[int]:
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _AutoState(score={name: 1.0 for name in self.proposers})
        tokens = request.all_token_ids
        if state.drafts and len(tokens) > state.base:
            new = tokens[state.base : state.base + max(len(d) for d in state.drafts.values())]
            for name, draft in state.drafts.items():
                held = 0
                while held < len(draft) and held < len(new) and draft[held] == new[held]:
                    held += 1
                state.score[name] = (1 - self.alpha) * state.score[name] + self.alpha * held
        state.drafts = {name: proposer.propose(request) for name, proposer in self.proposers.items()}
        state.base = len(tokens)
        ranked = sorted(self.proposers, key=lambda name: -state.score[name])  # stable: ties keep the order
        chosen = next((name for name in ranked if state.drafts[name]), ranked[0])
        self.num_chosen[chosen] += 1
        return state.drafts[chosen]

    def finished(self, request: Request) -> None:
        self._states.pop(request.request_id, None)
        self.suffix.finished(request)

    def purge_tenant(self, tenant: str) -> int:
        return self.suffix.purge_tenant(tenant)

    def check_integrity(self) -> None:
        self.suffix.check_integrity()
