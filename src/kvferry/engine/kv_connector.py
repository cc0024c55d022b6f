"""Moving KV blocks between the runner's device pool and elsewhere.

The scheduler decides (KV orders in ``SchedulerOutput.kv_orders``); a
connector in the runner executes them and reports completions, which come
back to the scheduler in ``RunnerOutput.finished_loading / _saving /
_sending``. Every order moves whole blocks in the one KV layout of the pool,
``[num_layers, 2, block_size, num_kv_heads, head_dim]`` per block, so no
reshaping happens anywhere on the way.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from kvferry.core.outputs import KVOrders, SwapOrder, TransferOrder
from kvferry.model.kv_cache_dtype import index_copy_into


@dataclass(slots=True)
class KVCompletions:
    """Request ids whose orders completed, in completion order."""

    finished_loading: list[str] = field(default_factory=list)
    finished_saving: list[str] = field(default_factory=list)
    finished_sending: list[str] = field(default_factory=list)
    # Loads that filled fewer blocks than ordered: request id -> the leading
    # blocks filled (see RunnerOutput.num_loaded_blocks).
    num_loaded_blocks: dict[str, int] = field(default_factory=dict)


class KVConnector(ABC):
    """Worker side of a KV tier, a swap space or a peer link.

    Contract:

    * ``execute`` is called once per step, before the forward pass, with the
      step's orders; orders run in this order: swap out, swap in, save, load,
      send.
    * Swap orders are synchronous: they are complete when ``execute``
      returns. A swap-out reads its blocks before the forward pass writes any
      block, which is why the scheduler may hand the swapped-out blocks to
      another request in the same step.
    * Load, save and send may be asynchronous. While one is in flight the
      scheduler keeps its device blocks pinned (held by the request, or by
      a delayed free): they are neither evicted nor reallocated. A load's
      blocks are not read by any forward pass until its completion.
    * A completion means the data is where the order said: for a load, the
      KV is in the device blocks; for a save, the tier holds it under its
      keys; for a send, the peer holds it and the device blocks may be freed.
    * ``take_finished`` returns each completion exactly once.
    """

    @abstractmethod
    def execute(self, orders: KVOrders) -> None: ...

    @abstractmethod
    def take_finished(self) -> KVCompletions: ...


class HostSwapConnector(KVConnector):
    """A host-DRAM swap space for preemption: swapping a preempted request's
    KV out and back in instead of recomputing it.

    Host slot ``s`` holds one block, laid out as the device blocks:
    ``host[:, :, s]`` is ``[num_layers, 2, block_size, num_kv_heads, head_dim]``.
    Swaps complete synchronously (the copies are issued on the current stream
    before the forward pass, then synchronized).
    """

    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        # kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = kv_cache
        shape = list(kv_cache.shape)
        shape[2] = num_slots
        pin = kv_cache.device.type == "cuda"
        # [num_layers, 2, num_slots, block_size, num_kv_heads, head_dim] on the host
        self.host = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=pin)
        self._finished = KVCompletions()

    def execute(self, orders: KVOrders) -> None:
        for order in orders.swap_out:
            self._copy_out(order)
            self._finished.finished_saving.append(order.request_id)
        for order in orders.swap_in:
            self._copy_in(order)
            self._finished.finished_loading.append(order.request_id)
        for kind in ("save", "load", "send"):
            transfers: list[TransferOrder] = getattr(orders, kind)
            if transfers:
                raise ValueError(f"{kind} orders need a KV tier or peer connector; only the host swap space is set up")
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

    def take_finished(self) -> KVCompletions:
        finished, self._finished = self._finished, KVCompletions()
        return finished
