"""Paged forward of every architecture vs transformers' full forward."""
from __future__ import annotations

import random

import pytest
import torch

from kvferry.model.loader import load_model
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import ARCHES, load_hf_model, make_tiny_checkpoint

ATOL = 1e-4


def _hf_logits(hf, seqs: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    with torch.no_grad():
        return {rid: hf(torch.tensor([s])).logits[0].float() for rid, s in seqs.items()}


def _random_seqs(vocab: int, lengths: dict[int, int], seed: int = 0) -> dict[int, list[int]]:
    rng = random.Random(seed)
    return {rid: [rng.randrange(3, vocab) for _ in range(n)] for rid, n in lengths.items()}


# Steps over four requests with final lengths 13, 20, 9, 6:
#  1: r0 whole prompt, r1 first chunk, r2 whole prompt, r3 a 1-token prompt (decode path, no context)
#  2: r1 second chunk (cached context), decodes r0 r2 r3
#  3: r1 a 1-token chunk + r3 3-token chunk after context, decodes r0 r2
#  4: decodes everyone to the end
PLAN = [
    {0: 11, 1: 7, 2: 6, 3: 1},
    {1: 8, 0: 1, 2: 1, 3: 1},
    {1: 1, 3: 3, 0: 1, 2: 1},
    {0: 1, 1: 4, 2: 1, 3: 1},
]
LENGTHS = {0: 14, 1: 20, 2: 9, 3: 6}


@pytest.mark.parametrize("arch", ARCHES)
def test_paged_forward_matches_hf(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path, arch)
    loaded = load_model(str(path), dtype="float32")
    hf = load_hf_model(path)
    seqs = _random_seqs(loaded.config.vocab_size, LENGTHS)
    want = _hf_logits(hf, seqs)
    harness = PagedHarness(loaded.model)
    done = {rid: 0 for rid in seqs}
    for plan in PLAN:
        got = harness.step(seqs, plan)
        for rid, logits in got.items():
            ref = want[rid][done[rid]:done[rid] + plan[rid]]
            torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0, msg=lambda m: f"{arch} req {rid}: {m}")
            done[rid] += plan[rid]
    assert done == LENGTHS


@pytest.mark.parametrize("arch", ["llama3_rope", "qwen3"])
def test_rope_inv_freq_matches_hf(tmp_path, arch):
    from kvferry.model.llama import rope_inv_freq

    path = make_tiny_checkpoint(tmp_path, arch)
    config = load_model(str(path)).config
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    theirs = load_hf_model(path).model.rotary_emb.inv_freq
    assert torch.equal(ours, theirs)
    if arch == "llama3_rope":  # scaling really bends some frequencies
        plain = rope_inv_freq(config.head_dim, config.rope_theta, type(config.rope_scaling)())
        assert not torch.equal(ours, plain)


def test_long_positions_and_many_decodes(tmp_path):
    """Positions deep into the RoPE table, decode batch padded to very different lengths."""
    path = make_tiny_checkpoint(tmp_path, "llama3_rope")
    loaded = load_model(str(path), dtype="float32")
    seqs = _random_seqs(loaded.config.vocab_size, {0: 200, 1: 5, 2: 60}, seed=1)
    want = _hf_logits(load_hf_model(path), seqs)
    harness = PagedHarness(loaded.model, num_blocks=128, block_size=4)
    harness.step(seqs, {0: 199, 1: 4, 2: 59})
    got = harness.step(seqs, {0: 1, 1: 1, 2: 1})
    for rid, logits in got.items():
        torch.testing.assert_close(logits[0], want[rid][-1], atol=ATOL, rtol=0)
