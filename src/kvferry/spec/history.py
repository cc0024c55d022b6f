"""What each tenant's finished requests taught the adaptive controller: per
draft method (suffix, n-gram, the head: whichever ``auto`` chose), the share
of their drafts that held, as an EWMA over requests.

Scoped by tenant, so that one tenant's traffic (random-temperature chat,
whose drafts fail) never switches drafting off for another's (an agent's
repetitive edits, whose drafts hold), nor the reverse; scoped by method,
so that a tenant whose head drafts fail but whose suffix matches hold
starts each request on what holds for it. A tenant with no record starts
from the neutral prior, whatever other tenants did.

Bounded: at most ``max_tenants`` tenants, least recently used first out (a
record is a few floats; an evicted tenant only starts again from the prior).
"""
from __future__ import annotations

from collections import OrderedDict

MAX_TENANTS = 4096


class TenantHistory:
    def __init__(self, prior: float, alpha: float, max_tenants: int = MAX_TENANTS) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants!r}")
        self.prior = prior  # a method's acceptance where the tenant has no record of it
        self.alpha = alpha  # each finished request's weight
        self.max_tenants = max_tenants
        self._records: OrderedDict[str, dict[str, float]] = OrderedDict()  # tenant -> method -> acceptance

    def get(self, tenant: str) -> dict[str, float]:
        """The tenant's acceptance per method it has a record of (a copy;
        empty where none). Read: recently used."""
        record = self._records.get(tenant)
        if record is None:
            return {}
        self._records.move_to_end(tenant)
        return dict(record)

    def add(self, tenant: str, method: str, drafted: int, accepted: int) -> None:
        """A finished request's drafts by ``method`` over its whole life."""
        if drafted <= 0:
            return
        record = self._records.get(tenant)
        if record is None:
            record = self._records[tenant] = {}
            while len(self._records) > self.max_tenants:
                self._records.popitem(last=False)
        else:
            self._records.move_to_end(tenant)
        old = record.get(method, self.prior)
        record[method] = (1 - self.alpha) * old + self.alpha * accepted / drafted

    def __len__(self) -> int:
        return len(self._records)
