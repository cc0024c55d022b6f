"""A KV connector that lives outside the package: a host-memory tier in a
Python dict, shared by every engine of the process. It is what a third
party's connector looks like from kvferry's side (loaded with
``kv_connector="tests.engine.dict_tier_connector:DictTierConnector"``).

Its scheduler half reuses the package's tier logic (lookup past the prefix
hit, loads, write-down of every full block); its worker half copies whole
blocks between the device pool and the dict, synchronously.
"""
from __future__ import annotations

import torch

from kvferry.core.kv_connector import KVConnectorScheduler, TierKVScheduler
from kvferry.core.outputs import KVOrders
from kvferry.engine.kv_connector import KVCompletions, KVConnector, KVConnectorWorker, SchedulerContext, WorkerContext
from kvferry.core.request import Request

# block hash -> [num_layers, 2, block_size, num_kv_heads, head_dim] on the host
BLOCKS: dict[bytes, torch.Tensor] = {}
COUNTS = {"loaded_blocks": 0, "saved_blocks": 0}


class _DictIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        first = num_computed_tokens // self.block_size
        end = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        held = 0
        for key in request.block_hashes[first:end]:
            if key not in BLOCKS:
                break
            held += 1
        return held * self.block_size


class _DictWorker(KVConnectorWorker):
    order_kinds = frozenset({"load", "save"})

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self._done = KVCompletions()

    def run_orders(self, orders: KVOrders) -> None:
        for order in orders.save:
            for key, block in zip(order.keys, order.device_block_ids):
                BLOCKS[key] = self.kv_cache[:, :, block].clone()
                COUNTS["saved_blocks"] += 1
            self._done.finished_saving.append(order.request_id)
        for order in orders.load:
            for key, block in zip(order.keys, order.device_block_ids):
                self.kv_cache[:, :, block] = BLOCKS[key]
                COUNTS["loaded_blocks"] += 1
            self._done.finished_loading.append(order.request_id)

    def take_finished(self, idle: bool = False) -> KVCompletions:
        done, self._done = self._done, KVCompletions()
        return done


class DictTierConnector(KVConnector):
    def worker_half(self, ctx: WorkerContext) -> KVConnectorWorker:
        return _DictWorker(ctx.kv_cache)

    def scheduler_half(self, ctx: SchedulerContext) -> KVConnectorScheduler:
        return TierKVScheduler(_DictIndex(ctx.block_size), write_down=True)


class NotAConnector:
    pass
