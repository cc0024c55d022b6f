"""Draft trees in the C++ paged attention kernel: its tree masks (one uint64
of ancestor bits per query token) against the torch path's masked SDPA, on
random trees mixed with causal chunks and decodes, float32 and bf16, the
AVX-512 and the AVX2 builds. Caches are NaN wherever nothing was written."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry.model import paged_kernel
from kvferry.model.attention import AttentionMetadata, kernel_takes_tree, paged_attention, tree_bits
from kvferry.spec.tree import ancestor_mask
from tests.model.test_paged_kernel import _batch


@pytest.fixture(scope="module")
def kernel():
    k = paged_kernel.get_paged_decode_kernel()
    if k is None:
        pytest.skip("C++ paged attention kernel unavailable")
    return k


def _random_tree(nodes: int, gen: torch.Generator) -> torch.Tensor:
    """[nodes + 1, nodes + 1] ancestor mask of a random tree (root first,
    every node's parent before it)."""
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(nodes)]
    return torch.from_numpy(ancestor_mask(parents))


def _attend(monkeypatch, disable, q, k, v, cache, meta_args, trees):
    monkeypatch.setenv("KVFERRY_DISABLE_CPP_KERNELS", "1" if disable else "0")
    meta = AttentionMetadata(**meta_args, tree_masks=dict(trees))
    meta.prepare()
    out = paged_attention(q, k, v, cache.clone(), meta, q.shape[-1] ** -0.5)
    return out, meta


def _case(monkeypatch, q_lens, ctx_lens, tree_rows, kv_heads, group, head_dim, block_size, dtype, seed):
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    cache, meta_args, gen = _batch(q_lens, seq_lens, kv_heads, head_dim, block_size, dtype, seed)
    trees = {r: _random_tree(q_lens[r] - 1, gen) for r in tree_rows}
    tokens = sum(q_lens)
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    got, meta = _attend(monkeypatch, False, q, k, v, cache, meta_args, trees)
    # The trees took the kernel, not the torch path.
    assert meta.kernel_tree_masks is not None
    assert all(meta.prefills[r].use_kernel and meta.prefills[r].mask is None for r in tree_rows)
    want, _ = _attend(monkeypatch, True, q, k, v, cache, meta_args, trees)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert not got.isnan().any()
    return q, k, v, cache, meta_args, trees, got


# (q_lens, context lens, tree rows): a tree among a causal chunk and decodes;
# two trees; a 64-token tree; a tree with no context; a long context (split
# into parts when the step has few items).
_CASES = [
    ([8, 3, 1, 1], [9, 5, 6, 20], [0]),
    ([5, 17, 1], [40, 3, 7], [0, 1]),
    ([64, 2], [30, 11], [0]),
    ([12], [0], [0]),
    ([9, 1], [700, 50], [0]),
]


@pytest.mark.parametrize("case", range(len(_CASES)))
@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,dtype", [
    (2, 2, 64, 16, torch.float32),   # AVX-512 loop / AVX2 loop
    (1, 4, 40, 4, torch.float32),    # portable rows via a float buffer
    (2, 3, 32, 8, torch.bfloat16),   # the dpbf16 path's dtypes
    (2, 1, 64, 16, torch.bfloat16),
])
def test_tree_masks_match_the_torch_masked_path(kernel, monkeypatch, case, kv_heads, group, head_dim, block_size,
                                                dtype):
    q_lens, ctx_lens, rows = _CASES[case]
    _case(monkeypatch, q_lens, ctx_lens, rows, kv_heads, group, head_dim, block_size, dtype, seed=case)


def test_causal_rows_unchanged_and_masks_checked(kernel, monkeypatch):
    """All-zero mask rows leave a sequence causal, bit for bit; a tree's
    rows differ from causal ones; a bad mask is an error, not a bad read."""
    q, k, v, cache, meta_args, trees, got = _case(monkeypatch, [8, 3, 1], [9, 5, 6], [0], 2, 2, 64, 16,
                                                  torch.float32, seed=7)
    monkeypatch.setenv("KVFERRY_DISABLE_CPP_KERNELS", "0")
    plain = AttentionMetadata(**meta_args)
    plain.prepare()
    layer = cache.clone()
    causal = paged_attention(q, k, v, layer, plain, 64 ** -0.5)
    assert torch.equal(got[8:], causal[8:])  # the chunk and the decode: untouched by the tree
    assert (got[:8] - causal[:8]).abs().max() > 1e-2  # the tree's rows: masked
    args = (q, layer[0], layer[1], plain.kernel_block_tables, plain.kernel_seq_lens, plain.kernel_query_starts,
            plain.kernel_query_lens, 64 ** -0.5)
    zeros = torch.zeros(3, 64, dtype=torch.int64)
    out = torch.empty_like(q)
    torch.ops.kvferry.paged_attention_tree(*args, out, zeros)
    assert torch.equal(out, causal)
    bad = zeros.clone()
    bad[0, :8] = tree_bits(trees[0])
    bad[0, 3] = 0b101  # token 3 does not see itself
    with pytest.raises(RuntimeError, match="must set bit 3"):
        torch.ops.kvferry.paged_attention_tree(*args, torch.empty_like(q), bad)
    bad[0, 3] = 0b11000  # a bit above its own
    with pytest.raises(RuntimeError, match="none above it"):
        torch.ops.kvferry.paged_attention_tree(*args, torch.empty_like(q), bad)
    with pytest.raises(RuntimeError, match=r"\[seqs, 64\]"):
        torch.ops.kvferry.paged_attention_tree(*args, torch.empty_like(q), zeros[:, :32])


def test_trees_the_kernel_does_not_take_stay_on_the_torch_path(kernel, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    assert kernel_takes_tree(_random_tree(63, gen)) and not kernel_takes_tree(_random_tree(64, gen))
    cycle = _random_tree(5, gen)
    cycle[1, 3] = True  # a token that sees one after it: not ancestors-first
    assert not kernel_takes_tree(cycle)
    cache, meta_args, _ = _batch([66, 1], [70, 9], 2, 64, 16, torch.float32, 3)
    monkeypatch.setenv("KVFERRY_DISABLE_CPP_KERNELS", "0")
    meta = AttentionMetadata(**meta_args, tree_masks={0: _random_tree(65, gen)})
    meta.prepare()
    assert not meta.prefills[0].use_kernel and meta.prefills[0].mask is not None and meta.kernel_tree_masks is None


_AVX2 = """
import pytest, torch
from kvferry.model import paged_kernel
assert paged_kernel.get_paged_decode_kernel() is not None
assert paged_kernel.kernel_path(torch.float32, torch.float32, 64) == "portable"
from tests.model import test_paged_kernel_tree as t
mp = pytest.MonkeyPatch()
for case in range(len(t._CASES)):
    for dtype in (torch.float32, torch.bfloat16):
        q_lens, ctx_lens, rows = t._CASES[case]
        t._case(mp, q_lens, ctx_lens, rows, 2, 2, 64, 16, dtype, seed=case)
print("ok")
"""


def test_avx2_build_tree_masks(kernel):
    """The build without AVX-512, in its own process (a process loads one build)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "KVFERRY_KERNEL_ISA": "avx2", "KVFERRY_DISABLE_CPP_KERNELS": "0",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _AVX2], env=env, check=True, timeout=600, capture_output=True,
                          text=True)
    assert done.stdout.strip().endswith("ok")
