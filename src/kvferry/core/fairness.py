"""Weighted fair sharing of the engine between tenants. No torch.

The policy is virtual-token-counter fair queuing (after VTC, "Fairness in
Serving Large Language Models", OSDI 2024):

* every tenant has a counter of the tokens the engine computed for it,
  divided by its weight (``weight`` in the key file, default 1): a tenant
  of weight 2 may take twice the tokens of a tenant of weight 1;
* admission takes the waiting request of the tenant with the smallest
  counter, FCFS within a tenant (ties: the head that waited longest);
* preemption takes its victim from the tenant with the largest counter
  (the one most over its fair share), its most recently admitted request;
* a tenant that gets work after having none starts at the smallest counter
  of the tenants with work (never below its own): idle time banks no credit,
  so a tenant cannot save up service and then flood. When nobody has work,
  every counter restarts at 0.

Charged tokens are the tokens the scheduler gives a request (prefill chunks,
decodes, draft tokens to verify); prefix hits cost nothing. The counters
depend only on each tenant's own service, never on another tenant's cache
contents, so the order leaks nothing about other tenants' prompts (no
longest-prefix-first across tenants).

With a single tenant every choice degenerates to today's: admission in
queue order and the last running request as the victim.

The scheduler calls ``on_arrival`` / ``on_departure`` when a request enters
or leaves it, ``charge`` when it schedules tokens, ``admission_order`` to
walk the waiting queue and ``pick_victim`` to preempt.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from kvferry.core.request import Request


class TenantFairness:
    def __init__(self) -> None:
        # tenant -> tokens served / weight (the virtual token counter).
        self.service: dict[str, float] = {}
        # tenant -> unfinished requests (waiting or running) in the scheduler.
        self.active: dict[str, int] = {}

    # -- membership ----------------------------------------------------------
    def on_arrival(self, request: Request) -> None:
        tenant = request.tenant
        n = self.active.get(tenant, 0)
        if n == 0:
            # Counter lift: no credit for the time it had no work.
            floor = min((self.service[t] for t in self.active), default=0.0)
            self.service[tenant] = max(self.service.get(tenant, 0.0), floor)
        self.active[tenant] = n + 1

    def on_departure(self, request: Request) -> None:
        tenant = request.tenant
        n = self.active.get(tenant, 0) - 1
        if n > 0:
            self.active[tenant] = n
            return
        self.active.pop(tenant, None)
        if not self.active:
            self.service.clear()  # idle engine: history no longer matters

    def charge(self, request: Request, num_tokens: int) -> None:
        if num_tokens > 0:
            self.service[request.tenant] = (self.service.get(request.tenant, 0.0)
                                            + num_tokens / request.tenant_weight)

    # -- choices ---------------------------------------------------------------
    def admission_order(self, waiting: Iterable[Request]) -> Iterator[Request]:
        """The waiting requests in admission order. Lazy: each next choice
        sees the counters charged for the requests admitted before it."""
        snapshot = list(waiting)
        if len(self.active) <= 1:
            yield from snapshot  # one tenant: queue order (FCFS, preempted first)
            return
        queues: dict[str, deque[tuple[int, Request]]] = {}
        for position, request in enumerate(snapshot):
            queues.setdefault(request.tenant, deque()).append((position, request))
        while queues:
            tenant = min(queues, key=lambda t: (self.service.get(t, 0.0), queues[t][0][0]))
            queue = queues[tenant]
            _, request = queue.popleft()
            if not queue:
                del queues[tenant]
            yield request

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        """The request to preempt among ``candidates`` (running requests in
        admission order): the latest one of the most-served tenant."""
        if len(self.active) <= 1:
            return candidates[-1]
        victim = candidates[-1]
        for request in reversed(candidates):  # ties: the latest admitted
            if self.service.get(request.tenant, 0.0) > self.service.get(victim.tenant, 0.0):
                victim = request
        if victim.tenant != candidates[-1].tenant:
            victim = next(r for r in reversed(candidates) if r.tenant == victim.tenant)
        return victim

    def counters(self) -> dict[str, float]:
        return dict(self.service)
