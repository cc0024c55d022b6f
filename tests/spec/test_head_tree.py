"""Draft trees from a draft head (``{"method": "head", "draft_tree": true}``,
spec/head_tree.py) through the real engine (tiny checkpoints, offline LLM).

- The tree builder keeps the k nodes of highest path probability (the
  product of the head's probabilities along the path), best first, as a
  brute force over every path says.
- Greedy output is plain decoding's with the committed head's kind
  (``head``), an EAGLE-3 head, and ``auto`` with a head, each drafting trees
  that really branch, their steps through the one-call C++ decoder layer
  (as a path's); seeded sampling is plain seeded sampling's.
- The statistical losslessness test (tests/spec/test_distribution.py's
  target, helpers and bound) over head trees with unseeded sampling: the
  head's distribution here is the target's own next-token distribution, so
  the walk accepts often and on every branch, and the second output token
  still follows the target's exact marginal.
"""
from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.engine import runner as runner_module
from kvferry.model.input_batch import InputBatch
from kvferry.sampling import StructuredOutputsParams
from kvferry.spec.draft_model import DraftRequest
from kvferry.spec.head import EagleHead
from kvferry.spec.head_tree import draft_trees, wants_tree
from kvferry.spec.tree import is_chain, walk
from tests.spec.test_distribution import NUM_SAMPLES, target, tv, tv_bound  # noqa: F401 (a fixture)
from tests.spec.test_eagle3 import write_eagle3_checkpoint
from tests.spec.test_engine import repetitive_prompts
from tests.spec.tree_steps import record_tree_steps
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 16
ENGINE = {"dtype": "float32", "warm_up": False}  # these engines time nothing
FIXED = {"num_speculative_tokens": 4, "draft_tree": True, "adaptive": False, "cost_aware": False,
         "batch_token_threshold": 10**6}
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def test_the_tree_is_the_k_most_likely_paths_best_first():
    """A fixed table of next-token distributions (a function of the token
    drafted last): the builder's tree is the brute-force top k of every
    path's probability, best first, each parent before its children."""
    vocab, k = 6, 5
    g = torch.Generator().manual_seed(1)
    table = torch.randn(vocab, vocab, generator=g) * 2  # logits of the next token after token t
    batch = InputBatch(vocab)
    batch.token_ids[0, :2] = [1, 2]
    request = DraftRequest("r", 0, 2, k, SamplingParams(temperature=0.0))

    def step(tokens, sources):
        return table[tokens]

    proposal = draft_trees(batch, [request], torch.tensor([2]), step, None, width=vocab)["r"]
    assert proposal.probs is None and len(proposal.token_ids) == k
    logp = torch.log_softmax(table, -1).tolist()
    # Brute force: every path of up to k tokens after token 2, scored by its log probability.
    paths = {}
    for depth in range(1, k + 1):
        for path in itertools.product(range(vocab), repeat=depth):
            prev, score = 2, 0.0
            for t in path:
                score, prev = score + logp[prev][t], t
            paths[path] = score
    best = sorted(paths.values(), reverse=True)[:k]
    got = []
    for i, parent in enumerate(proposal.parents):
        assert parent < i
        got.append((got[parent][0] if parent >= 0 else ()) + (proposal.token_ids[i],))
        got[-1] = (got[-1], paths[got[-1]])
    assert [s for _, s in got] == pytest.approx(best)
    assert batch.token_ids[request.row, 2 : 2 + k].tolist() == proposal.token_ids  # over the placeholders
    assert not is_chain(proposal.parents)


def test_structured_output_requests_and_single_drafts_stay_chains():
    grammar = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    assert not wants_tree(DraftRequest("a", 0, 2, 4, grammar))
    assert not wants_tree(DraftRequest("b", 0, 2, 1, SamplingParams()))
    assert wants_tree(DraftRequest("c", 0, 2, 4, SamplingParams()))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("head-tree")
    model = str(make_tiny_checkpoint(root, arch="llama", max_position_embeddings=1024, num_hidden_layers=6))
    plain = LLM(model=model, **ENGINE)
    vocab = plain.engine.core.runner.vocab_size
    hidden = plain.engine.core.runner.loaded.config.hidden_size
    torch.manual_seed(0)
    EagleHead(hidden, 64).save(root / "head.safetensors", target="random")
    write_eagle3_checkpoint(root / "eagle3", hidden, vocab)
    rng = random.Random(3)
    prompts = repetitive_prompts(vocab)[1:4] + [rng.sample(range(3, vocab), 30) for _ in range(2)]
    expected = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    seeded = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=s, ignore_eos=True) for s in range(len(prompts))]
    expected_seeded = [r.token_ids for r in plain.generate(prompts, seeded)]
    heads = {"head": str(root / "head.safetensors"), "eagle3": str(root / "eagle3"),
             "auto": str(root / "head.safetensors")}
    return model, heads, prompts, expected, seeded, expected_seeded


@pytest.fixture
def walks(monkeypatch):
    """Every tree the runner verifies: (its drafts, parents, the nodes its walk accepted)."""
    seen = []

    def recording(drafts, parents, row_tokens):
        emitted, nodes = walk(drafts, parents, row_tokens)
        seen.append((list(drafts), list(parents), nodes))
        return emitted, nodes

    monkeypatch.setattr(runner_module, "walk", recording)
    return seen


def _tree_llm(case, method: str) -> tuple[LLM, list]:
    model, heads, *_ = case
    llm = LLM(model=model, **ENGINE, speculative={"method": method, "model": heads[method], **FIXED})
    drafter = llm.engine.core.runner.drafter
    assert drafter.tree
    proposed, propose = [], drafter.propose
    drafter.propose = lambda batch, requests: proposed.append(result := propose(batch, requests)) or result
    return llm, proposed


def _verified_as_trees(proposed: list, walks: list) -> None:
    """The head's trees branch, and the runner verified them as trees (with their parents)."""
    trees = [(p.token_ids, p.parents) for step in proposed for p in step.values() if p.parents is not None]
    assert trees and all(not is_chain(parents) and len(parents) == len(tokens) for tokens, parents in trees)
    verified = [(drafts, parents) for drafts, parents, _ in walks]
    assert all(tree in verified for tree in trees)


@pytest.mark.parametrize("method", ["head", "eagle3", "auto"])
def test_head_trees_greedy_is_plain_decoding(case, method, walks, monkeypatch):
    _, _, prompts, expected, _, _ = case
    llm, proposed = _tree_llm(case, method)
    steps = record_tree_steps(monkeypatch)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    _verified_as_trees(proposed, walks)
    steps.check()  # the tree steps ran the one-call C++ layer (eagle3: layer by layer, its aux copies between)
    assert llm.engine.stats().num_draft_tokens > 0
    llm.engine.check_integrity()


def test_head_trees_seeded_sampling_is_plain_seeded_sampling(case, walks):
    _, _, prompts, _, seeded, expected_seeded = case
    llm, proposed = _tree_llm(case, "head")
    assert [r.token_ids for r in llm.generate(prompts, seeded)] == expected_seeded
    _verified_as_trees(proposed, walks)


def test_head_tree_sampling_matches_the_target_within_the_tv_bound(target, tmp_path, walks):  # noqa: F811
    path, prompt, p0, p1 = target
    marginal = p0 @ p1  # [V]
    bound = tv_bound(marginal, NUM_SAMPLES)
    head = tmp_path / "head.safetensors"
    hidden = json.loads((Path(path) / "config.json").read_text())["hidden_size"]
    EagleHead(hidden, 32).save(head, target="random")
    llm = LLM(model=path, **ENGINE, max_num_seqs=256, num_kv_blocks=1024,
              speculative={"method": "head", "model": str(head), **FIXED, "num_speculative_tokens": 3})
    drafter = llm.engine.core.runner.drafter
    # The head's network stands aside: a row's "state" is its token, and its
    # distribution the target's own p1 after that token, flattened so that
    # the root's likely children outscore their own children: the trees
    # branch at the root over the target's likely second tokens.
    table = 0.3 * torch.log(torch.from_numpy(p1).float().clamp_min(1e-30))
    drafter._step = lambda tokens, hidden: tokens
    drafter._logits = lambda tokens: table[tokens]
    # Unseeded: fresh noise on every row. The first decode step has room for two drafts (a tree).
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    outs = llm.generate([prompt] * NUM_SAMPLES, params)
    stats = llm.engine.stats()
    assert stats.num_accepted_tokens > NUM_SAMPLES // 10
    # The walk accepts on the root's later branches too (the tree's second or third child).
    assert sum(nodes[:1] not in ([], [0]) for _, _, nodes in walks) > NUM_SAMPLES // 20
    second = [o.token_ids[1] for o in outs]
    # Outputs land on the later branches too (the walk favours none).
    later = sum(o.token_ids[1] in np.argsort(-p1[o.token_ids[0]])[1:3].tolist() for o in outs)
    assert later > NUM_SAMPLES // 20
    spec_tv = tv(np.bincount(second, minlength=len(marginal)).astype(float), marginal)
    print(f"TV bound {bound:.3f}: head tree speculation {spec_tv:.3f}")
    assert spec_tv < bound, f"head tree speculation TV {spec_tv:.3f} >= bound {bound:.3f}"
    assert math.isfinite(spec_tv)
