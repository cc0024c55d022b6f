"""Host swap, worker half: a host-DRAM swap space for preemption, swapping
a preempted request's KV out and back in instead of recomputing it.

Host slot ``s`` holds one block, laid out as the device blocks:
``host[:, :, s]`` is ``[num_layers, 2, block_size, num_kv_heads, head_dim]``.
Swaps complete synchronously (the copies are issued on the current stream
before the forward pass, then synchronized).
"""
from __future__ import annotations

import torch

from kvferry.core.outputs import KVOrders, SwapOrder
from kvferry.engine.kv_connector.base import KVCompletions, KVConnectorWorker
from kvferry.model.kv_cache_dtype import index_copy_into


class HostSwapWorker(KVConnectorWorker):
    order_kinds = frozenset({"swap_out", "swap_in"})

    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        # kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = kv_cache
        shape = list(kv_cache.shape)
        shape[2] = num_slots
        pin = kv_cache.device.type == "cuda"
        # [num_layers, 2, num_slots, block_size, num_kv_heads, head_dim] on the host
        self.host = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=pin)
        self._finished = KVCompletions()

    def run_orders(self, orders: KVOrders) -> None:
        for order in orders.swap_out:
            self._copy_out(order)
            self._finished.finished_saving.append(order.request_id)
        for order in orders.swap_in:
            self._copy_in(order)
            self._finished.finished_loading.append(order.request_id)
        if self.kv_cache.device.type == "cuda" and (orders.swap_out or orders.swap_in):
            torch.cuda.current_stream().synchronize()

    def _copy_out(self, order: SwapOrder) -> None:
        blocks = torch.tensor(order.device_block_ids, dtype=torch.int64, device=self.kv_cache.device)
        slots = torch.tensor(order.host_slots, dtype=torch.int64)
        # [L, 2, n, bs, H, D] gathered on the device, then one copy to the host
        index_copy_into(self.host, 2, slots, self.kv_cache.index_select(2, blocks).cpu())

    def _copy_in(self, order: SwapOrder) -> None:
        blocks = torch.tensor(order.device_block_ids, dtype=torch.int64, device=self.kv_cache.device)
        slots = torch.tensor(order.host_slots, dtype=torch.int64)
        data = self.host.index_select(2, slots).to(self.kv_cache.device, non_blocking=True)
        index_copy_into(self.kv_cache, 2, blocks, data)

    def take_finished(self, idle: bool = False) -> KVCompletions:
        finished, self._finished = self._finished, KVCompletions()
        return finished
