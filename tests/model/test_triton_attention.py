"""The Triton attention kernels against the torch path, on the batch shapes a
step has: prompt chunks over cached context, fresh prompts, decodes, padding.

Without a GPU they run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET); with one, compiled (bf16 there uses the tensor cores)."""
import pytest
import torch

from kvferry.model import triton_attention
from kvferry.model.attention import AttentionMetadata, attention_backend, paged_attention

pytestmark = pytest.mark.skipif(not triton_attention.triton_available(), reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _step(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """Random q/k/v and a cache whose blocks are scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    tables, used = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64), 0
    for i, s in enumerate(seq_lens):
        n = -(-s // block_size)
        tables[i, :n] = perm[used:used + n]
        used += n
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tokens = sum(q_lens)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for i, (n, s) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(s - n, s):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    return dev(q), dev(k), dev(v), dev(cache), qsl, dev(tables), dev(torch.tensor(slots, dtype=torch.int64))


def _meta(qsl, seq_lens, slots, tables, block_size, num_prefills, triton):
    return AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, slot_mapping=slots, block_tables=tables,
                             block_size=block_size, num_prefills=num_prefills, triton=triton)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 32), (8, 2, 64)])
def test_triton_matches_torch_path(dtype, heads, kv_heads, head_dim):
    # A chunk over cached context, a fresh prompt, a 1-token chunk over a long
    # context, decodes at block boundaries and inside blocks.
    q_lens = [40, 23, 1, 1, 1, 1]
    seq_lens = [90, 23, 130, 16, 17, 1]
    block_size, num_prefills = 16, 2
    q, k, v, cache, qsl, tables, slots = _step(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    ref_cache = cache.clone()
    expected = paged_attention(q, k, v, ref_cache, _meta(qsl, seq_lens, slots, tables, block_size, num_prefills,
                                                         False), scale)
    got = paged_attention(q, k, v, cache, _meta(qsl, seq_lens, slots, tables, block_size, num_prefills, True),
                          scale)
    assert torch.equal(cache, ref_cache)  # the same K/V written to the same slots
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_padding_rows_touch_nothing():
    """A CUDA graph's padding: slot -1 writes no KV, length 0 gives zeros."""
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 16
    q, k, v, cache, qsl, tables, slots = _step([1, 1], [20, 5], heads, kv_heads, head_dim, block_size,
                                              torch.float32)
    padded_slots = torch.cat([slots, torch.full((2,), -1, dtype=torch.int64, device=DEVICE)])
    qp = torch.cat([q, torch.randn(2, heads, head_dim, device=DEVICE)])
    kp = torch.cat([k, torch.randn(2, kv_heads, head_dim, device=DEVICE)])
    vp = torch.cat([v, torch.randn(2, kv_heads, head_dim, device=DEVICE)])
    tables_p = torch.cat([tables, torch.zeros(2, tables.shape[1], dtype=torch.int64, device=DEVICE)])
    before = cache.clone()
    meta = _meta([0, 1, 2, 3, 4], [20, 5, 1, 1], padded_slots, tables_p, block_size, 0, True)
    meta.triton_seq_lens = torch.tensor([20, 5, 0, 0], dtype=torch.int32, device=DEVICE)
    out = paged_attention(qp, kp, vp, cache, meta, head_dim ** -0.5)
    assert torch.all(out[2:] == 0)
    changed = (cache != before).reshape(2, -1, kv_heads, head_dim).any(dim=(0, 2, 3)).nonzero().flatten()
    assert sorted(changed.tolist()) == sorted(slots.tolist())
    expected = paged_attention(q, k, v, before, _meta([0, 1, 2], [20, 5], slots, tables, block_size, 0, False),
                               head_dim ** -0.5)
    torch.testing.assert_close(out[:2], expected, atol=2e-5, rtol=2e-5)


def test_backend_choice(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what CPU needs for "triton" (set here on a GPU machine too)
    assert attention_backend("auto", torch.device("cpu")) == "torch"
    assert attention_backend("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        attention_backend("flash", torch.device("cpu"))


def test_triton_on_cpu_without_the_interpreter_is_refused_at_start(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        attention_backend("triton", torch.device("cpu"))
