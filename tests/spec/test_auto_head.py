"""Method auto with a draft head among its choices, through the real engine
(a tiny checkpoint and an untrained head): greedy output is HF-exact
whichever proposer each request gets; the runner's head fills only the
slots auto reserved for it (the other drafts are suffix decoding's or
prompt lookup's, as the scheduler took them); and the default
(``speculative="default"``) drafts a batch-1 repetitive request with
plain decoding's greedy output."""
from __future__ import annotations

import random

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.spec.head import EagleHead
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.spec.test_engine import repetitive_prompts
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto-head")
    target = str(make_tiny_checkpoint(root, arch="llama", max_position_embeddings=1024))
    hf = load_hf(target)
    torch.manual_seed(0)
    head = root / "head.safetensors"
    EagleHead(hf.config.hidden_size, 64).save(head, target="random")
    rng = random.Random(3)
    # Repetitive prompts (suffix / n-gram drafts) and text with no repeats (only the head drafts).
    prompts = repetitive_prompts(hf.config.vocab_size) + [rng.sample(range(3, hf.config.vocab_size), 40)
                                                           for _ in range(3)]
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return target, str(head), hf, prompts, expected


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 16}], ids=["batch", "chunked"])
def test_greedy_is_hf_exact_and_the_head_fills_only_its_slots(case, kwargs):
    target, head, hf, prompts, expected = case
    spec = {"method": "auto", "model": head, "num_speculative_tokens": 3, "adaptive": False, "cost_aware": False,
            "batch_token_threshold": 10**6}
    llm = LLM(model=target, dtype="float32", speculative=spec, **kwargs)
    auto = llm.engine.core.scheduler.proposer
    drafter = llm.engine.core.runner.drafter
    assert auto.has_head and llm.engine.core.runner.head_requests is auto.head_requests
    head_rows, other_rows = [], []
    propose = drafter.propose

    def checked(batch, requests):
        # Every request the head drafts for was auto's choice of the head this step.
        assert {r.request_id for r in requests} <= auto.head_requests
        head_rows.extend(r.request_id for r in requests if r.num_drafts)
        return propose(batch, requests)

    drafter.propose = checked
    results = llm.generate(prompts, GREEDY)
    for p, e, r in zip(prompts, expected, results):
        assert_greedy_match(hf, p, r.token_ids, e)
    assert head_rows, "the head never drafted"
    assert auto.num_chosen["suffix"] + auto.num_chosen["ngram"] > 0
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    llm.engine.check_integrity()


def test_the_default_drafts_a_repetitive_request_at_batch_1(case):
    target, _, hf, prompts, expected = case
    llm = LLM(model=target, dtype="float32", speculative="default")
    assert llm.engine.core.config.speculative.method == "auto"
    grounded = prompts[3]
    result = llm.generate([grounded], GREEDY)[0]
    assert_greedy_match(hf, grounded, result.token_ids, expected[3])
    assert llm.engine.stats().num_draft_tokens > 0
    off = LLM(model=target, dtype="float32")  # LLM(...) without it: off, as vLLM's
    assert off.engine.core.config.speculative is None
    assert off.generate([grounded], GREEDY)[0].token_ids == result.token_ids
    assert off.engine.stats().num_draft_tokens == 0
