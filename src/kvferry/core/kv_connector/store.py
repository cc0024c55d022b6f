"""The node KV store, scheduler half: loads of prefix blocks some tier
holds, write-down of every newly full block, and retention of finished
conversations (the runner's ``NodeStoreWorker`` moves the bytes).

Lookup continues the request's hash chain past the device pool's hit::

    block_hashes:  | device hit | held by the store (load) | compute ...   | last token |

Write-down: every newly full block, generated tokens' included, is ordered
saved with the step after the one that wrote it; its device block stays
pinned until the runner reports the save done. A finished request that
asked for ``kv_retention_s`` has its blocks retained in the store once its
saves are done.
"""
from __future__ import annotations

from typing import Protocol

from kvferry.core.kv_connector.base import ExternalTokens, KVConnectorScheduler
from kvferry.core.outputs import KVOrders, RunnerOutput, TransferOrder
from kvferry.types.stats import SchedulerStats
from kvferry.core.tier_source import StoreKVSource
from kvferry.messages import EngineCoreOutput, KVDestination
from kvferry.core.request import Request, RequestStatus


class ExternalKVSource(Protocol):
    """Where a load's KV comes from: a tier index (``StoreKVSource``), or a
    simulation's."""

    def num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after ``num_computed_tokens`` whose KV can be loaded; a
        multiple of the block size, leaving at least the last prompt token
        to compute."""
        ...


class TierKVScheduler(KVConnectorScheduler):
    """Loads from ``source``; with ``write_down`` also saves every written
    block (``source`` is then the store's ``StoreKVSource``)."""

    can_load_ahead = True

    def __init__(self, source: ExternalKVSource, write_down: bool = False) -> None:
        self.source = source
        self.write_down = write_down
        # Saves ordered with the next step; saves in flight (I/O id ->
        # request id); blocks per request already saved or ordered (block
        # positions, kept across preemption); finished requests' retentions
        # waiting for their saves: request id -> (request, blocks, seconds).
        self._pending_saves: list[TransferOrder] = []
        self._saves: dict[str, str] = {}
        self._num_saved_blocks: dict[str, int] = {}
        self._retain_after_save: dict[str, tuple[Request, int, float]] = {}
        self._next_save_id = 0
        self.num_partial_loads = 0
        self.num_saved_blocks = 0

    # -- loads -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalTokens:
        num_tokens = self.source.num_matched_tokens(request, num_computed_tokens)
        return ExternalTokens(num_tokens, is_async=True) if num_tokens else ExternalTokens()

    def update_state_after_alloc(self, request: Request, external: ExternalTokens,
                                 orders: KVOrders) -> KVDestination | None:
        load = external.num_tokens if external.is_async else 0
        if self.write_down:
            # Blocks hit on the device were saved when they were computed,
            # and loaded ones come from the store: neither is saved again.
            rid = request.request_id
            saved = (request.num_computed_tokens + load) // self.control.kv.block_size
            self._num_saved_blocks[rid] = max(self._num_saved_blocks.get(rid, 0), saved)
        if load:
            self._order_load(request, load, orders)
        return None

    def _order_load(self, request: Request, num_tokens: int, orders: KVOrders) -> None:
        bs = self.control.kv.block_size
        first = request.num_computed_tokens // bs
        count = num_tokens // bs
        block_ids = self.control.kv.block_ids(request.request_id)[first : first + count]
        keys = request.block_hashes[first : first + count]
        orders.load.append(TransferOrder(
            request.request_id, block_ids, keys=list(keys), tenant=request.tenant,
            num_public_blocks=max(0, request.num_public_blocks - first)))

    def load_finished(self, request: Request, num_tokens: int, result: RunnerOutput,
                      outputs: list[EngineCoreOutput]) -> None:
        """Only the load's leading run of filled blocks counts as computed;
        a block after a gap (missing or corrupt in the tier) is recomputed
        with everything behind it, so no step ever reads KV the load did
        not write."""
        num_loaded_blocks = result.num_loaded_blocks.get(request.request_id)
        if num_loaded_blocks is not None:
            bs = self.control.kv.block_size
            loaded = min(num_tokens, max(num_loaded_blocks, 0) * bs)
            if loaded < num_tokens:
                self.num_partial_loads += 1
                if self.write_down:  # the missing blocks are saved again once recomputed
                    self._num_saved_blocks[request.request_id] = (request.num_computed_tokens + loaded) // bs
            num_tokens = loaded
        self.control.mark_loaded(request, num_tokens)

    # -- write-down --------------------------------------------------------------
    def start_step(self, orders: KVOrders) -> None:
        orders.save, self._pending_saves = self._pending_saves, []

    def request_computed(self, request: Request) -> None:
        if self.write_down:
            self._order_save(request)

    def on_preempt(self, request: Request, orders: KVOrders) -> bool:
        """The full blocks go to the store (write-down has ordered most of
        them already); the resumed request loads them back through the
        prefix lookup."""
        if not self.write_down:
            return False
        self._order_save(request)
        return True

    def _order_save(self, request: Request) -> None:
        """Order the request's newly full, written blocks saved with the
        next step, pinned until the save is done (a finish or a preemption
        may free the request's blocks meanwhile)."""
        kv = self.control.kv
        rid = request.request_id
        bs = kv.block_size
        start = self._num_saved_blocks.get(rid, 0)
        if not request.writes_public_blocks:
            start = max(start, request.num_public_blocks)  # public blocks are written by their declaration only
        end = min(min(request.num_computed_tokens, request.num_tokens) // bs, len(request.block_hashes))
        if end <= start or not kv.enable_caching:
            return
        block_ids = kv.block_ids(rid)[start:end]
        io_id = f"save-{self._next_save_id}"
        self._next_save_id += 1
        kv.pin(io_id, block_ids)
        self._pending_saves.append(TransferOrder(
            io_id, block_ids, keys=list(request.block_hashes[start:end]), tenant=request.tenant,
            num_public_blocks=max(0, request.num_public_blocks - start)))
        self._saves[io_id] = rid
        self._num_saved_blocks[rid] = end
        self.num_saved_blocks += end - start

    def apply_completions(self, result: RunnerOutput) -> None:
        for io_id in result.finished_saving:
            rid = self._saves.pop(io_id, None)
            if rid is None:
                continue  # a swap-out: complete within its own step
            self.control.kv.unpin(io_id)
            if rid in self._retain_after_save and rid not in self._saves.values():
                self._retain(*self._retain_after_save.pop(rid))

    # -- retention -----------------------------------------------------------------
    def request_finished(self, request: Request) -> bool:
        """A finished request that asked to keep its conversation: retain
        its written blocks (prompt and output) once their saves are done."""
        if not self.write_down:
            return False
        rid = request.request_id
        num_blocks = self._num_saved_blocks.pop(rid, 0)
        seconds = request.sampling_params.kv_retention_s
        if not seconds or num_blocks == 0 or request.status in (RequestStatus.FINISHED_ABORTED,
                                                                RequestStatus.FINISHED_ERROR):
            return False
        if rid in self._saves.values():
            self._retain_after_save[rid] = (request, num_blocks, seconds)
        else:
            self._retain(request, num_blocks, seconds)
        return False

    def _retain(self, request: Request, num_blocks: int, seconds: float) -> None:
        if isinstance(self.source, StoreKVSource):
            self.source.retain(request, num_blocks, seconds)

    def has_pending(self) -> bool:
        return bool(self._pending_saves or self._saves)

    def fill_stats(self, stats: SchedulerStats) -> None:
        if isinstance(self.source, StoreKVSource):
            stats.kv_store_queries += self.source.stats.queries
            stats.kv_store_hits += self.source.stats.hits
        stats.kv_partial_loads += self.num_partial_loads
        stats.kv_saved_blocks += self.num_saved_blocks
