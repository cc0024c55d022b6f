"""Draft trees' pieces without a model: the tree attention mask against a
reference attention computed here in float64 (the CPU path, with the C++
kernel serving the batch's other requests, and the Triton path: compiled
with CUDA, in Triton's interpreter without), the tree helpers, and suffix
decoding's tree drafts."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvferry.config import EngineArgs, SpeculativeConfig, default_speculation
from kvferry.core.request import Request
from kvferry.model import triton_attention
from kvferry.model.attention import AttentionMetadata, paged_attention
from kvferry.sampling import SamplingParams
from kvferry.spec.suffix import SuffixProposer
from kvferry.spec.suffix_tree import SuffixTree
from kvferry.spec.tree import DraftTree, ancestor_mask, depths, first_branch, held, paths_to, walk

#                  root
#             /      |     \
#            0       1      2
#           / \      |
#          3   4     5
#          |
#          6
PARENTS = [-1, -1, -1, 0, 0, 1, 3]
BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def test_tree_helpers():
    assert depths(PARENTS) == [1, 1, 1, 2, 2, 2, 3]
    mask = ancestor_mask(PARENTS)
    assert mask.shape == (8, 8)
    assert mask[7].nonzero()[0].tolist() == [0, 1, 4, 7]  # node 6: root, 0, 3, itself
    assert mask[0].nonzero()[0].tolist() == [0]
    assert paths_to(PARENTS)[7] == [0, 3, 6]
    assert first_branch(PARENTS) == [0, 3, 6]
    drafts = [10, 11, 12, 13, 14, 15, 16]
    # Row tokens: root says 11 (node 1), node 1 says 15 (node 5), node 5 says 99: rejected there.
    rows = [11, 0, 15, 0, 0, 0, 99, 0]
    assert walk(drafts, PARENTS, rows) == ([11, 15, 99], [1, 5])
    assert walk(drafts, PARENTS, [42] + [0] * 7) == ([42], [])
    assert held(drafts, PARENTS, [10, 13, 16, 5]) == 3 and held(drafts, PARENTS, [12, 1]) == 1
    assert held([1, 2, 3], None, [1, 2, 4]) == 2
    tree = DraftTree(drafts, PARENTS)
    cut = tree[:4]
    assert isinstance(cut, DraftTree) and cut.parents == PARENTS[:4] and list(cut) == drafts[:4]
    with pytest.raises(ValueError, match="parent"):
        DraftTree([1, 2], [-1, 1])
    with pytest.raises(ValueError, match="prefix"):
        tree[1:3]


def _step(device: str):
    """Three requests: a tree (context 9, root + 7 nodes), a plain 3-token
    chunk over context 5, and a decode over context 6; their blocks scattered."""
    g = torch.Generator().manual_seed(0)
    q_lens, seq_lens = [1 + len(PARENTS), 3, 1], [9 + 1 + len(PARENTS), 8, 7]
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(3, max(-(-s // BLOCK) for s in seq_lens), dtype=torch.int64)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // BLOCK)
        tables[i, :n] = perm[used:used + n]
        used += n
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, generator=g)
    tokens = sum(q_lens)
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=g)
    v = torch.randn(tokens, KV_HEADS, DIM, generator=g)
    qsl = np.cumsum([0, *q_lens]).tolist()
    slots = [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK
             for i, (n, s) in enumerate(zip(q_lens, seq_lens)) for p in range(s - n, s)]
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, slot_mapping=torch.tensor(slots).to(device),
                             block_tables=tables.to(device), block_size=BLOCK, num_prefills=2,
                             tree_masks={0: torch.from_numpy(ancestor_mask(PARENTS)).to(device)})
    return q, k, v, cache, meta, tables, q_lens, seq_lens, slots


def _reference(q, k, v, cache, tables, q_lens, seq_lens, slots) -> torch.Tensor:
    """Each query over its visible keys, in float64: the cached context,
    then for the tree its ancestors and itself, else causal."""
    cache = cache.clone()
    flat = cache.view(2, -1, KV_HEADS, DIM)
    flat[0, slots], flat[1, slots] = k, v
    tree = ancestor_mask(PARENTS)
    out = torch.empty_like(q, dtype=torch.float64)
    row = 0
    for i, (n, s) in enumerate(zip(q_lens, seq_lens)):
        ctx = s - n
        all_slots = [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(s)]
        keys, values = flat[0, all_slots].double(), flat[1, all_slots].double()  # [s, KVH, D]
        for j in range(n):
            visible = list(range(ctx)) + [ctx + c for c in range(n) if (tree[j, c] if i == 0 else c <= j)]
            for h in range(HEADS):
                kh = keys[visible, h // (HEADS // KV_HEADS)]
                vh = values[visible, h // (HEADS // KV_HEADS)]
                scores = kh @ q[row + j, h].double() / math.sqrt(DIM)
                out[row + j, h] = torch.softmax(scores, 0) @ vh
        row += n
    return out


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_tree_mask_matches_a_reference_attention(backend):
    if backend == "triton" and not triton_attention.triton_available():
        pytest.skip("needs triton")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    q, k, v, cache, meta, tables, q_lens, seq_lens, slots = _step(device)
    meta.triton = backend == "triton"
    expected = _reference(q, k, v, cache, tables, q_lens, seq_lens, slots)
    layer = cache.clone().to(device)
    got = paged_attention(q.to(device), k.to(device), v.to(device), layer, meta, 1 / math.sqrt(DIM)).cpu()
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
    # Without the mask the tree's rows differ (the test can tell).
    causal = paged_attention(q.to(device), k.to(device), v.to(device), cache.clone().to(device),
                             AttentionMetadata(query_start_loc=meta.query_start_loc, seq_lens=seq_lens,
                                               slot_mapping=meta.slot_mapping, block_tables=meta.block_tables,
                                               block_size=BLOCK, num_prefills=2, triton=meta.triton),
                             1 / math.sqrt(DIM)).cpu()
    assert (causal[1:8].double() - expected[1:8]).abs().max() > 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tree_mask_on_cuda_torch_path():
    q, k, v, cache, meta, tables, q_lens, seq_lens, slots = _step("cuda")
    expected = _reference(q, k, v, cache, tables, q_lens, seq_lens, slots)
    got = paged_attention(q.cuda(), k.cuda(), v.cuda(), cache.clone().cuda(), meta, 1 / math.sqrt(DIM)).cpu()
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


def test_suffix_trie_drafts_the_most_likely_continuations_best_first():
    trie = SuffixTree(16)
    # After [7, 8]: 9 9 9 (three times), then 5 (twice), then 6 (once).
    text = [7, 8, 9, 9, 9, 1] * 3 + [7, 8, 5, 1] * 2 + [7, 8, 6, 2]
    trie.extend(0, text)
    match = trie.longest_match([3, 7, 8], 2)
    tokens, parents, score, _ = trie.draft_tree(match, 6, 4, 0.1)
    tree = DraftTree(tokens, parents)
    # Best first: the 9 9 9 1 path (each 1/2), then 5 (1/3) and its 1: parents before children.
    assert tokens == [9, 9, 9, 1, 5, 1] and parents == [-1, 0, 1, 2, -1, 4]
    assert score == pytest.approx(4 / 2 + 2 / 3)
    wider, parents, _, _ = trie.draft_tree(match, 8, 2, 0.1)  # two deep: room for 6 (1/6)
    assert [t for t, p in zip(wider, parents) if p == -1] == [9, 5, 6] and max(depths(parents)) == 2
    strict, parents, _, _ = trie.draft_tree(match, 8, 4, 0.2)  # 1/6 < 0.2: no third branch
    assert [t for t, p in zip(strict, parents) if p == -1] == [9, 5]
    assert tree.first_branch() == [9, 9, 9, 1]
    path, _, _ = trie.draft(match, 4, 0.1)
    assert path == tree.first_branch()[: len(path)]


def test_suffix_proposer_tree_option():
    context = [7, 8, 9, 9, 9, 1] * 3 + [7, 8, 5, 1] * 2 + [3, 7, 8]  # "3 7 8" is new: "7 8" matches
    request = Request("r", list(context), SamplingParams(max_tokens=8))
    tree = SuffixProposer(6, max_depth=16, max_spec_factor=2.0, tree=True).propose(request)
    assert isinstance(tree, DraftTree) and not tree.is_chain() and len(tree) <= 6
    chain = SuffixProposer(6, max_depth=16, max_spec_factor=2.0).propose(request)
    assert chain == tree.first_branch()[: len(chain)] and not isinstance(chain, DraftTree)


def test_the_serving_default_drafts_trees_and_an_explicit_config_only_when_asked():
    spec, _ = default_speculation(EngineArgs().create_engine_config())
    assert spec.method == "auto" and spec.draft_tree  # the CPU default (tests/spec/test_default_trees.py)
    assert not SpeculativeConfig.parse('{"method": "suffix"}').draft_tree
    assert SpeculativeConfig.parse('{"method": "auto", "draft_tree": true}').draft_tree
    assert SpeculativeConfig.parse('{"method": "head", "draft_tree": true}').draft_tree  # the head's trees
    with pytest.raises(ValueError, match="draft_tree"):
        SpeculativeConfig.parse('{"method": "draft", "model": "m", "draft_tree": true}')
    with pytest.raises(ValueError, match="draft_tree"):
        SpeculativeConfig.parse('{"method": "suffix", "draft_tree": 1}')
