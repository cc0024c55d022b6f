"""Several connectors as one, scheduler half (e.g. host swap, the
prefill/decode transfer and the node store in one core).

Rules, in the order the connectors are given:

* a preempted request resumes from the first connector that kept its KV;
* a first admission loads from the first connector that matches any token
  (the others are told of the allocation with zero tokens);
* the load's completion or failure goes back to the connector that ordered it;
* a preemption is handled by the first connector that claims it;
* every connector sees every step, result and finish; a finished request's
  blocks are held while any connector holds them.
"""
from __future__ import annotations

from kvferry.core.kv_connector.base import NO_EXTERNAL_TOKENS, ExternalTokens, KVConnectorScheduler, SchedulerControl
from kvferry.core.outputs import KVOrders, RunnerOutput
from kvferry.types.stats import SchedulerStats
from kvferry.messages import EngineCoreOutput, KVDestination
from kvferry.core.request import Request


class MultiKVConnectorScheduler(KVConnectorScheduler):
    def __init__(self, connectors: list[KVConnectorScheduler]) -> None:
        if not connectors:
            raise ValueError("a multi-connector needs at least one connector")
        self.connectors = list(connectors)
        self.can_load_ahead = any(connector.can_load_ahead for connector in self.connectors)
        # Request id -> the connector whose tokens it admits with (resume
        # or match), from the query until the allocation.
        self._matched: dict[str, KVConnectorScheduler] = {}
        # Request id -> the connector whose asynchronous load is in flight.
        self._loading: dict[str, KVConnectorScheduler] = {}

    def bind(self, control: SchedulerControl) -> None:
        super().bind(control)
        for connector in self.connectors:
            connector.bind(control)

    def resume_tokens(self, request: Request) -> int:
        for connector in self.connectors:
            num_tokens = connector.resume_tokens(request)
            if num_tokens:
                self._matched[request.request_id] = connector
                return num_tokens
        return 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalTokens:
        for connector in self.connectors:
            external = connector.get_num_new_matched_tokens(request, num_computed_tokens)
            if external.num_tokens:
                self._matched[request.request_id] = connector
                return external
        return NO_EXTERNAL_TOKENS

    def update_state_after_alloc(self, request: Request, external: ExternalTokens,
                                 orders: KVOrders) -> KVDestination | None:
        matched = self._matched.pop(request.request_id, None)
        if matched is not None and external.is_async:
            self._loading[request.request_id] = matched
        announced = None
        for connector in self.connectors:
            dest = connector.update_state_after_alloc(
                request, external if connector is matched else NO_EXTERNAL_TOKENS, orders)
            announced = announced or dest
        return announced

    def start_step(self, orders: KVOrders) -> None:
        for connector in self.connectors:
            connector.start_step(orders)

    def on_scheduled(self, request: Request, num_new_tokens: int, orders: KVOrders) -> None:
        for connector in self.connectors:
            connector.on_scheduled(request, num_new_tokens, orders)

    def request_computed(self, request: Request) -> None:
        for connector in self.connectors:
            connector.request_computed(request)

    def on_preempt(self, request: Request, orders: KVOrders) -> bool:
        return any(connector.on_preempt(request, orders) for connector in self.connectors)

    def load_finished(self, request: Request, num_tokens: int, result: RunnerOutput,
                      outputs: list[EngineCoreOutput]) -> None:
        owner = self._loading.pop(request.request_id, None) or super()
        owner.load_finished(request, num_tokens, result, outputs)

    def load_failed(self, request: Request, reason: str, result: RunnerOutput,
                    outputs: list[EngineCoreOutput]) -> None:
        owner = self._loading.pop(request.request_id, None) or super()
        owner.load_failed(request, reason, result, outputs)

    def apply_completions(self, result: RunnerOutput) -> None:
        for connector in self.connectors:
            connector.apply_completions(result)

    def request_finished(self, request: Request) -> bool:
        self._matched.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        hold = False
        for connector in self.connectors:
            hold = connector.request_finished(request) or hold  # every connector is told
        return hold

    def has_pending(self) -> bool:
        return any(connector.has_pending() for connector in self.connectors)

    def fill_stats(self, stats: SchedulerStats) -> None:
        for connector in self.connectors:
            connector.fill_stats(stats)
