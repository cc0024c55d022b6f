"""A KV connector from outside the package that runs on every
tensor-parallel rank and pipeline stage: a tier of files, one per block and
part (``s{stage}r{rank}``), in the folder ``$KVFERRY_TEST_FILE_TIER`` (the
ranks and stages are processes: a folder is what they share). Loaded with
``kv_connector="tests.parallel.file_tier_connector:FileTierConnector"``.

Each part's worker half saves and loads only its own KV (the pool it was
made over, ``WorkerContext.kv_cache``: its heads, its layers, named by
``WorkerContext.shard`` and ``.stage``); the scheduler half, made once on
rank 0, counts a block as held only when every part's file of it is there,
so a block is whole or not at all.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from kvferry.core.kv_connector import KVConnectorScheduler, TierKVScheduler
from kvferry.core.outputs import KVOrders
from kvferry.core.request import Request
from kvferry.engine.kv_connector import KVCompletions, KVConnector, KVConnectorWorker, SchedulerContext, WorkerContext

ENV = "KVFERRY_TEST_FILE_TIER"


def folder() -> Path:
    return Path(os.environ[ENV])


def block_file(key: bytes, part: str) -> Path:
    return folder() / f"{key.hex()}.{part}.pt"


def part_of(stage: int, rank: int) -> str:
    return f"s{stage}r{rank}"


class _FileIndex:
    def __init__(self, block_size: int, parts: list[str]) -> None:
        self.block_size, self.parts = block_size, parts

    def num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        first = num_computed_tokens // self.block_size
        end = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        held = 0
        for key in request.block_hashes[first:end]:
            if not all(block_file(key, part).exists() for part in self.parts):
                break  # a block is whole only when every part of it is
            held += 1
        return held * self.block_size


class _FileWorker(KVConnectorWorker):
    order_kinds = frozenset({"load", "save"})

    def __init__(self, kv_cache: torch.Tensor, part: str) -> None:
        # [this stage's layers, 2, num_blocks, block_size, this rank's kv heads, head_dim]
        self.kv_cache, self.part = kv_cache, part
        self._done = KVCompletions()

    def run_orders(self, orders: KVOrders) -> None:
        for order in orders.save:
            for key, block in zip(order.keys, order.device_block_ids):
                path = block_file(key, self.part)
                torch.save(self.kv_cache[:, :, block].clone(), path.with_suffix(".tmp"))
                path.with_suffix(".tmp").rename(path)  # whole or absent
            self._done.finished_saving.append(order.request_id)
        for order in orders.load:
            for key, block in zip(order.keys, order.device_block_ids):
                self.kv_cache[:, :, block] = torch.load(block_file(key, self.part))
            self._done.finished_loading.append(order.request_id)

    def take_finished(self, idle: bool = False) -> KVCompletions:
        done, self._done = self._done, KVCompletions()
        return done


class FileTierConnector(KVConnector):
    def worker_half(self, ctx: WorkerContext) -> KVConnectorWorker:
        stage = ctx.stage.rank if ctx.stage is not None else 0
        return _FileWorker(ctx.kv_cache, part_of(stage, ctx.shard.rank if ctx.shard is not None else 0))

    def scheduler_half(self, ctx: SchedulerContext) -> KVConnectorScheduler:
        par = self.config.parallel
        parts = [part_of(s, r) for s in range(par.pipeline_parallel_size) for r in range(par.tensor_parallel_size)]
        return TierKVScheduler(_FileIndex(ctx.block_size, parts), write_down=True)
