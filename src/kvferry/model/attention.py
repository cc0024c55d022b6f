"""Attention over the paged KV cache.

KV layout, stated once for the whole project:

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

``kv_cache[:, :, b]`` is block ``b``: ``[layers][2][block_size, kv_heads,
head_dim]``. Tiers and transports move whole blocks with that shape.
A token at position ``p`` of a request with block table ``bt`` lives in
block ``bt[p // block_size]`` at offset ``p % block_size``; its "slot" is
``bt[p // block_size] * block_size + p % block_size``.

The same code runs on CPU and CUDA: it is plain torch indexing plus
``scaled_dot_product_attention``; every derived tensor lives on the device
of ``block_tables``. On CPU, single-token decodes and short chunks (speculative
verify windows, short prefill chunks over a cached context) go to the C++
kernel of ``paged_kernel.py`` when it builds: one call per layer for all of
them, reading each sequence's K/V rows in place once for all its query
tokens and heads. ``KVFERRY_DISABLE_CPP_KERNELS=1`` forces the torch path
everywhere.

With ``AttentionMetadata.triton`` set (the CUDA default, see
``attention_backend``) every layer instead makes two Triton calls
(``triton_attention.py``): one KV write, one attention launch per kind of
sequence (chunks, then single tokens), with no per-sequence Python work and
no data-dependent shapes, so that a decode step can be captured in a CUDA
graph.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from kvferry.config import ATTENTION_BACKENDS
from kvferry.model import fused_ops, triton_attention
from kvferry.model.kv_cache_dtype import to_cache_dtype
from kvferry.model.paged_kernel import get_paged_decode_kernel


def attention_backend(requested: str, device: torch.device) -> str:
    """"triton" or "torch" (torch's own ops, and the C++ kernel on CPU).

    "auto" takes Triton on CUDA when it is installed; on CPU the C++ kernel
    is faster than anything Triton's interpreter can do, so CPU takes
    "triton" only when asked (the tests check the kernels that way)."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {requested!r}")
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_attention.triton_available() else "torch"
    if requested == "triton" and not triton_attention.triton_available():
        raise ValueError("attention_backend 'triton' needs the triton package")
    if requested == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Caught at start-up rather than at the first step's kernel launch.
        raise ValueError("attention_backend 'triton' runs on CPU only in Triton's interpreter: "
                         "set TRITON_INTERPRET=1 (or use 'auto' / 'torch')")
    return requested

# Cache dtypes the C++ kernel reads (converting rows to float32 on the fly).
_KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn)
# Query dtypes it takes.
_KERNEL_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Chunks with at most this many new tokens use the kernel, fresh prompts
# included; longer ones (none the scheduler makes at its default 2048-token
# budget) use SDPA. The kernel reads the context once per 32-token query
# block and is faster than the torch path (gather + SDPA's flash kernel) at
# every length measured, for every cache dtype and build
# (bench/paged_attention_kernel.py, 2 threads, wall time, session 11):
# float32 0.24-0.68x on fresh prompts of 16-256 tokens, 0.86x on one of
# 2048, 0.54-0.88x on 32-1024-token chunks over 512-2048 cached tokens; the
# AVX2 build (KVFERRY_KERNEL_ISA=avx2) 0.67-0.74x in float32 and 0.57-0.76x
# in bf16; with AVX512-BF16 (vdpbf16ps, tiles staged once for all query
# rows) 0.21x at 8 x 256 bf16 tokens. An earlier kernel was 1.2-1.3x slower
# than SDPA on 64-128-token float32 chunks, hence a limit of 16 tokens
# outside bf16 until then.
# Greedy outputs may differ from the SDPA path's where two logits tie at bf16
# resolution (a fresh 37-token chat prompt of the embedded model: every
# layer is as close to float32 on either path, but its first token's top two
# logits, 0.08 apart in float32, round to the same bf16 value on one path).
_KERNEL_MAX_PREFILL_TOKENS = 8192


def kernel_max_chunk_tokens() -> int:
    """Longest chunk (new tokens of one request) the C++ kernel takes."""
    return _KERNEL_MAX_PREFILL_TOKENS


# The longest draft tree the C++ kernel takes: one uint64 of ancestor bits per token.
KERNEL_MAX_TREE_TOKENS = 64


def tree_bits(tree: torch.Tensor) -> torch.Tensor:
    """[q, q] bool tree mask (q <= 64) -> [q] int64, bit b of row j set
    where token j may attend to token b (the kernel's tree_masks rows)."""
    q = tree.shape[0]
    if q > KERNEL_MAX_TREE_TOKENS:
        raise ValueError(f"a tree of {q} tokens: the kernel takes at most {KERNEL_MAX_TREE_TOKENS}")
    # Distinct bits: their sum is their OR (bit 63 wraps to the sign bit, as intended).
    weights = torch.ones(q, dtype=torch.int64, device=tree.device) << torch.arange(q, device=tree.device)
    return (tree.to(torch.bool).to(torch.int64) * weights).sum(dim=1).cpu()


def kernel_takes_tree(tree: torch.Tensor) -> bool:
    """Whether the C++ kernel takes this [q, q] tree mask: at most 64 tokens
    (and no longer than its chunks), each seeing itself and only tokens
    before it (ancestors first, as kvferry.spec.tree orders them)."""
    q = tree.shape[0]
    if q > min(KERNEL_MAX_TREE_TOKENS, kernel_max_chunk_tokens()):
        return False
    tree = tree.to(torch.bool)
    return bool(tree.diagonal().all()) and not bool(tree.triu(1).any())


@dataclass(slots=True)
class PrefillSlice:
    """One request with more than one new token (a prompt chunk or a
    speculative verify window), prepared for attention."""

    start: int  # first token of the request in the flattened batch
    end: int  # one past its last token
    context_len: int  # tokens already in the cache before this step
    # [seq_len] int64 slots of positions 0..seq_len-1; None when context_len == 0
    # (then the new k/v are used directly and no gather is needed)
    slots: torch.Tensor | None = None
    # [q_len, seq_len] bool, True = may attend; None when causal from 0
    mask: torch.Tensor | None = None
    # Served by the kernel call of the step (then slots/mask stay None unless
    # a layer's cache dtype needs the torch path after all).
    use_kernel: bool = False


class LayerSink(Protocol):
    """Told as each layer has written this step's KV (a prefill core
    streaming it to a decode core: ``kvferry.disagg.agent.StepTransfer``)."""

    def layer_done(self, layer: int) -> None: ...


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one step's flattened batch for every layer.

    The batch is the concatenation of each scheduled request's new tokens
    (prefill chunks first, then single-token decodes)::

        tokens:  | req0 chunk (q0 tokens) | req1 chunk (q1) | dec2 | dec3 |
        query_start_loc = [0, q0, q0+q1, q0+q1+1, q0+q1+2]

    Request i's new tokens sit at positions ``seq_lens[i] - q_i .. seq_lens[i]-1``
    of its sequence; positions before that are already in the KV cache.
    """

    # [num_reqs + 1] python ints: token offsets of each request in the batch
    query_start_loc: list[int]
    # [num_reqs] python ints: context length after this step (cached + new)
    seq_lens: list[int]
    # [num_tokens] int64: where each new token's K/V is written
    slot_mapping: torch.Tensor
    # [num_reqs, max_num_blocks] int64, padded with 0 (never read past seq_len)
    block_tables: torch.Tensor
    block_size: int
    # Requests [0, num_prefills) have more than one new token; requests
    # [num_prefills, num_reqs) have exactly one (decodes, or a 1-token chunk).
    num_prefills: int
    # This step's outgoing KV transfer, if any: the model calls
    # ``layer_done(i)`` after layer i (per step, never a global).
    kv_transfer: LayerSink | None = None
    # The KV cache's dtype: how long a chunk the kernel takes (None: the
    # float32 threshold).
    kv_dtype: torch.dtype | None = None
    # The Triton path (every layer: triton_attention's kernels).
    triton: bool = False
    # Its tensors, on the batch's device: [num_reqs] int32 context lengths and
    # [num_reqs + 1] int32 query offsets. Built by prepare() from the lists
    # above unless given (a CUDA graph's static buffers).
    triton_seq_lens: torch.Tensor | None = None
    triton_query_start_loc: torch.Tensor | None = None
    max_prefill_query_len: int = 0
    # Draft trees (kvferry.spec.tree): request index -> [q_len, q_len] bool
    # on the batch's device, which of the request's new tokens each of them
    # may attend to (its ancestors and itself); it sees all of its cached
    # context. On the CPU the C++ kernel takes a tree of up to 64 tokens (as
    # one uint64 of ancestor bits per token: kernel_tree_masks); longer
    # trees, and the Triton path, take the torch path (gather + masked SDPA).
    tree_masks: dict[int, torch.Tensor] | None = None

    # ---- derived by prepare(); callers leave these alone ----
    prefills: list[PrefillSlice] = field(default_factory=list)
    num_decodes: int = 0
    decode_start: int = 0  # token offset of the first decode in the batch
    # C++ kernel path: the kernel and the sequences it serves (short chunks,
    # then every decode), one call per layer. The padded slots/mask below are
    # then built only if a layer needs the torch path after all (a cache
    # dtype the kernel does not read).
    kernel: Callable[..., None] | None = None
    kernel_block_tables: torch.Tensor | None = None  # [kernel_seqs, max_num_blocks] int64
    kernel_seq_lens: torch.Tensor | None = None  # [kernel_seqs] int64
    kernel_query_starts: torch.Tensor | None = None  # [kernel_seqs] int64, token offset in the batch
    kernel_query_lens: torch.Tensor | None = None  # [kernel_seqs] int64
    # [kernel_seqs, 64] int64 ancestor bits of the kernel's tree sequences
    # (rows of the others zero); None when none of them is a tree.
    kernel_tree_masks: torch.Tensor | None = None
    # [num_decodes * max_decode_len] int64 slots, row-major over (request, position)
    decode_slots: torch.Tensor | None = None
    # [num_decodes, 1, 1, max_decode_len] bool, True = real context (not padding)
    decode_mask: torch.Tensor | None = None
    max_decode_len: int = 0
    prepared: bool = False

    def prepare(self) -> None:
        """Build derived tensors once per step (the runner calls this), so
        that the per-layer attention calls do no repeated set-up work."""
        if self.prepared:
            return
        num_reqs = len(self.seq_lens)
        if len(self.query_start_loc) != num_reqs + 1:
            raise ValueError(
                f"query_start_loc has {len(self.query_start_loc)} entries, expected num_reqs + 1 = {num_reqs + 1}"
            )
        if self.triton:
            self._prepare_triton(num_reqs)
            # Tree requests: the Triton launch computes them causally, then
            # the torch path overwrites their rows with the tree mask's.
            self.prefills = [self._tree_slice(i) for i in sorted(self.tree_masks or ())]
            self.prepared = True
            return
        self.prefills = [self._prefill_slice(i) for i in range(self.num_prefills)]
        self._prepare_decodes(num_reqs)
        self._prepare_kernel_seqs(num_reqs)
        self.prepared = True

    def _prepare_triton(self, num_reqs: int) -> None:
        self.num_decodes = num_reqs - self.num_prefills
        self.decode_start = self.query_start_loc[self.num_prefills]
        qsl = self.query_start_loc
        self.max_prefill_query_len = max((qsl[i + 1] - qsl[i] for i in range(self.num_prefills)), default=0)
        device = self.block_tables.device
        if self.triton_seq_lens is None:
            self.triton_seq_lens = torch.tensor(self.seq_lens, dtype=torch.int32).to(device, non_blocking=True)
        if self.triton_query_start_loc is None:
            self.triton_query_start_loc = torch.tensor(qsl, dtype=torch.int32).to(device, non_blocking=True)

    def _use_kernel(self) -> bool:
        """Fetch the C++ kernel (built on the first step that needs it: a
        decode or a short chunk over cached context). CPU tensors only."""
        if self.kernel is None and self.block_tables.device.type == "cpu":
            self.kernel = get_paged_decode_kernel()
        return self.kernel is not None

    def _slots(self, req_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots of ``positions`` for each request row: [len(req_rows), len(positions)]."""
        # block_tables[r, p // block_size] * block_size + p % block_size
        blocks = self.block_tables[req_rows][:, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _prefill_slice(self, i: int) -> PrefillSlice:
        start, end = self.query_start_loc[i], self.query_start_loc[i + 1]
        seq_len = self.seq_lens[i]
        q_len = end - start
        context_len = seq_len - q_len
        if q_len < 1 or context_len < 0:
            raise ValueError(f"request {i}: {q_len} new tokens but seq_len {seq_len}")
        if self.tree_masks and i in self.tree_masks:
            if kernel_takes_tree(self.tree_masks[i]) and self._use_kernel():
                return PrefillSlice(start, end, context_len, use_kernel=True)
            return self._tree_slice(i)
        if q_len <= kernel_max_chunk_tokens() and self._use_kernel():
            return PrefillSlice(start, end, context_len, use_kernel=True)
        if context_len == 0:
            return PrefillSlice(start, end, 0)  # SDPA over the new k/v themselves: no gather
        return PrefillSlice(start, end, context_len, *self._context_slots_and_mask(i, context_len, seq_len))

    def context_slots_and_mask(self, p: PrefillSlice) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The torch path's slots and mask for a slice prepared for the kernel
        (None, None when it has no cached context)."""
        i = self.query_start_loc.index(p.start)
        if self.tree_masks and i in self.tree_masks:
            tree = self._tree_slice(i)
            return tree.slots, tree.mask
        if p.context_len == 0:
            return None, None
        return self._context_slots_and_mask(i, p.context_len, self.seq_lens[i])

    def _context_slots_and_mask(self, i: int, context_len: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[seq_len] slots of request i and its [q_len, seq_len] causal mask."""
        device = self.block_tables.device
        positions = torch.arange(seq_len, device=device)
        slots = self._slots(torch.tensor([i], device=device), positions)[0]
        # Query j sits at position context_len + j and sees keys 0..context_len + j:
        #
        #            keys: 0 ........ context_len ...... seq_len-1
        #   query 0        [ all cached ][x . . . . . . .]
        #   query q_len-1  [ all cached ][x x x x x x x x]
        q_pos = torch.arange(context_len, seq_len, device=device)
        mask = positions[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        return slots, mask

    def _tree_slice(self, i: int) -> PrefillSlice:
        """Request i's draft tree: all of its cached context, then its tree mask."""
        start, end = self.query_start_loc[i], self.query_start_loc[i + 1]
        seq_len = self.seq_lens[i]
        context_len = seq_len - (end - start)
        tree = self.tree_masks[i]
        if tree.shape != (end - start, end - start):
            raise ValueError(f"request {i}: a tree mask of shape {tuple(tree.shape)} for {end - start} new tokens")
        device = self.block_tables.device
        slots = self._slots(torch.tensor([i], device=device), torch.arange(seq_len, device=device))[0]
        context = torch.ones(end - start, context_len, dtype=torch.bool, device=device)
        return PrefillSlice(start, end, context_len, slots, torch.cat([context, tree.to(torch.bool)], dim=1))

    def _prepare_decodes(self, num_reqs: int) -> None:
        self.num_decodes = num_reqs - self.num_prefills
        self.decode_start = self.query_start_loc[self.num_prefills]
        if self.num_decodes == 0:
            return
        lens = self.seq_lens[self.num_prefills:]
        self.max_decode_len = max(lens)
        if not self._use_kernel():
            self.build_decode_slots()

    def _prepare_kernel_seqs(self, num_reqs: int) -> None:
        """The kernel call's sequences: short chunks, then all decodes."""
        if self.kernel is None:
            return
        rows = [i for i, p in enumerate(self.prefills) if p.use_kernel]
        rows += range(self.num_prefills, num_reqs)
        if not rows:
            return
        if rows == list(range(rows[0], num_reqs)):
            self.kernel_block_tables = self.block_tables[rows[0]:]  # contiguous row slice: a view
        else:
            self.kernel_block_tables = self.block_tables[torch.tensor(rows)]
        qsl = self.query_start_loc
        self.kernel_seq_lens = torch.tensor([self.seq_lens[i] for i in rows], dtype=torch.int64)
        self.kernel_query_starts = torch.tensor([qsl[i] for i in rows], dtype=torch.int64)
        self.kernel_query_lens = torch.tensor([qsl[i + 1] - qsl[i] for i in rows], dtype=torch.int64)
        trees = [(r, self.tree_masks[i]) for r, i in enumerate(rows) if self.tree_masks and i in self.tree_masks]
        if trees:
            self.kernel_tree_masks = torch.zeros(len(rows), KERNEL_MAX_TREE_TOKENS, dtype=torch.int64)
            for r, tree in trees:
                self.kernel_tree_masks[r, :tree.shape[0]] = tree_bits(tree)

    def build_decode_slots(self) -> None:
        """The torch decode path's padded slots and mask (idempotent)."""
        if self.decode_slots is not None:
            return
        num_reqs = len(self.seq_lens)
        device = self.block_tables.device
        lens = self.seq_lens[self.num_prefills:]
        lens_t = torch.tensor(lens, device=device)
        positions = torch.arange(self.max_decode_len, device=device)
        # Padding positions reuse the request's last real position, so every
        # gathered value is a written slot (never uninitialized memory that
        # could hold NaN: 0 * NaN would poison the masked softmax @ V).
        clamped = torch.minimum(positions[None, :], (lens_t - 1)[:, None])  # [B, S]
        rows = torch.arange(self.num_prefills, num_reqs, device=device)
        blocks = self.block_tables[rows[:, None], clamped // self.block_size]
        self.decode_slots = (blocks * self.block_size + clamped % self.block_size).reshape(-1)
        self.decode_mask = (positions[None, :] < lens_t[:, None])[:, None, None, :]


def write_kv(kv_cache_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into the cache.

    kv_cache_layer: [2, num_blocks, block_size, kv_heads, head_dim]
    k, v: [num_tokens, kv_heads, head_dim]
    """
    _, _, _, kv_heads, head_dim = kv_cache_layer.shape
    flat = kv_cache_layer.view(2, -1, kv_heads, head_dim)  # [2, num_slots, kvh, hd]
    fused_ops.write_kv(k, v, flat[0], flat[1], slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the step's new tokens over their whole context.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim]
    kv_cache_layer: [2, num_blocks, block_size, kv_heads, head_dim] (written here)
    Returns [num_tokens, num_heads, head_dim].
    """
    if not meta.prepared:
        meta.prepare()
    if meta.triton:
        return _triton_attention(q, k, v, kv_cache_layer, meta, scale)
    write_kv(kv_cache_layer, k, v, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even when q is a strided view
    flat = kv_cache_layer.view(2, -1, kv_cache_layer.shape[3], kv_cache_layer.shape[4])
    kernel = meta.kernel if kv_cache_layer.dtype in _KERNEL_CACHE_DTYPES and q.dtype in _KERNEL_QUERY_DTYPES else None
    if kernel is not None and meta.kernel_seq_lens is not None:
        # Short chunks and decodes, in place into their rows of out.
        if meta.kernel_tree_masks is None:
            kernel(q, kv_cache_layer[0], kv_cache_layer[1], meta.kernel_block_tables, meta.kernel_seq_lens,
                   meta.kernel_query_starts, meta.kernel_query_lens, scale, out)
        else:  # draft trees among them: the op that takes their masks
            torch.ops.kvferry.paged_attention_tree(
                q, kv_cache_layer[0], kv_cache_layer[1], meta.kernel_block_tables, meta.kernel_seq_lens,
                meta.kernel_query_starts, meta.kernel_query_lens, scale, out, meta.kernel_tree_masks)
    for p in meta.prefills:
        if not (p.use_kernel and kernel is not None):
            out[p.start:p.end] = _prefill_attention(q, k, v, flat, p, scale, meta)
    if meta.num_decodes and kernel is None:
        meta.build_decode_slots()
        out[meta.decode_start:] = _decode_attention(q[meta.decode_start:], flat, meta, scale)
    return out


def _triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache_layer: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The Triton path: write the new K/V, then one launch for the chunks and
    one for the single tokens (each sized for its kind of query tile)."""
    k_cache, v_cache = kv_cache_layer[0], kv_cache_layer[1]
    triton_attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    p = meta.num_prefills
    seq_lens, qsl = meta.triton_seq_lens, meta.triton_query_start_loc
    num_seqs = seq_lens.shape[0]
    if p:
        triton_attention.paged_attention(q, k_cache, v_cache, out, meta.block_tables, seq_lens, qsl,
                                         meta.max_prefill_query_len, scale, first_seq=0, num_seqs=p)
    if num_seqs > p:
        triton_attention.paged_attention(q, k_cache, v_cache, out, meta.block_tables, seq_lens, qsl, 1, scale,
                                         first_seq=p, num_seqs=num_seqs - p)
    if meta.prefills:  # draft trees: their rows again, with their masks
        flat = kv_cache_layer.view(2, -1, kv_cache_layer.shape[3], kv_cache_layer.shape[4])
        for tree in meta.prefills:
            out[tree.start:tree.end] = _prefill_attention(q, k, v, flat, tree, scale, meta)
    return out


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat: torch.Tensor, p: PrefillSlice, scale: float,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """One request's chunk: [q_len, H, D] attending to its context."""
    qh = q[p.start:p.end].transpose(0, 1)  # [H, q_len, D]
    group = q.shape[1] // k.shape[1]
    if p.use_kernel and p.slots is None:
        # Prepared for the kernel, but this layer's dtypes need torch.
        p.slots, p.mask = meta.context_slots_and_mask(p)
    # SDPA gets 4-D [1, H, L, D] inputs: on CPU only those reach the fused
    # flash kernel (3-D ones take the unfused math path, measured 4-6x slower
    # on a 512-token chunk, and it materializes the [H, q_len, seq_len] scores).
    # With 4-D inputs the flash kernel also reads grouped K/V heads itself
    # (enable_gqa, same results), so K/V are not copied once per query head.
    gqa = group > 1
    if p.slots is None:
        # No cached context: the new tokens are the whole sequence.
        kh = k[p.start:p.end].transpose(0, 1)  # [KVH, q_len, D]
        vh = v[p.start:p.end].transpose(0, 1)
        if flat.dtype != q.dtype:
            # As the cache holds them (fp8): every path attends to K/V as stored.
            kh, vh = to_cache_dtype(kh, flat.dtype).to(q.dtype), to_cache_dtype(vh, flat.dtype).to(q.dtype)
        o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], is_causal=True, scale=scale,
                                           enable_gqa=gqa)
    else:
        kh = flat[0].index_select(0, p.slots).to(q.dtype).transpose(0, 1)  # [KVH, seq_len, D]
        vh = flat[1].index_select(0, p.slots).to(q.dtype).transpose(0, 1)
        o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=p.mask, scale=scale,
                                           enable_gqa=gqa)
    return o[0].transpose(0, 1)  # [q_len, H, D]


def _decode_attention(q: torch.Tensor, flat: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """All single-token requests in one SDPA call over padded contexts.

    q: [B, H, D] -> [B, H, D]. The query heads sharing a KV head are folded
    into the query-length axis ([B, KVH, G, D]), which is exact for one query
    token and avoids materializing repeated K/V for GQA.
    """
    b, num_heads, head_dim = q.shape
    kv_heads = flat.shape[2]
    group = num_heads // kv_heads
    s = meta.max_decode_len
    # [B, S, KVH, D] -> [B, KVH, S, D]
    kh = flat[0].index_select(0, meta.decode_slots).view(b, s, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    vh = flat[1].index_select(0, meta.decode_slots).view(b, s, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    qh = q.view(b, kv_heads, group, head_dim)  # head h = kv_head * group + g, as HF's repeat_kv
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=meta.decode_mask, scale=scale)
    return o.reshape(b, num_heads, head_dim)
