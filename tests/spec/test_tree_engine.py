"""Draft trees through the real engine (tiny model, offline LLM).

- Suffix decoding with ``draft_tree``: greedy output is plain decoding's,
  with trees that really branch, their steps through the one-call C++
  decoder layer (as a path's).
- A tree whose right branch is never the first one (an oracle proposer that
  knows plain decoding's output puts a wrong branch first): the output is
  still plain decoding's, for greedy and for seeded sampling, and nearly
  every draft on the right branch is accepted. Both need the accepted
  branch's KV moved to its positions (the next step reads it) and each
  node sampled as its depth's output position.
- The statistical losslessness test of tests/spec/test_distribution.py
  (its target, helpers and bound), with unseeded sampling verified over
  trees of three branches: the second output token follows the target's
  exact marginal.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvferry import LLM, SamplingParams
from kvferry.spec.tree import DraftTree
from tests.spec.test_distribution import NUM_SAMPLES, target, tv, tv_bound  # noqa: F401 (a fixture)
from tests.spec.tree_steps import record_tree_steps
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 24
# No warm-up: these engines time nothing, and each start would pay a full-size prefill.
ENGINE = {"dtype": "float32", "warm_up": False}
FIXED = {"adaptive": False, "cost_aware": False, "batch_token_threshold": 10**6}
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# Penalties count a node's ancestors as output; logprobs are the accepted rows'.
PENALIZED = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.4, logprobs=2)


class Recording:
    """The engine's own proposer, its drafts noted."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.drafts: list[list[int]] = []

    def propose(self, request) -> list[int]:
        draft = self.inner.propose(request)
        self.drafts.append(draft)
        return draft

    def finished(self, request) -> None:
        self.inner.finished(request)


class Oracle:
    """A tree of 2 x depth tokens whose first branch is wrong and whose
    second is the request's true continuation (``truth``: prompt + output,
    per prompt). Returns nothing where the truth is unknown."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], depth: int, vocab: int) -> None:
        self.truth, self.depth, self.vocab = truth, depth, vocab
        self.num_trees = 0

    def propose(self, request) -> list[int]:
        full = self.truth[tuple(request.prompt_token_ids)]
        n = len(request.all_token_ids)
        right = full[n : n + self.depth]
        if not right:
            return []
        wrong = [(t + 1) % self.vocab for t in right]
        tokens, parents = [], []
        for branch in (wrong, right):  # wrong first: the right one never sits at the chain's slots
            for j, token in enumerate(branch):
                parents.append(-1 if j == 0 else len(tokens) - 1)
                tokens.append(token)
        self.num_trees += 1
        return DraftTree(tokens, parents)

    def finished(self, request) -> None:
        pass


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tree"), arch="llama", max_position_embeddings=1024))
    rng = random.Random(5)
    prompts = []
    for n in (3, 5, 8):  # a passage followed by different continuations: the trie branches after it
        a = [rng.randrange(3, 256) for _ in range(n)]
        b = [[rng.randrange(3, 256) for _ in range(4)] for _ in range(3)]
        prompts.append(a + b[0] + a + b[1] + a + b[0] + a + b[2] + a)
    plain = LLM(model=path, **ENGINE)
    expected = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    seeded = [SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=s, ignore_eos=True) for s in range(3)]
    expected_seeded = [r.token_ids for r in plain.generate(prompts, seeded)]
    penalized = plain.generate(prompts, PENALIZED)
    return path, prompts, expected, seeded, expected_seeded, penalized


@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_suffix_trees_greedy_is_plain_decoding(case, method, monkeypatch):
    path, prompts, expected, _, _, _ = case
    spec = {"method": method, "num_speculative_tokens": 6, "draft_tree": True,
            "suffix_decoding_max_spec_factor": 2.0, **FIXED}
    llm = LLM(model=path, **ENGINE, speculative=spec)
    scheduler = llm.engine.core.scheduler
    recording = Recording(scheduler.proposer.suffix if method == "auto" else scheduler.proposer)
    if method == "auto":
        scheduler.proposer.suffix = scheduler.proposer.proposers["suffix"] = recording
    else:
        scheduler.proposer = recording
    steps = record_tree_steps(monkeypatch)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    trees = [d for d in recording.drafts if isinstance(d, DraftTree)]
    assert trees and all(not t.is_chain() for t in trees)
    steps.check()  # the tree steps ran the one-call C++ layer
    stats = llm.engine.stats()
    assert stats.num_accepted_tokens > 0
    llm.engine.check_integrity()


def _oracle_llm(path: str, prompts, outputs, depth: int = 3) -> tuple[LLM, Oracle]:
    llm = LLM(model=path, **ENGINE,
              speculative={"method": "suffix", "num_speculative_tokens": 2 * depth, "draft_tree": True, **FIXED})
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, outputs)}, depth, 384)
    llm.engine.core.scheduler.proposer = oracle
    return llm, oracle


def test_the_right_branch_second_greedy_and_seeded(case):
    path, prompts, expected, seeded, expected_seeded, _ = case
    llm, oracle = _oracle_llm(path, prompts, expected)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.stats()
    assert oracle.num_trees > 0
    # A step accepts the whole right branch (3 tokens), but near the end, where
    # max_tokens cuts the tree to its first (wrong) branch.
    assert stats.num_accepted_tokens >= 2 * stats.num_drafts, (stats.num_accepted_tokens, stats.num_drafts)
    # Seeded sampling: plain decoding's tokens exactly (each node drew its depth's noise).
    llm, oracle = _oracle_llm(path, prompts, expected_seeded)
    assert [r.token_ids for r in llm.generate(prompts, seeded)] == expected_seeded
    assert llm.engine.stats().num_accepted_tokens >= 2 * llm.engine.stats().num_drafts


def test_the_right_branch_second_with_penalties_and_logprobs(case):
    path, prompts, _, _, _, penalized = case
    llm, oracle = _oracle_llm(path, prompts, [r.token_ids for r in penalized])
    outs = llm.generate(prompts, PENALIZED)
    assert [r.token_ids for r in outs] == [r.token_ids for r in penalized]
    assert llm.engine.stats().num_accepted_tokens >= 2 * llm.engine.stats().num_drafts
    for got, want in zip(outs, penalized):
        got, want = got.outputs[0].logprobs, want.outputs[0].logprobs
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want] and len(got) == MAX_NEW
        assert [lp.top_token_ids for lp in got] == [lp.top_token_ids for lp in want]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-4)


class LikelyTree:
    """At a request's first decode step: a tree of the three most likely
    second tokens after the sampled first one (``p1``, the target's own),
    each with a child. Every branch is plausible, so acceptance lands on all
    of them, and the walk must not favour any."""

    def __init__(self, prompt_len: int, p1: np.ndarray) -> None:
        self.prompt_len, self.p1 = prompt_len, p1
        self.num_trees = 0

    def propose(self, request) -> list[int]:
        if len(request.all_token_ids) != self.prompt_len + 1:
            return []
        top = np.argsort(-self.p1[request.all_token_ids[-1]])[:3].tolist()
        tokens, parents = [], []
        for t in top:
            parents += [-1, len(tokens)]
            tokens += [t, t]
        self.num_trees += 1
        return DraftTree(tokens, parents)

    def finished(self, request) -> None:
        pass


def naive_tree_samples(p0: np.ndarray, p1: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A biased multi-branch verifier, by hand: it tries LikelyTree's
    branches in turn with acceptance p(c) each, forgetting that after a
    rejected sibling the residual is renormalized (SpecInfer accepts the
    next with p(c) / (1 - p(tried))), so later branches come out too rarely."""
    rng = np.random.default_rng(seed)
    vocab = len(p0)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        p = p1[rng.choice(vocab, p=p0)]
        top = np.argsort(-p)[:3]
        accepted = next((c for c in top if rng.random() < p[c]), None)
        if accepted is None:
            rest = p.copy()
            rest[top] = 0
            accepted = rng.choice(vocab, p=rest / rest.sum())
        out[i] = accepted
    return out


def test_tree_sampling_matches_the_target_within_the_tv_bound(target):  # noqa: F811
    path, prompt, p0, p1 = target
    marginal = p0 @ p1  # [V]
    bound = tv_bound(marginal, NUM_SAMPLES)
    spec = {"method": "suffix", "num_speculative_tokens": 6, "draft_tree": True, **FIXED}
    llm = LLM(model=path, **ENGINE, speculative=spec, max_num_seqs=256, num_kv_blocks=1024)
    proposer = llm.engine.core.scheduler.proposer = LikelyTree(len(prompt), p1)
    # Unseeded: every row's noise is fresh (a seeded row's is its position's).
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    outs = llm.generate([prompt] * NUM_SAMPLES, params)
    stats = llm.engine.stats()
    assert proposer.num_trees >= NUM_SAMPLES // 2 and stats.num_accepted_tokens > NUM_SAMPLES // 10
    second = [o.token_ids[1] for o in outs]
    # Outputs land on the later branches too (the walk favours none).
    assert sum(o.token_ids[1] in np.argsort(-p1[o.token_ids[0]])[1:3].tolist() for o in outs) > NUM_SAMPLES // 20
    spec_tv = tv(np.bincount(second, minlength=len(marginal)).astype(float), marginal)
    naive = np.bincount(naive_tree_samples(p0, p1, NUM_SAMPLES, seed=1), minlength=len(marginal)).astype(float)
    naive_tv = tv(naive, marginal)
    print(f"TV bound {bound:.3f}: tree speculation {spec_tv:.3f}, naive multi-branch verifier {naive_tv:.3f}")
    assert spec_tv < bound, f"tree speculation TV {spec_tv:.3f} >= bound {bound:.3f}"
    assert naive_tv > bound, f"the bound cannot tell a biased tree verifier: TV {naive_tv:.3f} <= {bound:.3f}"
