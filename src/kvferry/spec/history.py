"""What each tenant's finished requests taught the adaptive controller: the
share of their drafts that held, as EWMAs over requests, per draft method
(suffix, n-gram, the head: whichever ``auto`` chose) and over all methods.

Scoped by tenant, so that one tenant's traffic (random-temperature chat,
whose drafts fail) never switches drafting off for another's (an agent's
repetitive edits, whose drafts hold), nor the reverse; scoped by method,
so that a tenant whose head drafts fail but whose suffix matches hold
starts each request on what holds for it. A method the tenant has no
record of starts from the tenant's record over all methods (its traffic's
kind: where every draft failed, an untried method is no better bet), and
a tenant with no record at all from the neutral prior, whatever other
tenants did.

Weighed by evidence: a request's share moves the record by ``alpha`` only
where it verified ``full_weight_drafts`` or more drafts of the method, less
where fewer (as a request's own EWMA weighs a one-draft probe): a request
that drafted twice and had one accepted says little, and must not undo a
run of requests whose many drafts failed.

Bounded: at most ``max_tenants`` tenants, least recently used first out (a
record is a few floats; an evicted tenant only starts again from the prior).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MAX_TENANTS = 4096


@dataclass(slots=True)
class TenantRecord:
    overall: float  # over all methods
    methods: dict[str, float] = field(default_factory=dict)  # per method the tenant's requests drafted by

    def acceptance(self, method: str) -> float:
        return self.methods.get(method, self.overall)


class TenantHistory:
    def __init__(self, prior: float, alpha: float, max_tenants: int = MAX_TENANTS,
                 full_weight_drafts: int = 8) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants!r}")
        if full_weight_drafts < 1:
            raise ValueError(f"full_weight_drafts must be >= 1, got {full_weight_drafts!r}")
        self.full_weight_drafts = full_weight_drafts
        self.prior = prior  # where the tenant has no record
        self.alpha = alpha  # each finished request's weight
        self.max_tenants = max_tenants
        self._records: OrderedDict[str, TenantRecord] = OrderedDict()

    def get(self, tenant: str) -> TenantRecord | None:
        """The tenant's record (None: none). Read: recently used."""
        record = self._records.get(tenant)
        if record is not None:
            self._records.move_to_end(tenant)
        return record

    def add(self, tenant: str, drafted: dict[str, int], accepted: dict[str, int]) -> None:
        """A finished request's draft tokens verified and accepted per
        method, over its whole life (nothing drafted: nothing learned)."""
        total = sum(drafted.values())
        if total <= 0:
            return
        record = self.get(tenant)
        if record is None:
            record = self._records[tenant] = TenantRecord(self.prior)
            while len(self._records) > self.max_tenants:
                self._records.popitem(last=False)
        for method, n in drafted.items():
            if n > 0:
                a = self._weight(n)
                record.methods[method] = (1 - a) * record.acceptance(method) + a * accepted.get(method, 0) / n
        a = self._weight(total)
        record.overall = (1 - a) * record.overall + a * sum(accepted.values()) / total

    def _weight(self, drafts: int) -> float:
        """``alpha`` for a request with ``full_weight_drafts`` or more drafts;
        for fewer, the weight that many one-draft updates would compound to."""
        return 1.0 - (1.0 - self.alpha) ** (min(drafts, self.full_weight_drafts) / self.full_weight_drafts)

    def __len__(self) -> int:
        return len(self._records)
