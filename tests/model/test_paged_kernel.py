"""The C++ paged attention kernel against the torch path of attention.py.

Caches are filled with NaN everywhere no token was written, so any read past
a request's length (or of a block it does not own) shows up in the output.
"""
from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from kvferry.model import paged_kernel
from kvferry.model.attention import AttentionMetadata, paged_attention
from tests.model.paged_harness import scattered_tables


@pytest.fixture(scope="module")
def kernel():
    k = paged_kernel.get_paged_decode_kernel()
    if k is None:
        pytest.skip("C++ paged attention kernel unavailable "
                    "(KVFERRY_DISABLE_CPP_KERNELS set, or the build failed: see the log)")
    return k


def _batch(q_lens, seq_lens, kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """A NaN-filled cache with each request's context written at shuffled
    blocks, plus the metadata of one step with q_lens new tokens per request."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks stay NaN
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    tables = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int64)
    slots, qsl = [], [0]
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        tables[r, :blocks_per_req[r]] = torch.tensor([ids.pop() for _ in range(blocks_per_req[r])])
        for p in range(seq_len):
            b, off = tables[r, p // block_size], p % block_size
            if p < seq_len - q_len:  # cached context; new tokens are written by paged_attention
                cache[:, b, off] = torch.randn(2, kv_heads, head_dim, generator=gen).to(dtype)
            else:
                slots.append(int(b) * block_size + off)
        qsl.append(qsl[-1] + q_len)
    meta_args = dict(query_start_loc=qsl, seq_lens=list(seq_lens), slot_mapping=torch.tensor(slots),
                     block_tables=tables, block_size=block_size, num_prefills=sum(q > 1 for q in q_lens))
    return cache, meta_args, gen


def _run(monkeypatch, disable: bool, q, k, v, cache, meta_args, scale):
    monkeypatch.setenv("KVFERRY_DISABLE_CPP_KERNELS", "1" if disable else "0")
    meta = AttentionMetadata(**meta_args)
    meta.prepare()
    assert (meta.kernel is None) == disable
    out = paged_attention(q, k, v, cache.clone(), meta, scale)
    return out, meta


@pytest.mark.parametrize("group", [1, 3, 4])
# 40 is no multiple of 16: the AVX-512 build falls back to its 8-lane path
@pytest.mark.parametrize("head_dim", [32, 40, 64, 80, 128])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_matches_torch_path(kernel, monkeypatch, group, head_dim, block_size):
    kv_heads = 2
    seq_lens = [1, block_size, 2 * block_size, 3 * block_size + 1, 37, 100, block_size - 1, 5]
    cache, meta_args, gen = _batch([1] * len(seq_lens), seq_lens, kv_heads, head_dim, block_size, seed=head_dim + group)
    n = len(seq_lens)
    q = torch.randn(n, kv_heads * group, head_dim, generator=gen)
    k = torch.randn(n, kv_heads, head_dim, generator=gen)
    v = torch.randn(n, kv_heads, head_dim, generator=gen)
    ref, ref_meta = _run(monkeypatch, True, q, k, v, cache, meta_args, head_dim ** -0.5)
    out, meta = _run(monkeypatch, False, q, k, v, cache, meta_args, head_dim ** -0.5)
    assert ref_meta.decode_slots is not None
    assert meta.decode_slots is None and meta.decode_mask is None  # kernel path skips the padded gather
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_short_chunks_over_context_match_torch_path(kernel, monkeypatch):
    """Verify windows / short chunks (kernel, causal inside the chunk), a
    chunk over the kernel's limit (SDPA either way; the limit lowered to 16
    here), a short fresh prompt (kernel), and decodes in one step; then the
    same step at the real limit, every chunk through the kernel."""
    from kvferry.model import attention

    monkeypatch.setattr(attention, "_KERNEL_MAX_PREFILL_TOKENS", 16)
    q_lens, seq_lens = [4, 16, 40, 7, 1, 1], [53, 16 + 16, 90, 7, 20, 1]
    kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    cache, meta_args, gen = _batch(q_lens, seq_lens, kv_heads, head_dim, block_size)
    t = sum(q_lens)
    q = torch.randn(t, kv_heads * group, head_dim, generator=gen)
    k = torch.randn(t, kv_heads, head_dim, generator=gen)
    v = torch.randn(t, kv_heads, head_dim, generator=gen)
    ref, _ = _run(monkeypatch, True, q, k, v, cache, meta_args, 0.125)
    out, meta = _run(monkeypatch, False, q, k, v, cache, meta_args, 0.125)
    assert [p.use_kernel for p in meta.prefills] == [True, True, False, True]
    # One kernel call: the short chunks (requests 0, 1 over context, 3 a fresh
    # prompt), then the decodes.
    assert meta.kernel_seq_lens.tolist() == [53, 32, 7, 20, 1]
    assert meta.kernel_query_starts.tolist() == [0, 4, 60, 67, 68]
    assert meta.kernel_query_lens.tolist() == [4, 16, 7, 1, 1]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(attention, "_KERNEL_MAX_PREFILL_TOKENS", 8192)
    out, meta = _run(monkeypatch, False, q, k, v, cache, meta_args, 0.125)
    assert [p.use_kernel for p in meta.prefills] == [True, True, True, True]
    assert meta.kernel_query_lens.tolist() == [4, 16, 40, 7, 1, 1]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 40])  # read in place (AVX-512) / via a float buffer
def test_half_precision_cache(kernel, monkeypatch, dtype, head_dim):
    seq_lens = [1, 33, 64, 90]
    cache, meta_args, gen = _batch([1] * 4, seq_lens, 2, head_dim, 16, dtype=dtype)
    q = torch.randn(4, 4, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(4, 2, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(4, 2, head_dim, generator=gen, dtype=dtype)
    ref, _ = _run(monkeypatch, True, q, k, v, cache, meta_args, 0.125)
    out, _ = _run(monkeypatch, False, q, k, v, cache, meta_args, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_float64_cache_falls_back_to_torch(kernel, monkeypatch):
    """A cache dtype the kernel does not read: the same metadata builds the
    torch path's tensors on demand."""
    cache, meta_args, gen = _batch([3, 1, 1], [20, 9, 30], 2, 32, 8, dtype=torch.float64)
    q, k, v = (torch.randn(5, h, 32, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    ref, _ = _run(monkeypatch, True, q, k, v, cache, meta_args, 0.2)
    out, meta = _run(monkeypatch, False, q, k, v, cache, meta_args, 0.2)
    assert meta.decode_slots is not None and meta.prefills[0].slots is not None
    torch.testing.assert_close(out, ref)


def test_kernel_against_explicit_softmax(kernel):
    """Direct call on a [num_blocks, block_size, KVH, D] cache with int32 lengths."""
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, 4, 1, 8, generator=gen)
    v_cache = torch.randn(6, 4, 1, 8, generator=gen)
    q = torch.randn(2, 2, 8, generator=gen)
    tables = torch.tensor([[5, 2, 0], [3, 0, 0]])
    out = torch.empty_like(q)
    kernel(q, k_cache, v_cache, tables, torch.tensor([9, 3], dtype=torch.int32), torch.tensor([0, 1]),
           torch.tensor([1, 1]), 0.5, out)
    for r, (blocks, n) in enumerate([([5, 2, 0], 9), ([3], 3)]):
        keys = k_cache[blocks].reshape(-1, 8)[:n]  # [n, D]
        vals = v_cache[blocks].reshape(-1, 8)[:n]
        expected = torch.softmax(q[r] @ keys.T * 0.5, dim=-1) @ vals  # [H, D]
        torch.testing.assert_close(out[r], expected, atol=1e-5, rtol=1e-5)


def test_bad_block_table_is_an_error(kernel):
    cache = torch.zeros(4, 4, 1, 8)
    q = torch.zeros(1, 1, 8)
    one = torch.tensor([1])
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(q, cache, cache, torch.tensor([[0, 7]]), torch.tensor([6]), torch.tensor([0]), one, 1.0, q.clone())
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel(q, cache, cache, torch.tensor([[0, 1]]), torch.tensor([9]), torch.tensor([0]), one, 1.0, q.clone())
    with pytest.raises(RuntimeError, match="query rows"):
        kernel(q, cache, cache, torch.tensor([[0, 1]]), torch.tensor([6]), torch.tensor([1]), one, 1.0, q.clone())


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("KVFERRY_DISABLE_CPP_KERNELS", "1")
    assert paged_kernel.get_paged_decode_kernel() is None


def test_not_built_at_import():
    code = ("import kvferry.model.llama, kvferry.model.attention as a, kvferry.model.paged_kernel as p; "
            "assert not p._loaded; import torch; assert not hasattr(torch.ops.kvferry, 'paged_attention')")
    subprocess.run([sys.executable, "-c", code], check=True)


# A library as small as a build can be, so that the test times the cache's
# locking rather than the compiler (the paged kernel alone takes minutes to
# build cold on a slow CPU); it loads through the kernels' own build path.
# No torch headers (ATen alone takes ~15 s to compile on a slow CPU): what
# is tested is the cache and its lock, which are the same for any source.
_TINY_SOURCE = r"""
extern "C" int kvferry_build_test_twice(int x) { return 2 * x; }
"""

# Each process waits until all are imported (a barrier of files), so that
# their builds (~0.4 s) start together.
_BUILD = """
import ctypes, os, sys, time, uuid
from pathlib import Path
from kvferry.model import paged_kernel
barrier, parties = Path(sys.argv[2]), int(sys.argv[3])
(barrier / uuid.uuid4().hex).touch()
deadline = time.monotonic() + 120  # a sibling that died never arrives
while len(list(barrier.iterdir())) < parties and time.monotonic() < deadline:
    time.sleep(0.005)
assert paged_kernel.try_load_library("kvferry_build_test", Path(sys.argv[1]), [], "a test library", "nothing")
[lib] = Path(os.environ["KVFERRY_CACHE_DIR"]).glob("torch_ext/kvferry_build_test_*/*.so")
assert ctypes.CDLL(str(lib)).kvferry_build_test_twice(21) == 42
"""


def test_concurrent_first_builds_share_one_cache(kernel, tmp_path):  # kernel: skips where nothing builds
    """Several processes building into one empty cache at once (as servers
    started together do) all get a working library; one build is left."""
    source = tmp_path / "tiny.cpp"
    source.write_text(_TINY_SOURCE)
    cache = tmp_path / "cache"
    env = {**__import__("os").environ, "KVFERRY_CACHE_DIR": str(cache), "KVFERRY_DISABLE_CPP_KERNELS": "0"}
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD, str(source), str(barrier), "3"], env=env)
             for _ in range(3)]
    assert [p.wait(timeout=600) for p in procs] == [0, 0, 0]
    builds = list((cache / "torch_ext").iterdir())
    assert len(builds) == 1 and (builds[0] / f"{builds[0].name}.so").exists()
    assert not (builds[0] / "lock").exists()


def _explicit(q, k_cache, v_cache, table, seq_len, q_start, q_len, scale, group):
    """float64 softmax attention of one sequence's query rows, causal inside the chunk."""
    d = q.shape[-1]
    keys = k_cache[table].reshape(-1, k_cache.shape[2], d)[:seq_len].double()  # [S, KVH, D]
    vals = v_cache[table].reshape(-1, v_cache.shape[2], d)[:seq_len].double()
    qs = q[q_start:q_start + q_len].double()  # [q_len, H, D]
    keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)  # [S, H, D]
    scores = torch.einsum("jhd,shd->hjs", qs, keys) * scale
    pos = torch.arange(seq_len)
    visible = pos[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]  # [q_len, S]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hjs,shd->jhd", probs, vals)


def _multi_query_case(dtype, block_size, head_dim, seed):
    """Sequences with 1..17 query rows (decode, verify windows, chunks longer
    than a tile), scattered blocks, q a strided column slice, a gap row."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, group = 3, 3
    q_lens, seq_lens = [1, 3, 5, 16, 17, 2], [40, 3, 37, 16, 50, 9]
    starts = [0, 1, 5, 10, 26, 44]  # row 4 belongs to no sequence
    tables, num_blocks = scattered_tables(seq_lens, block_size, 2, gen)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tokens = starts[-1] + q_lens[-1]
    wide = torch.randn(tokens, kv_heads * group + 2, head_dim, generator=gen).to(dtype)
    q = wide[:, 1:1 + kv_heads * group]  # token rows strided, as q sliced from the fused qkv
    return q, k_cache, v_cache, tables, seq_lens, starts, q_lens, group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (8, 64), (16, 32), (4, 80)])
def test_multi_query_causal_against_explicit_softmax(kernel, dtype, block_size, head_dim):
    q, k_cache, v_cache, tables, seq_lens, starts, q_lens, group = _multi_query_case(dtype, block_size, head_dim, 3)
    out = torch.full(q.shape, 7.0, dtype=dtype)
    scale = head_dim ** -0.5
    kernel(q, k_cache, v_cache, tables, torch.tensor(seq_lens), torch.tensor(starts), torch.tensor(q_lens),
           scale, out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output itself is rounded to bf16
    for r in range(len(seq_lens)):
        expected = _explicit(q, k_cache, v_cache, tables[r], seq_lens[r], starts[r], q_lens[r], scale, group)
        got = out[starts[r]:starts[r] + q_lens[r]].double()
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    assert (out[4] == 7.0).all()  # rows of no sequence are left alone


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float8_e4m3fn),
                                               (torch.bfloat16, torch.float8_e5m2)])
@pytest.mark.parametrize("kv_heads,group,head_dim,block_size",
                         [(3, 3, 64, 16), (2, 1, 32, 8), (8, 2, 128, 32), (3, 3, 64, 5), (3, 3, 64, 64)])
def test_all_heads_items_match_per_head_items(kernel, dtype, cache_dtype, kv_heads, group, head_dim, block_size):
    """A decode batch large enough that each sequence runs as one item over
    all KV heads (rows read whole) where the build has such items (float32
    in the AVX2 and AVX-512 builds; a bf16 query over a bf16 or fp8 cache
    with AVX512-BF16; elsewhere the items are per head either way): the same
    bits as per-head items (KVFERRY_ATTN_ALL_HEADS_ITEMS=0), and a float64
    softmax's result. Contexts end inside, at and past a tile; a verify
    window (2 tokens) and a prompt chunk (9 tokens: per-head items) share
    the step; blocks of 16, 32 and 64 take the hand-off prefetch 16 rows at
    a time, other block sizes the per-row one."""
    _all_heads_check(kernel, dtype, cache_dtype, kv_heads, group, head_dim, block_size)


def _all_heads_check(kernel, dtype, cache_dtype, kv_heads, group, head_dim, block_size):
    import os

    gen = torch.Generator().manual_seed(kv_heads * 100 + head_dim + block_size)
    q_lens = [1] * 8 + [2, 9]
    seq_lens = [1, 15, 16, 17, 40, 100, 257, 300, 33, 60]
    tables, num_blocks = scattered_tables(seq_lens, block_size, 3, gen)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    starts = [sum(q_lens[:r]) for r in range(len(q_lens))]
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    args = (tables, torch.tensor(seq_lens), torch.tensor(starts), torch.tensor(q_lens), head_dim ** -0.5)
    outs = {}
    before = os.environ.get("KVFERRY_ATTN_ALL_HEADS_ITEMS")
    try:
        for mode in ("1", "0"):
            os.environ["KVFERRY_ATTN_ALL_HEADS_ITEMS"] = mode
            outs[mode] = torch.full(q.shape, 7.0, dtype=dtype)
            kernel(q, k_cache, v_cache, *args, outs[mode])
    finally:
        if before is None:
            os.environ.pop("KVFERRY_ATTN_ALL_HEADS_ITEMS", None)
        else:
            os.environ["KVFERRY_ATTN_ALL_HEADS_ITEMS"] = before
    assert torch.equal(outs["1"], outs["0"])
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output itself is rounded to bf16
    kf, vf = k_cache.float(), v_cache.float()  # an fp8 cache's exact values
    for r in range(len(seq_lens)):
        expected = _explicit(q.float(), kf, vf, tables[r], seq_lens[r], starts[r], q_lens[r], head_dim ** -0.5,
                             group)
        torch.testing.assert_close(outs["1"][starts[r]:starts[r] + q_lens[r]].double(), expected, atol=tol, rtol=tol)


def _staged_items_check(kernel, kv_heads, group, head_dim, block_size, cache_dtype):
    """Items of 4 or more float32 query vectors (a group-1 verify window of
    4, a verify window of 2 tokens, a chunk over cached context, a fresh
    prompt split into query blocks) with the AVX2 build's staged groups and
    with run()'s per-query loop (KVFERRY_ATTN_STAGED_AVX2=0): each within
    1e-5 of a float64 softmax, and of each other. The long sequences span
    several staged stripes; NaN fills every slot past a sequence's length,
    so a row read there would poison its output."""
    q_lens = [4, 2, 37, 70, 1]
    seq_lens = [104, 302, 87, 70, 700]
    _toggle_check(kernel, "KVFERRY_ATTN_STAGED_AVX2", q_lens, seq_lens, kv_heads, group, head_dim, block_size,
                  cache_dtype, torch.float32, seed=kv_heads * 1000 + head_dim * 10 + block_size)


def _toggle_check(kernel, env, q_lens, seq_lens, kv_heads, group, head_dim, block_size, cache_dtype, q_dtype, seed,
                  tol=1e-5):
    """One step over a NaN-padded cache (a row read past a sequence's
    length poisons its output) with the kernel path that environment
    variable `env` turns off on ("1") and off ("0"): each within tol of a
    float64 softmax, and of each other."""
    import os

    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = scattered_tables(seq_lens, block_size, 3, gen)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for r, n in enumerate(seq_lens):
        rows = torch.arange(n)
        blocks, offsets = tables[r, rows // block_size], rows % block_size
        k_cache[blocks, offsets] = torch.randn(n, kv_heads, head_dim, generator=gen)
        v_cache[blocks, offsets] = torch.randn(n, kv_heads, head_dim, generator=gen)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    starts = [sum(q_lens[:r]) for r in range(len(q_lens))]
    q = (torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen) * 2).to(q_dtype)
    args = (tables, torch.tensor(seq_lens), torch.tensor(starts), torch.tensor(q_lens), head_dim ** -0.5)
    outs = {}
    before = os.environ.get(env)
    try:
        for mode in ("1", "0"):
            os.environ[env] = mode
            outs[mode] = torch.full(q.shape, 7.0, dtype=q_dtype)
            kernel(q, k_cache, v_cache, *args, outs[mode])
    finally:
        if before is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = before
    kf, vf = k_cache.float(), v_cache.float()
    for mode, out in outs.items():
        assert torch.isfinite(out).all(), mode
        for r in range(len(seq_lens)):
            expected = _explicit(q.float(), kf, vf, tables[r], seq_lens[r], starts[r], q_lens[r], head_dim ** -0.5,
                                 group)
            torch.testing.assert_close(out[starts[r]:starts[r] + q_lens[r]].double(), expected, atol=tol,
                                       rtol=tol, msg=lambda m, mode=mode, r=r: f"{env}={mode} row {r}: {m}")
    torch.testing.assert_close(outs["1"].double(), outs["0"].double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,cache_dtype",
                         [(3, 3, 64, 16, torch.float32), (2, 1, 32, 5, torch.float32),
                          (1, 4, 128, 16, torch.float32), (2, 2, 40, 8, torch.float32),
                          (3, 3, 64, 16, torch.float8_e4m3fn)])
def test_staged_items_match_the_per_query_loop(kernel, kv_heads, group, head_dim, block_size, cache_dtype):
    _staged_items_check(kernel, kv_heads, group, head_dim, block_size, cache_dtype)


# (q_lens, seq_lens): one decode sequence (parts of 256+ positions: 7);
# a decode and a 4-token verify window (4 parts each); two decodes, one too
# short to split, and a 40-token chunk over 600 cached positions.
_SPLIT_BATCHES = [([1], [2000]), ([1, 4], [1500, 1204]), ([1, 1, 40], [600, 255, 640])]


def _split_check(kernel, batch, kv_heads, group, head_dim, block_size, cache_dtype, q_dtype=torch.float32):
    q_lens, seq_lens = _SPLIT_BATCHES[batch]
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2  # bf16: the output itself is rounded to bf16
    _toggle_check(kernel, "KVFERRY_ATTN_SPLIT_CONTEXT", q_lens, seq_lens, kv_heads, group, head_dim, block_size,
                  cache_dtype, q_dtype, seed=batch * 100 + head_dim + block_size, tol=tol)


@pytest.mark.parametrize("batch,kv_heads,group,head_dim,block_size,cache_dtype,q_dtype",
                         [(0, 3, 3, 64, 16, torch.float32, torch.float32),
                          (1, 2, 1, 32, 5, torch.float32, torch.float32),
                          (2, 8, 2, 128, 32, torch.float32, torch.float32),
                          (0, 2, 2, 40, 300, torch.float32, torch.float32),
                          (1, 3, 3, 64, 16, torch.float8_e4m3fn, torch.float32),
                          (1, 3, 3, 64, 16, torch.bfloat16, torch.bfloat16),
                          (2, 2, 4, 64, 16, torch.float8_e5m2, torch.bfloat16)])
def test_context_parts_match_whole_contexts(kernel, batch, kv_heads, group, head_dim, block_size, cache_dtype,
                                             q_dtype):
    """Batches of 1-3 sequences over long contexts, each cut into parts
    that run as items of their own and are merged after (split items), and
    whole (KVFERRY_ATTN_SPLIT_CONTEXT=0): both match a float64 softmax, and
    each other. Covers per-head and all-heads items, the staged verify and
    chunk items, a head_dim with an 8-lane tail (40), block sizes that do
    not divide a tile (5) or a part (300: the cut falls on a block
    boundary), fp8 and bf16 caches (on an AVX-512 CPU, the dpbf16 path)."""
    _split_check(kernel, batch, kv_heads, group, head_dim, block_size, cache_dtype, q_dtype)


def test_kernel_path_follows_the_cpu(kernel):
    from kvferry.model.cpu_features import cpu_features

    path = paged_kernel.kernel_path(torch.bfloat16, torch.bfloat16, 64)
    if paged_kernel.kernel_isa() == "avx2" or not cpu_features().avx512:
        assert path == "portable"
    elif "avx512_bf16" in cpu_features().flags:
        assert path == "dpbf16"
    else:
        assert path == "avx512"
    assert paged_kernel.kernel_path(torch.float32, torch.bfloat16, 40) == "portable"  # 40 % 16 != 0


_AVX2 = """
import torch
from kvferry.model import paged_kernel
from tests.model.test_paged_kernel import (_all_heads_check, _explicit, _multi_query_case, _split_check,
                                           _staged_items_check)
assert paged_kernel.kernel_isa() == "avx2"
kernel = paged_kernel.get_paged_decode_kernel()
assert kernel is not None
_all_heads_check(kernel, torch.float32, torch.float32, 3, 3, 64, 16)
_all_heads_check(kernel, torch.float32, torch.float32, 8, 2, 128, 5)
_staged_items_check(kernel, 3, 3, 64, 16, torch.float32)
_staged_items_check(kernel, 2, 2, 40, 8, torch.float8_e5m2)
_split_check(kernel, 0, 3, 3, 64, 16, torch.float32)
_split_check(kernel, 1, 2, 2, 40, 5, torch.float8_e5m2)
assert paged_kernel.kernel_path(torch.bfloat16, torch.bfloat16, 64) == "portable"
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    q, kc, vc, tables, seq_lens, starts, q_lens, group = _multi_query_case(dtype, 16, 64, 5)
    out = torch.empty(q.shape, dtype=dtype)
    kernel(q, kc, vc, tables, torch.tensor(seq_lens), torch.tensor(starts), torch.tensor(q_lens), 0.125, out)
    for r in range(len(seq_lens)):
        exp = _explicit(q, kc, vc, tables[r], seq_lens[r], starts[r], q_lens[r], 0.125, group)
        torch.testing.assert_close(out[starts[r]:starts[r] + q_lens[r]].double(), exp, atol=tol, rtol=tol)
"""


def test_avx2_build_matches_explicit_softmax(kernel):
    """The build without AVX-512 (what an AVX2-only CPU gets), in its own
    process: a process loads one build of the op."""
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "KVFERRY_KERNEL_ISA": "avx2", "KVFERRY_DISABLE_CPP_KERNELS": "0",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", _AVX2], env=env, check=True, timeout=600)


def test_chunk_threshold_and_long_bf16_chunks(kernel, monkeypatch):
    """The threshold (every cache dtype); a 40-token bf16 chunk over context
    and a 100-token fresh bf16 prompt (more than one 32-token query block per
    work item) through the kernel (vdpbf16ps where the CPU has it), against
    SDPA."""
    from kvferry.model import attention

    assert attention.kernel_max_chunk_tokens() == 8192
    dtype = torch.bfloat16
    cache, meta_args, gen = _batch([40, 100, 1], [90, 100, 20], 3, 64, 16, dtype=dtype)
    meta_args["kv_dtype"] = dtype
    q, k, v = (torch.randn(141, h, 64, generator=gen).to(dtype) for h in (9, 3, 3))
    ref, _ = _run(monkeypatch, True, q, k, v, cache, meta_args, 0.125)
    out, meta = _run(monkeypatch, False, q, k, v, cache, meta_args, 0.125)
    assert [p.use_kernel for p in meta.prefills] == [True, True]
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_long_chunk_split_into_query_blocks_float32(kernel):
    """A 150-token chunk over 70 cached tokens and a 75-token fresh prompt:
    each is split into 32-token query blocks across work items; float32
    results equal an explicit softmax to 1e-5, and every row is written."""
    q, k_cache, v_cache, tables, seq_lens, starts, q_lens, group = _long_case()
    out = torch.full(q.shape, float("nan"))
    kernel(q, k_cache, v_cache, tables, torch.tensor(seq_lens), torch.tensor(starts), torch.tensor(q_lens),
           0.125, out)
    for r in range(len(seq_lens)):
        expected = _explicit(q, k_cache, v_cache, tables[r], seq_lens[r], starts[r], q_lens[r], 0.125, group)
        torch.testing.assert_close(out[starts[r]:starts[r] + q_lens[r]].double(), expected, atol=1e-5, rtol=1e-5)


def _long_case():
    gen = torch.Generator().manual_seed(3)
    block_size, kv_heads, group, head_dim = 16, 3, 3, 64
    seq_lens, q_lens = [220, 75], [150, 75]
    starts = [0, 150]
    num_blocks = 40
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.stack([perm[:14], perm[14:28]])
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(225, kv_heads * group, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, seq_lens, starts, q_lens, group


def _bf16_case(group, head_dim, block_size, q_lens, seq_lens, seed, q_scale=1.0):
    """bf16 caches whose never-written slots (past each sequence's length,
    and spare blocks) are NaN, blocks scattered, 2 KV heads."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads = 2
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int64)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    used = 0
    for r, b in enumerate(blocks):
        tables[r, :b] = ids[used:used + b]
        used += b
    # Every written slot at once (a Python loop per token was most of these tests' time).
    pos = torch.cat([torch.arange(s) for s in seq_lens])
    rows = torch.cat([torch.full((s,), r) for r, s in enumerate(seq_lens)])
    blk, off = tables[rows, pos // block_size], pos % block_size
    k_cache[blk, off] = torch.randn(len(pos), kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v_cache[blk, off] = torch.randn(len(pos), kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    starts = [sum(q_lens[:r]) for r in range(len(q_lens))]
    q = (torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen) * q_scale).to(torch.bfloat16)
    return q, k_cache, v_cache, tables, starts


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_bf16_tiles_against_float64_softmax(kernel, group, head_dim, block_size):
    """bf16 queries and caches on every path a bf16 call can take (one query
    row per KV head and a few: each query reads the rows in place; more:
    each tile is re-laid out once for all of them): decode and chunks of odd
    lengths, tails shorter than a tile, a tile spanning two blocks (block
    size 8), a chunk longer than one 32-token query block; within bf16
    resolution of a float64 softmax over the same bf16 inputs."""
    q_lens, seq_lens = [1, 2, 5, 1, 17, 40, 1], [1, 2, 23, 33, 47, 71, 129]
    q, k_cache, v_cache, tables, starts = _bf16_case(group, head_dim, block_size, q_lens, seq_lens,
                                                     seed=group * 1000 + head_dim + block_size)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    kernel(q, k_cache, v_cache, tables, torch.tensor(seq_lens), torch.tensor(starts), torch.tensor(q_lens),
           scale, out)
    assert torch.isfinite(out).all()  # no NaN slot was read
    for r in range(len(seq_lens)):
        expected = _explicit(q, k_cache, v_cache, tables[r], seq_lens[r], starts[r], q_lens[r], scale, group)
        torch.testing.assert_close(out[starts[r]:starts[r] + q_lens[r]].double(), expected, atol=2e-2, rtol=2e-2)


def test_bf16_peaked_scores_rescale(kernel):
    """Scores spread over tens of units (queries scaled by 6), so the running
    max moves often and by a lot: the online softmax rescales without
    overflow or lost mass, on both bf16 paths (decode and a 24-token chunk)."""
    group, head_dim = 4, 64
    q_lens, seq_lens = [1, 24], [300, 300]
    q, k_cache, v_cache, tables, starts = _bf16_case(group, head_dim, 16, q_lens, seq_lens, seed=7, q_scale=6.0)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    kernel(q, k_cache, v_cache, tables, torch.tensor(seq_lens), torch.tensor(starts), torch.tensor(q_lens),
           0.125, out)
    for r in range(2):
        expected = _explicit(q, k_cache, v_cache, tables[r], seq_lens[r], starts[r], q_lens[r], 0.125, group)
        torch.testing.assert_close(out[starts[r]:starts[r] + q_lens[r]].double(), expected, atol=3e-2, rtol=3e-2)


def test_build_kernels_reports_each_build(kernel):  # kernel: skips where nothing builds
    done = subprocess.run([sys.executable, "-m", "kvferry.model.build_kernels", "--kernels", "paged", "fused"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "kvferry kernels: paged (native): ok" in lines and "kvferry kernels: fused (native): ok" in lines
    assert lines[-1].startswith("kvferry kernels: done in ")


def test_the_avx2_build_is_the_native_one_only_without_avx512(monkeypatch):
    """Without AVX-512, -mno-avx512f changes nothing: the AVX2 build shares
    the native build's cache name (one compile), and build_kernels says so
    instead of starting it. With AVX-512 they are two builds."""
    from kvferry.model import build_kernels
    from kvferry.model.cpu_features import cpu_features

    names = {}
    for isa in ("native", "avx2"):
        monkeypatch.setenv("KVFERRY_KERNEL_ISA", isa)
        names[isa] = paged_kernel._ext_name()
    assert (names["native"] == names["avx2"]) == (not cpu_features().avx512)
    if not cpu_features().avx512:
        got = build_kernels.build(["avx2", "native"], ["paged"], 600.0)
        assert ("avx2", "paged", "same build as native on this CPU") in got
        assert len(got) == 2  # the native build ran, the AVX2 one did not


def test_a_build_leaves_the_next_builds_cache_names_alone(kernel, tmp_path):
    # torch's load() appends its libraries to the flag lists it is handed: a
    # build must not change the names (cache keys) of the builds after it.
    code = """
import sys
from pathlib import Path
from kvferry.model import paged_kernel as pk
name = lambda: pk.extension_name("kvferry_other", Path(sys.argv[1]), pk._cflags())
before = name()
assert pk.try_load_library("kvferry_build_test", Path(sys.argv[1]), [], "a test library", "nothing")
print(before == name())
"""
    source = tmp_path / "tiny.cpp"
    source.write_text(_TINY_SOURCE)
    env = {**__import__("os").environ, "KVFERRY_CACHE_DIR": str(tmp_path / "cache"), "KVFERRY_DISABLE_CPP_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", code, str(source)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "True"
