"""CUDA graphs for decode steps.

A decode step of a small model is launch-bound on a GPU: hundreds of small
kernels whose launch costs more than their work. A graph replays a step's
kernels with one launch. It needs every launch to be the same from step to
step, so a graph is captured per padded batch size (1, 2, 4, 8, 16, then
multiples of 16) over static buffers that each step fills:

    input_ids, positions, slot_mapping: [max_batch]
    seq_lens: [max_batch] int32, query_start_loc: [max_batch + 1] int32 (0, 1, 2, ...)
    block_tables: [max_batch, max_blocks_per_seq]

Rows past the real batch are padding: slot -1 (the KV write skips it) and
length 0 (the attention kernel writes zeros), so they touch no KV and their
outputs are dropped. Only the forward pass is captured; logits and sampling
run eagerly on the real rows. ``capture_all`` captures every size when the
runner starts (largest first, into one shared memory pool), as vLLM does,
so that no step pays for a capture; a size missing for any reason is
captured the first time it is needed.

Steps with a prompt chunk, speculative drafts, an outgoing KV transfer or a
context longer than the block table's width run eagerly.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvferry.model.input_batch import FlatStep
from kvferry.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes a graph is captured for, up to ``max_batch``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, max_batch: int,
                 max_blocks_per_seq: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        device = kv_cache.device
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.int64, device=device)
        # Host staging, pinned, filled per step and copied in one go per buffer.
        self._host = torch.zeros(3, self.max_batch, dtype=torch.int64).pin_memory()
        self._host_lens = torch.zeros(self.max_batch, dtype=torch.int32).pin_memory()
        self._host_tables = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.int64).pin_memory()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.disabled = False
        self.replays = 0  # steps served by a graph (tests and stats read it)

    def capture_all(self) -> None:
        """Capture every batch size now. The static buffers hold padding only
        (slot -1, length 0), so the captures write no KV."""
        t0 = time.perf_counter()
        for size in reversed(self.sizes):
            if self._capture(size) is None:
                return
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batches of %s in %.2f s", self.sizes, time.perf_counter() - t0)

    def can_run(self, flat: FlatStep) -> bool:
        n = len(flat.seq_lens)
        return (not self.disabled and flat.num_prefills == 0 and len(flat.input_ids) == n
                and 0 < n <= self.max_batch and flat.block_tables.shape[1] <= self.max_blocks)

    def run(self, flat: FlatStep) -> torch.Tensor | None:
        """The step's hidden states [n, hidden] (a view of the graph's output,
        valid until the next replay), or None if capture failed (the step
        then runs eagerly, and so do later ones)."""
        n = len(flat.seq_lens)
        size = next(s for s in self.sizes if s >= n)
        self._fill(flat, n, size)
        entry = self._graphs.get(size)
        if entry is None:
            entry = self._capture(size)
            if entry is None:
                return None
        graph, hidden = entry
        graph.replay()
        self.replays += 1
        return hidden[:n]

    def _fill(self, flat: FlatStep, n: int, size: int) -> None:
        host = self._host.numpy()
        host[0, :n] = flat.input_ids
        host[1, :n] = flat.positions
        host[2, :n] = flat.slots
        host[:, n:size] = 0
        host[2, n:size] = -1
        lens = self._host_lens.numpy()
        lens[:n] = flat.seq_lens
        lens[n:size] = 0
        width = flat.block_tables.shape[1]
        tables = self._host_tables.numpy()
        tables[:n, :width] = flat.block_tables
        # Stale columns past a row's blocks are never read (its length stops it).
        self.input_ids[:size].copy_(self._host[0, :size], non_blocking=True)
        self.positions[:size].copy_(self._host[1, :size], non_blocking=True)
        self.slot_mapping[:size].copy_(self._host[2, :size], non_blocking=True)
        self.seq_lens[:size].copy_(self._host_lens[:size], non_blocking=True)
        self.block_tables[:n, :width].copy_(self._host_tables[:n, :width], non_blocking=True)
        # The next step refills the pinned buffers: it must not overwrite them
        # while these copies are pending (they run before this step's replay,
        # which the step's sampled-ids sync waits for).

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=list(range(size + 1)), seq_lens=[1] * size,
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            block_size=self.block_size, num_prefills=0, triton=True,
            triton_seq_lens=self.seq_lens[:size], triton_query_start_loc=self.query_start_loc[:size + 1],
        )

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        args = (self.input_ids[:size], self.positions[:size], self.kv_cache)
        try:
            # Warm up on a side stream first (Triton compiles, cuBLAS picks
            # its kernels), as capture requires.
            stream = torch.cuda.Stream(self.kv_cache.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.model(*args, self._meta(size))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden = self.model(*args, self._meta(size))
        except Exception:  # noqa: BLE001 - a failed capture must never fail the step
            logger.exception("CUDA graph capture of a decode batch of %d failed; decode runs eagerly", size)
            self.disabled = True
            return None
        self._graphs[size] = (graph, hidden)
        return graph, hidden
