"""Suffix decoding through the real engine (tiny model): greedy output is
plain decoding's, drafts are accepted on repetitive text and on a repeat of
a finished request, and a namespace's finished text never reaches another
namespace's drafts (read from the proposer's drafts as the scheduler takes
them)."""
from __future__ import annotations

import random

import pytest

from kvferry import LLM, SamplingParams
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 24
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


class RecordingProposer:
    """The engine's own proposer, every draft it gives the scheduler noted
    with the request's text at that moment."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.drafts: list[tuple[str, str, list[int], list[int]]] = []  # (request, namespace, context, draft)

    def propose(self, request) -> list[int]:
        draft = self.inner.propose(request)
        self.drafts.append((request.request_id, request.cache_namespace, list(request.all_token_ids), draft))
        return draft

    def finished(self, request) -> None:
        self.inner.finished(request)


def repetitive_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(99)
    prompts = []
    for n, repeats in ((1, 1), (6, 3), (17, 2), (40, 3), (33, 4)):
        passage = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(passage * repeats)
    return prompts


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("suffix"), arch="llama", max_position_embeddings=1024))
    plain = LLM(model=path, dtype="float32")
    prompts = repetitive_prompts(256)  # ids within the tiny model's vocabulary (384)
    # Plain decoding's continuation pasted back: an input-grounded prompt whose drafts hold.
    first = plain.generate([prompts[3]], GREEDY)[0].token_ids
    prompts.append(prompts[3] + first + prompts[3])
    expected = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    return path, prompts, expected


def run(llm: LLM, rid: str, prompt: list[int], namespace: str) -> list[int]:
    llm.engine.add_request(rid, prompt, GREEDY, cache_namespace=namespace)
    return llm._run([rid], {rid: 1})[0].outputs[0].token_ids


def test_greedy_batch_is_plain_decoding_and_drafts_are_accepted(case):
    path, prompts, expected = case
    llm = LLM(model=path, dtype="float32", speculative=dict(SUFFIX))
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.stats()
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    llm.engine.check_integrity()
    llm.engine.core.scheduler.proposer.check_integrity()


def test_auto_greedy_batch_is_plain_decoding(case):
    path, prompts, expected = case
    llm = LLM(model=path, dtype="float32", speculative={**SUFFIX, "method": "auto"})
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.stats().num_accepted_tokens > 0


def test_a_repeated_request_drafts_from_the_finished_one(case):
    """The second time a prompt comes, its tenant's trie holds the first
    answer: nearly every output token is a verified draft."""
    path, prompts, expected = case
    llm = LLM(model=path, dtype="float32", speculative={**SUFFIX, "adaptive": False, "cost_aware": False})
    prompt = prompts[1]
    assert llm.generate([prompt], GREEDY)[0].token_ids == expected[1]
    first = llm.engine.stats().num_accepted_tokens
    llm.engine.core.scheduler.proposer.work(None)  # what later steps would do in slices
    assert llm.generate([prompt], GREEDY)[0].token_ids == expected[1]
    again = llm.engine.stats().num_accepted_tokens - first
    assert again >= MAX_NEW // 2 and again > first, (first, again)
    # Purging the tenant (DELETE /v1/kv/tenants/...) forgets its text too.
    proposer = llm.engine.core.scheduler.proposer
    proposer.work(None)
    assert proposer.cached_tokens("") > 0
    llm.engine.core.purge_tenant("")
    assert proposer.cached_tokens("") == 0


def test_a_namespace_never_drafts_another_namespaces_text(case):
    """Namespace "a" finishes a request; namespace "b" then sends the same
    prompt. No draft "b" gets holds a token its own text lacked then; a
    second request of "a" does draft the first one's answer."""
    path, prompts, expected = case
    llm = LLM(model=path, dtype="float32", speculative={**SUFFIX, "adaptive": False, "cost_aware": False})
    scheduler = llm.engine.core.scheduler
    recorder = scheduler.proposer = RecordingProposer(scheduler.proposer)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 200) for _ in range(48)]  # no repeats: nothing of its own to draft from
    secret = run(llm, "a1", prompt, "a")
    recorder.inner.work(None)
    assert run(llm, "b1", prompt, "b") == secret
    b_drafts = [(ctx, d) for rid, ns, ctx, d in recorder.drafts if rid == "b1"]
    assert b_drafts and all(set(d) <= set(ctx) for ctx, d in b_drafts), b_drafts
    assert run(llm, "a2", prompt, "a") == secret
    a_drafts = [(ctx, d) for rid, ns, ctx, d in recorder.drafts if rid == "a2"]
    assert any(set(d) - set(ctx) for ctx, d in a_drafts)  # drafted from a1's answer
    assert sum(len(d) for _, d in a_drafts) > sum(len(d) for _, d in b_drafts)


def test_seeded_sampling_with_suffix_drafts_equals_plain_seeded_sampling(case):
    """Suffix drafts are deterministic guesses (q one-hot), verified by the
    race plain sampling runs: a seeded request's tokens are plain decoding's."""
    path, prompts, _ = case
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.7, top_k=40, top_p=0.95, seed=s, ignore_eos=True)
              for s in range(len(prompts))]
    llm = LLM(model=path, dtype="float32", speculative=dict(SUFFIX))
    speculative = llm.generate(prompts, params)
    plain = LLM(model=path, dtype="float32").generate(prompts, params)
    assert llm.engine.stats().num_draft_tokens > 0
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
