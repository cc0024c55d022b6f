"""The serving default drafts trees (issue 49): on the CPU, auto's suffix
decoding and its draft head draft a tree of k tokens, verified in one pass
(a tree step runs fused, at a path step's cost). Where a tree cannot run,
the default drafts paths and still serves: a request with a grammar (its
bitmask follows one path of drafts: the tree's first branch) and CUDA (a
tree step there runs eagerly and re-attends in torch); n-gram drafts stay
paths under auto. Greedy output is plain decoding's throughout."""
from __future__ import annotations

import random

import pytest

from kvferry import LLM, SamplingParams
from kvferry.config import EMBEDDED_DRAFT_HEAD, EngineArgs
from kvferry.sampling import StructuredOutputsParams
from kvferry.spec import speculation
from kvferry.spec.tree import DraftTree
from tests.spec.test_suffix import request
from tests.spec.test_tree_engine import Recording
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 24
ENGINE = {"dtype": "float32", "warm_up": False}
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _branching(rng: random.Random, n: int) -> list[int]:
    """A passage followed by three different continuations, ending on the
    passage: suffix decoding's trie branches right after the prompt, each
    branch a third likely, so that the default's k = 4 tree branches."""
    a = [rng.randrange(3, 256) for _ in range(n)]
    b = [[rng.randrange(3, 256) for _ in range(4)] for _ in range(3)]
    return a + b[0] + a + b[1] + a + b[2] + a


@pytest.mark.parametrize("levers", [{}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"ffn": 1},
                                    {"model": "/some/model"}], ids=["plain", "tp2", "pp2", "afd", "other-model"])
def test_the_default_drafts_trees_on_the_cpu(levers):
    args = EngineArgs(speculative="default", **levers)
    spec = args.create_engine_config().speculative
    assert spec.method == "auto" and spec.draft_tree, spec
    assert "trees of k <= 4" in args.default_speculation_line()
    # Its suffix decoding drafts a tree where the text went on in several ways; n-gram a path.
    proposer, req = speculation(spec)["proposer"], request("r", _branching(random.Random(1), 8))
    drafts = [proposer.suffix.propose(req) for _ in range(4)]  # a long prompt goes in over a few proposals
    assert isinstance(drafts[-1], DraftTree) and not drafts[-1].is_chain(), drafts
    assert not isinstance(proposer.proposers["ngram"].propose(req), DraftTree)


def test_on_cuda_the_default_drafts_paths():
    args = EngineArgs(speculative="default", device="cuda")
    spec = args.create_engine_config().speculative
    assert spec.method == "auto" and not spec.draft_tree and spec.model == str(EMBEDDED_DRAFT_HEAD)
    assert "paths of k <= 4" in args.default_speculation_line()


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("default-trees"), arch="llama",
                                    max_position_embeddings=1024))
    rng = random.Random(5)
    prompts = [_branching(rng, n) for n in (3, 5, 8)]
    plain = LLM(model=path, **ENGINE)
    try:
        return path, prompts, [r.token_ids for r in plain.generate(prompts, GREEDY)]
    finally:
        plain.engine.core.close()


def test_the_served_default_drafts_trees_with_plain_greedy_output(case):
    """The default, controller and timings included, at batch 1: requests
    whose prompt branches draft trees that branch, and the output is plain
    decoding's. (The controller first measures plain steps, so each prompt
    is served a few times: a later request starts drafting at once.)"""
    path, prompts, expected = case
    llm = LLM(model=path, speculative="default", **ENGINE)
    proposer = llm.engine.core.scheduler.proposer
    recording = proposer.suffix = proposer.proposers["suffix"] = Recording(proposer.suffix)
    try:
        for _ in range(3):
            assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected
        stats = llm.engine.stats()
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()
    assert any(isinstance(d, DraftTree) and not d.is_chain() for d in recording.drafts), recording.drafts
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats


def test_a_grammar_request_under_the_default_drafts_paths_and_keeps_plain_output(case):
    """Where a tree cannot run (a grammar's bitmask follows one path), the
    default drafts the tree's first branch and serves the request as plain
    decoding does (the same prompts without a grammar draft trees: above)."""
    path, prompts, _ = case
    grammar = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex="[a-z ]{8,40}"))
    plain = LLM(model=path, **ENGINE)
    try:
        expected = [r.token_ids for r in plain.generate(prompts, grammar)]
    finally:
        plain.engine.core.close()
    llm = LLM(model=path, speculative="default", **ENGINE)
    proposer = llm.engine.core.scheduler.proposer
    recording = proposer.suffix = proposer.proposers["suffix"] = Recording(proposer.suffix)
    try:
        for _ in range(3):
            assert [llm.generate([p], grammar)[0].token_ids for p in prompts] == expected
        stats = llm.engine.stats()
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()
    assert recording.drafts and not any(isinstance(d, DraftTree) and not d.is_chain() for d in recording.drafts)
    assert stats.num_draft_tokens > 0, stats
