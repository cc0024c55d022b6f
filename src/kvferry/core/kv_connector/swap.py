"""Host swap, scheduler half: a preempted request's KV is copied to host
slots and back instead of recomputed (the runner's ``HostSwapWorker`` does
the copies). Swaps are synchronous: a swap-out runs before the step's
forward pass writes any block, so the freed blocks may serve another request
in the same step, and a swap-in's tokens count as computed for the step that
orders it."""
from __future__ import annotations

from dataclasses import dataclass

from kvferry.core.kv_connector.base import ExternalTokens, KVConnectorScheduler
from kvferry.core.outputs import KVOrders, SwapOrder
from kvferry.types.stats import SchedulerStats
from kvferry.core.swap_space import HostSwapSpace
from kvferry.messages import KVDestination
from kvferry.core.request import Request


@dataclass(slots=True)
class SwappedKV:
    host_slots: list[int]
    num_tokens: int  # computed tokens whose KV the slots hold


class HostSwapScheduler(KVConnectorScheduler):
    def __init__(self, space: HostSwapSpace) -> None:
        self.space = space
        self.swapped: dict[str, SwappedKV] = {}
        self.num_swapped_out = 0

    def resume_tokens(self, request: Request) -> int:
        swapped = self.swapped.get(request.request_id)
        return swapped.num_tokens if swapped is not None else 0

    def update_state_after_alloc(self, request: Request, external: ExternalTokens,
                                 orders: KVOrders) -> KVDestination | None:
        swapped = self.swapped.pop(request.request_id, None)
        if swapped is not None:
            block_ids = self.control.kv.block_ids(request.request_id)[: len(swapped.host_slots)]
            orders.swap_in.append(SwapOrder(request.request_id, block_ids, swapped.host_slots))
            self.space.free(swapped.host_slots)
        return None

    def on_preempt(self, request: Request, orders: KVOrders) -> bool:
        """Swap out when the host slots have room; without room the request
        recomputes later (a store below is not asked: the swap space claims
        every preemption, as it is the faster way back)."""
        kv = self.control.kv
        num_blocks = -(-request.num_computed_tokens // kv.block_size)
        slots = self.space.allocate(num_blocks)
        if slots is None:
            return True
        block_ids = kv.block_ids(request.request_id)[:num_blocks]
        orders.swap_out.append(SwapOrder(request.request_id, block_ids, slots))
        self.swapped[request.request_id] = SwappedKV(slots, request.num_computed_tokens)
        self.num_swapped_out += 1
        return True

    def request_finished(self, request: Request) -> bool:
        swapped = self.swapped.pop(request.request_id, None)
        if swapped is not None:
            self.space.free(swapped.host_slots)
        return False

    def fill_stats(self, stats: SchedulerStats) -> None:
        stats.num_swapped_out += self.num_swapped_out
