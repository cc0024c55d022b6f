"""Several tokens per request per step: draft tokens verified by the runner.

Drafts come through the scheduler's proposer hook. Verification must be
lossless: with drafts that are the true continuation every one is accepted
and the output is unchanged; with wrong drafts the output is still HF-exact.
"""
from __future__ import annotations

import random

import pytest

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 12
K = 4


class ScriptedProposer:
    """Proposes from a known continuation of each prompt; ``corrupt(j, tok)``
    may change the draft at output index j."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], corrupt=None) -> None:
        self.continuations = continuations
        self.corrupt = corrupt or (lambda j, tok: tok)

    def propose(self, request) -> list[int]:
        cont = self.continuations[tuple(request.prompt_token_ids)]
        n = request.num_output_tokens
        return [self.corrupt(n + i, t) for i, t in enumerate(cont[n : n + K])]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("spec"), arch="llama", max_position_embeddings=512))
    hf = load_hf(path)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (1, 5, 17, 40)]
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return path, hf, prompts, expected


def make_llm(path, proposer, **kwargs) -> LLM:
    llm = LLM(model=path, dtype="float32", **kwargs)
    llm.engine.core.scheduler.proposer = proposer
    llm.engine.core.scheduler.num_speculative_tokens = K
    return llm


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def test_true_drafts_are_all_accepted_and_output_is_hf_exact(case):
    path, hf, prompts, expected = case
    llm = make_llm(path, ScriptedProposer({tuple(p): e for p, e in zip(prompts, expected)}))
    results = llm.generate(prompts, GREEDY)
    for p, e, r in zip(prompts, expected, results):
        assert_greedy_match(hf, p, r.token_ids, e)
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    llm.engine.check_integrity()


def test_true_drafts_take_fewer_steps(case):
    path, _, prompts, expected = case
    llm = make_llm(path, ScriptedProposer({tuple(p): e for p, e in zip(prompts, expected)}))
    llm.engine.add_request("x", prompts[2], GREEDY)
    steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
    # prefill (1 token) + ceil(11 / 5) verify steps
    assert steps == 1 + 3


@pytest.mark.parametrize("wrong_from", [0, 2])
def test_wrong_drafts_keep_output_hf_exact(case, wrong_from):
    path, hf, prompts, expected = case
    vocab = hf.config.vocab_size

    def corrupt(j, tok):  # drafts from index wrong_from on (within each proposal) are wrong
        return (tok + 1) % vocab if j % K >= wrong_from else tok

    llm = make_llm(path, ScriptedProposer({tuple(p): e for p, e in zip(prompts, expected)}, corrupt))
    results = llm.generate(prompts, GREEDY)
    for p, e, r in zip(prompts, expected, results):
        assert_greedy_match(hf, p, r.token_ids, e)
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > 0
    if wrong_from == 0:
        assert stats.num_accepted_tokens < stats.num_draft_tokens // 4
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    llm.engine.check_integrity()


def test_stop_token_inside_an_accepted_run_truncates_it(case):
    path, hf, prompts, expected = case
    prompt, cont = prompts[3], expected[3]
    # A stop token at output index j that does not occur before j.
    j = next(i for i in range(2, MAX_NEW) if cont[i] not in cont[:i])
    llm = make_llm(path, ScriptedProposer({tuple(prompt): cont}))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[cont[j]])
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == cont[: j + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == cont[j]
    assert llm.engine.stats().kv_blocks_used == 0


def test_logprobs_with_drafts_equal_logprobs_without(case):
    path, _, prompts, expected = case
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = LLM(model=path, dtype="float32").generate(prompts[1:3], params)
    llm = make_llm(path, ScriptedProposer({tuple(p): e for p, e in zip(prompts, expected)}))
    spec = llm.generate(prompts[1:3], params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        lps_a, lps_b = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(lps_a) == len(lps_b) == MAX_NEW
        for x, y in zip(lps_a, lps_b):
            assert x.token_id == y.token_id and x.top_token_ids == y.top_token_ids
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_penalties_see_each_accepted_draft(case):
    # With penalties the continuation depends on every earlier output token;
    # drafts equal to the penalized greedy continuation must all be accepted
    # and reproduce it exactly.
    path, _, prompts, _ = case
    params = SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
        repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4,
    )
    plain = LLM(model=path, dtype="float32").generate(prompts, params)
    conts = {tuple(p): r.token_ids for p, r in zip(prompts, plain)}
    llm = make_llm(path, ScriptedProposer(conts))
    spec = llm.generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    stats = llm.engine.stats()
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_seeded_sampling_with_drafts_is_reproducible(case):
    path, _, prompts, expected = case
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=11, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = make_llm(path, ScriptedProposer({tuple(p): e for p, e in zip(prompts, expected)}))
        runs.append([r.token_ids for r in llm.generate(prompts, params)])
    assert runs[0] == runs[1]
    assert all(len(t) == MAX_NEW for t in runs[0])


class FixedProposer:
    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, request) -> list[int]:
        return list(self.drafts)


def test_verified_token_frequencies_match_the_target(tmp_path):
    """Chi-square on the token at a verified draft position: over seeded
    requests, the second output token (the draft when accepted, else the
    target's own sample) must follow the target's marginal
    sum_t0 p(t0 | P) p(t1 | P, t0). Accepting the draft too often (or
    rejecting it too often) skews its bin. Fails at p < 1e-3."""
    import numpy as np
    import torch
    from scipy.stats import chisquare

    num_samples, temperature = 2000, 1.0
    path = str(make_tiny_checkpoint(tmp_path, arch="llama"))
    prompt = [5, 17, 33, 42, 90, 11]
    hf = load_hf(path)
    with torch.no_grad():  # sharpen the near-uniform random logits so the test has power
        hf.lm_head.weight.mul_(3.0)
    hf.save_pretrained(path, safe_serialization=True)
    vocab = hf.config.vocab_size
    with torch.inference_mode():
        p0 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)  # [V]
        batch = torch.tensor([prompt + [t] for t in range(vocab)])  # [V, len + 1]
        p1 = torch.softmax(hf(batch).logits[:, -1].double() / temperature, -1)  # [V, V]: row t0
    marginal = (p0 @ p1).numpy()  # [V]
    draft = int(marginal.argmax())

    llm = make_llm(path, FixedProposer([draft]), max_num_seqs=256, num_kv_blocks=1024)
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(num_samples)]
    outs = llm.generate([prompt] * num_samples, params)
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens == num_samples
    counts = np.bincount([o.token_ids[1] for o in outs], minlength=vocab).astype(float)
    expected = marginal * num_samples
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    p = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert p > 1e-3, f"chi-square p={p:.2g} over {len(obs)} bins (draft {draft}: {counts[draft]:.0f} seen, {expected[draft]:.0f} expected)"
    assert len(obs) >= 10, "too few bins for a meaningful test"
