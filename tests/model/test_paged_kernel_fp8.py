"""The paged kernel over fp8 caches (float8_e5m2, float8_e4m3fn) against the
same kernel over the dequantized cache (float32 / bf16: every value of both
formats is exact in both) and a float64 softmax; and attention.py over them
against the torch path."""

import pytest
import torch

from kvferry.model import paged_kernel
from kvferry.model.kv_cache_dtype import to_cache_dtype
from tests.model.paged_harness import scattered_tables

ISA = paged_kernel.kernel_isa()
FORMATS = [torch.float8_e5m2, torch.float8_e4m3fn]


@pytest.fixture(params=FORMATS, ids=["e5m2", "e4m3"])
def fp8(request):
    return request.param


@pytest.fixture(scope="module")
def kernel():
    k = paged_kernel.get_paged_decode_kernel()
    assert k is not None
    return k


def explicit(q, kf, vf, table, seq_len, q_start, q_len, scale, group):
    d = q.shape[-1]
    keys = kf[table].reshape(-1, kf.shape[2], d)[:seq_len].double()
    vals = vf[table].reshape(-1, vf.shape[2], d)[:seq_len].double()
    qs = q[q_start:q_start + q_len].double()
    keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
    scores = torch.einsum("jhd,shd->hjs", qs, keys) * scale
    pos = torch.arange(seq_len)
    visible = pos[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hjs,shd->jhd", probs, vals)


def fp8_values(shape, gen, fp8, spread=1.0):
    """randn with a few subnormals (e5m2: |x| < 2^-14, e4m3: < 2^-6), zeros of both signs and large
    values (e4m3: some past 448, saturated as the cache's writes saturate)."""
    x = torch.randn(shape, generator=gen) * spread
    r = torch.rand(shape, generator=gen)
    tiny = 3e-5 if fp8 == torch.float8_e5m2 else 4e-3
    x = torch.where(r < 0.05, x * tiny, x)           # subnormals and underflow to zero
    x = torch.where((r > 0.05) & (r < 0.07), torch.zeros(()) * torch.sign(x), x)  # +-0
    x = torch.where((r > 0.07) & (r < 0.08), x * 40, x)
    if fp8 == torch.float8_e4m3fn:
        x = torch.where((r > 0.08) & (r < 0.082), x * 400, x)
    return to_cache_dtype(x, fp8)


def make_case(q_lens, ctx_lens, kv_heads, group, head_dim, block_size, qdtype, seed, fp8, q_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    tables, num_blocks = scattered_tables(seq_lens, block_size, 3, gen)
    nan = torch.full((num_blocks, block_size, kv_heads, head_dim), 0x7F, dtype=torch.uint8).view(fp8)
    kc, vc = nan.clone(), nan.clone()  # NaN wherever no token was written
    # Every written slot at once (a Python loop per token was most of this module's time).
    pos = torch.cat([torch.arange(s) for s in seq_lens])
    rows = torch.cat([torch.full((s,), r) for r, s in enumerate(seq_lens)])
    blk, off = tables[rows, pos // block_size], pos % block_size
    kc[blk, off] = fp8_values((len(pos), kv_heads, head_dim), gen, fp8)
    vc[blk, off] = fp8_values((len(pos), kv_heads, head_dim), gen, fp8)
    starts, acc = [], 0
    for q in q_lens:
        starts.append(acc)
        acc += q + 1  # a gap row between sequences: left alone
    tokens = acc
    wide = (torch.randn(tokens, kv_heads * group + 2, head_dim, generator=gen) * q_scale).to(qdtype)
    q = wide[:, 1:1 + kv_heads * group]  # strided token rows
    return q, kc, vc, tables, seq_lens, starts


def run(kernel, q, kc, vc, tables, seq_lens, starts, q_lens, scale):
    out = torch.full(q.shape, 7.0, dtype=q.dtype)
    kernel(q, kc, vc, tables, torch.tensor(seq_lens), torch.tensor(starts), torch.tensor(q_lens), scale, out)
    return out


Q_LENS = [1, 3, 16, 40, 1, 1, 2, 1]
CTX = [0, 5, 100, 77, 16, 128, 31, 250]   # seq lens 1, 8, 116, 117, 17, 129, 33, 251


def same_route_as_bf16(head_dim, group, q_lens):
    """Whether every item of a bf16 query over fp8 takes the kernel it takes over a bf16 cache
    (the fp8 cache stages the items run_inplace would read in place)."""
    if ISA == "avx2":
        return True
    fast = {32: 3, 64: 3, 128: 2}.get(head_dim, 0)
    return all(q * group >= 4 or q * group <= fast for q in q_lens)


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 96, 48, 80, 16, 40])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_fp8_cache(kernel, qdtype, group, head_dim, block_size, fp8):
    kv_heads = 2 if head_dim != 64 else 3
    q, kc, vc, tables, seq_lens, starts = make_case(Q_LENS, CTX, kv_heads, group, head_dim, block_size, qdtype,
                                                    seed=head_dim * 100 + group * 10 + block_size, fp8=fp8)
    scale = head_dim ** -0.5
    out = run(kernel, q, kc, vc, tables, seq_lens, starts, Q_LENS, scale)
    kf, vf = kc.float(), vc.float()
    assert torch.isfinite(out).all()  # no NaN slot was read
    gaps = [s + ql for s, ql in zip(starts, Q_LENS)]
    assert (out[gaps] == 7.0).all()
    # 1. The float32 kernel over the dequantized cache, query as float32.
    ref32 = run(kernel, q.float(), kf, vf, tables, seq_lens, starts, Q_LENS, scale)
    fp8_dpbf16_build = paged_kernel.kernel_path(torch.bfloat16, fp8, 64) == "dpbf16"
    if qdtype == torch.bfloat16 and fp8_dpbf16_build and head_dim % 32:
        # run()'s per-query loop, as for a bf16 query over the float32 cache: the same bits.
        ref = run(kernel, q, kf, vf, tables, seq_lens, starts, Q_LENS, scale)
        assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()
    elif qdtype != torch.bfloat16 or paged_kernel.kernel_path(qdtype, fp8, head_dim) != "dpbf16":
        # The same float32 kernels over the same float values: the same bits.
        assert torch.equal(out, ref32.to(qdtype)), (out.float() - ref32).abs().max()
    else:
        # 2. vdpbf16ps: the bf16 kernel over the cache as bf16 (exact), the same bits where the routes agree.
        ref16 = run(kernel, q, kc.bfloat16(), vc.bfloat16(), tables, seq_lens, starts, Q_LENS, scale)
        if same_route_as_bf16(head_dim, group, Q_LENS):
            assert torch.equal(out, ref16), (out.float() - ref16.float()).abs().max()
        else:
            torch.testing.assert_close(out.float(), ref16.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out.float(), ref32, atol=2e-2, rtol=2e-2)
    # 3. float64 softmax over the dequantized cache.
    # (float32: the float32 kernels themselves, which the output equals bit for bit above, are within
    # ~3e-5 of float64 here: the data has values up to ~1e3.)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[qdtype]
    for r in range(len(seq_lens)):
        exp = explicit(q, kf, vf, tables[r], seq_lens[r], starts[r], Q_LENS[r], scale, group)
        got = out[starts[r]:starts[r] + Q_LENS[r]].double()
        torch.testing.assert_close(got, exp, atol=tol, rtol=tol)
    # float32 query: within 2e-3 of the float32 kernel
    if qdtype == torch.float32:
        assert (out - ref32).abs().max() < 2e-3


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_fp8_peaked_scores(kernel, qdtype, fp8):
    """Queries scaled up: the running max moves often; decode and a 24-token chunk."""
    q_lens, ctx = [1, 24, 1], [299, 276, 64]
    q, kc, vc, tables, seq_lens, starts = make_case(q_lens, ctx, 2, 4, 64, 16, qdtype, seed=9, fp8=fp8,
                                                    q_scale=6.0)
    out = run(kernel, q, kc, vc, tables, seq_lens, starts, q_lens, 0.125)
    kf, vf = kc.float(), vc.float()
    if qdtype == torch.float32:  # the float32 kernel over the dequantized cache, bit for bit
        assert torch.equal(out, run(kernel, q, kf, vf, tables, seq_lens, starts, q_lens, 0.125))
    for r in range(3):
        exp = explicit(q, kf, vf, tables[r], seq_lens[r], starts[r], q_lens[r], 0.125, 4)
        tol = 1e-4 if qdtype == torch.float32 else 3e-2  # scores of tens of units (values up to ~1e3)
        torch.testing.assert_close(out[starts[r]:starts[r] + q_lens[r]].double(), exp, atol=tol, rtol=tol)


def test_fp8_path_names(kernel, fp8):
    from kvferry.model.cpu_features import cpu_features
    bf16_path = paged_kernel.kernel_path(torch.bfloat16, torch.bfloat16, 64)
    p = paged_kernel.kernel_path(torch.bfloat16, fp8, 64)
    avx2_build = ISA == "avx2" or not cpu_features().avx512  # asked for, or all this CPU has
    if avx2_build:
        assert p == bf16_path == "portable"
    elif "avx512_bf16" in cpu_features().flags and "avx512vbmi" in cpu_features().flags:
        assert p == "dpbf16"
    else:
        assert p == "avx512"
    assert paged_kernel.kernel_path(torch.float32, fp8, 64) == ("portable" if avx2_build else "avx512")
    assert paged_kernel.kernel_path(torch.bfloat16, fp8, 40) == "portable"
    assert paged_kernel.kernel_path(torch.bfloat16, fp8, 48) in ("avx512", "portable")


def test_fp8_through_attention_py(kernel, monkeypatch, fp8):
    """paged_attention (write_kv into the fp8 cache, then the kernel) against the torch path."""
    from kvferry.model.attention import AttentionMetadata, paged_attention
    gen = torch.Generator().manual_seed(5)
    kvh, group, d, bs = 3, 3, 64, 16
    q_lens, ctx = [5, 16, 1, 1], [40, 0, 100, 7]  # prefills first
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    tables, nb = scattered_tables(seq_lens, bs, 2, gen)
    cache = torch.full((2, nb, bs, kvh, d), 0x7F, dtype=torch.uint8).view(fp8)
    slots, qsl = [], [0]
    for r in range(len(seq_lens)):
        for p in range(seq_lens[r]):
            b, off = tables[r, p // bs], p % bs
            if p < ctx[r]:
                cache[:, b, off] = fp8_values((2, kvh, d), gen, fp8)
            else:
                slots.append(int(b) * bs + off)
        qsl.append(qsl[-1] + q_lens[r])
    T = sum(q_lens)
    q = torch.randn(T, kvh * group, d, generator=gen).bfloat16()
    k = torch.randn(T, kvh, d, generator=gen).bfloat16()
    # The last KV head's V past e4m3's 448: both paths saturate it alike.
    v_scale = torch.tensor([1.0, 1.0, 600.0])
    v = (torch.randn(T, kvh, d, generator=gen) * v_scale[:, None]).bfloat16()
    meta_args = dict(query_start_loc=qsl, seq_lens=seq_lens, slot_mapping=torch.tensor(slots), block_tables=tables,
                     block_size=bs, num_prefills=sum(ql > 1 for ql in q_lens), kv_dtype=fp8)
    outs = {}
    for disable in ("0", "1"):
        monkeypatch.setenv("KVFERRY_DISABLE_CPP_KERNELS", disable)
        meta = AttentionMetadata(**meta_args)
        meta.prepare()
        c = cache.clone()
        outs[disable] = (paged_attention(q, k, v, c, meta, d ** -0.5), c)
    per_head = v_scale.repeat_interleave(group)[None, :, None]  # outputs in units of their V's spread
    torch.testing.assert_close(outs["0"][0].float() / per_head, outs["1"][0].float() / per_head,
                               atol=2e-2, rtol=2e-2)
    assert torch.equal(outs["0"][1].view(torch.uint8), outs["1"][1].view(torch.uint8))
