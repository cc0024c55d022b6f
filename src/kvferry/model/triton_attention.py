"""Paged attention in Triton: the CUDA path's kernels.

Two kernels over the paged KV cache layout of ``attention.py``
(``[num_blocks, block_size, kv_heads, head_dim]`` per K and V):

- ``write_kv``: scatters the step's new K/V rows into their slots; a
  negative slot is skipped (the padding rows of a CUDA-graph decode batch).
- ``paged_attention``: causal attention of every sequence's new tokens over
  its whole context, prompt chunks and decodes alike (vLLM v1's "unified"
  shape). A program takes one sequence, one KV head and a tile of query
  rows: ``BLOCK_M`` rows are (query token, query head of that KV head's
  group) pairs, so a GQA group shares each K/V tile it reads. K/V tiles of
  ``BLOCK_N`` positions are gathered through the block table, with an
  online softmax in float32. Everything a launch depends on is in tensors
  (sequence lengths, query starts, block tables): a decode launch of a given
  batch size is the same kernel call whatever the lengths, which is what a
  CUDA graph needs. A sequence of length 0 writes zeros (padding).

On CUDA the kernels are compiled by Triton. On CPU tensors they run in
Triton's interpreter (numpy), which is how the test suite checks them on
machines without a GPU; nothing on CPU chooses them unless asked
(``attention_backend="triton"``).
"""
from __future__ import annotations

import importlib.util
from types import ModuleType

import torch


def triton_available() -> bool:
    """Triton is installed (CUDA builds of torch ship it; CPU installs may not)."""
    return importlib.util.find_spec("triton") is not None


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _kernels(interpret: bool) -> ModuleType:
    """The kernels' module: compiled for CUDA, or run by Triton's interpreter
    on CPU tensors. Triton decides which when it is first imported
    (``TRITON_INTERPRET=1``), so a CPU caller needs that set beforehand."""
    if not triton_available():
        raise RuntimeError("the triton attention backend needs the triton package")
    import kvferry.model.triton_kernels as triton_kernels

    if interpret and not _interpreted(triton_kernels):
        raise RuntimeError("the triton attention backend runs CPU tensors only in Triton's interpreter: "
                           "set TRITON_INTERPRET=1 before triton is imported")
    return triton_kernels


def _interpreted(kernels: ModuleType) -> bool:
    return type(kernels.attention_kernel).__name__ == "InterpretedFunction"


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [tokens, kv_heads, head_dim] (head_dim contiguous);
    k/v_cache: [num_blocks, block_size, kv_heads, head_dim]; slot_mapping:
    [tokens] int, -1 = skip."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    kernels = _kernels(k.device.type != "cuda")
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    # Slots index [num_blocks * block_size] rows of [kv_heads, head_dim].
    kernels.write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=_next_pow2(kv_heads), BLOCK_D=_next_pow2(head_dim),
    )


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    max_query_len: int, scale: float, first_seq: int = 0, num_seqs: int | None = None) -> None:
    """Attention of sequences ``first_seq .. first_seq + num_seqs - 1`` (default:
    all of ``seq_lens``), written into ``out``.

    q, out: [tokens, num_heads, head_dim]; k/v_cache: [num_blocks,
    block_size, kv_heads, head_dim]; block_tables: [seqs, max_blocks];
    seq_lens: [seqs] (context after this step); query_start_loc: [seqs + 1]:
    sequence s owns rows query_start_loc[s] .. query_start_loc[s + 1] - 1,
    its last positions. ``max_query_len`` bounds the query tiles launched
    (1 for decodes).
    """
    if num_seqs is None:
        num_seqs = seq_lens.shape[0] - first_seq
    if num_seqs <= 0:
        return
    _, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    kernels = _kernels(q.device.type != "cuda")
    # Decodes: one query token, the group's heads padded to tl.dot's minimum
    # of 16 rows. Chunks: 64 rows of (token, head) pairs per program.
    block_m = max(16, _next_pow2(group)) if max_query_len == 1 else max(64, _next_pow2(group))
    block_q = max(block_m // group, 1)
    grid = (num_seqs, -(-max_query_len // block_q), kv_heads)
    if q.stride(2) != 1:
        q = q.contiguous()
    kernels.attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, first_seq, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=max(16, min(64, block_size * 4)),
        IEEE_DOT=q.dtype == torch.float32 or _interpreted(kernels),
    )
