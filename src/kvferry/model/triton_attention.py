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

from typing import Any

import torch

try:  # Triton ships with CUDA builds of torch; CPU installs may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_cs, stride_ch,  # cache strides per slot and per head (head_dim is contiguous)
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            h = tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)
            mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
            k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
            v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
            dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
            tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    # Triton compiles a variant per value class of an integer argument (1,
    # multiple of 16) and per pointer alignment. The block table's width and
    # the first sequence change from step to step, and the tensors are
    # always passed whole (never as slices at an offset), so that a serving
    # engine compiles each variant once, not in the middle of a step.
    @triton.jit(do_not_specialize=["stride_bt", "first_seq"])
    def _attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_ptr,
        first_seq,  # program s serves sequence first_seq + s
        scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_bt,
        GROUP: tl.constexpr,  # query heads per KV head
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per KV block
        BLOCK_Q: tl.constexpr,  # query tokens per program (BLOCK_Q * GROUP <= BLOCK_M)
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        # Float32 products (not TF32): float32 models, and Triton's
        # interpreter, whose dot multiplies bf16 bit patterns as integers.
        IEEE_DOT: tl.constexpr,
    ):
        seq = tl.program_id(0) + first_seq
        q_block = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        if q_block * BLOCK_Q < q_len:
            context_len = seq_len - q_len
            rows = tl.arange(0, BLOCK_M)
            q_idx = q_block * BLOCK_Q + rows // GROUP  # query token within the sequence
            head = kv_head * GROUP + rows % GROUP
            row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            token = (q_start + q_idx).to(tl.int64)
            q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE_DOT:
                q = q.to(tl.float32)
            q_pos = context_len + q_idx  # each row's position: it sees keys 0..q_pos
            # Keys past the tile's last query position are masked for every row.
            last_q = tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
            kv_end = tl.minimum(seq_len, context_len + last_q)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for start in range(0, kv_end, BLOCK_N):
                k_pos = start + tl.arange(0, BLOCK_N)
                k_ok = k_pos < kv_end
                block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
                block = block.to(tl.int64)
                offset = k_pos % BLOCK_SIZE
                kv_mask = k_ok[:, None] & d_ok[None, :]
                k = tl.load(k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks
                            + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
                            + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
                k = k.to(q.dtype)
                v = v.to(q.dtype)
                if IEEE_DOT:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = s * scale
                visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # A row that has seen no key yet keeps -inf: subtract 0 instead
                # so that exp() gives 0, never NaN.
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE_DOT:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            o = acc / l_safe[:, None]
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _kernels(interpret: bool) -> tuple[Any, Any]:
    """The two kernels: compiled for CUDA, or run by Triton's interpreter on
    CPU tensors. Triton decides which when it is first imported
    (``TRITON_INTERPRET=1``), so a CPU caller needs that set beforehand."""
    if triton is None:
        raise RuntimeError("the triton attention backend needs the triton package")
    if interpret and not _interpreted():
        raise RuntimeError("the triton attention backend runs CPU tensors only in Triton's interpreter: "
                           "set TRITON_INTERPRET=1 before triton is imported")
    return _write_kv_kernel, _attention_kernel


def _interpreted() -> bool:
    return type(_attention_kernel).__name__ == "InterpretedFunction"


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [tokens, kv_heads, head_dim] (head_dim contiguous);
    k/v_cache: [num_blocks, block_size, kv_heads, head_dim]; slot_mapping:
    [tokens] int, -1 = skip."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    write, _ = _kernels(k.device.type != "cuda")
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    # Slots index [num_blocks * block_size] rows of [kv_heads, head_dim].
    write[(tokens,)](
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
    _, attend = _kernels(q.device.type != "cuda")
    # Decodes: one query token, the group's heads padded to tl.dot's minimum
    # of 16 rows. Chunks: 64 rows of (token, head) pairs per program.
    block_m = max(16, _next_pow2(group)) if max_query_len == 1 else max(64, _next_pow2(group))
    block_q = max(block_m // group, 1)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), kv_heads)
    if q.stride(2) != 1:
        q = q.contiguous()
    attend[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, first_seq, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=max(16, min(64, block_size * 4)),
        IEEE_DOT=q.dtype == torch.float32 or _interpreted(),
    )
