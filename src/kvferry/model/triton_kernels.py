"""The Triton kernels behind ``triton_attention.py`` (which documents them).

Imported only when the Triton backend is used: importing Triton costs
0.1-0.2 s, which a CPU engine on the torch backend never pays.
"""
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
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
def attention_kernel(
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
