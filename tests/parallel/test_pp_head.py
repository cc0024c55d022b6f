"""The draft head over pipeline stages: the last stage, which has the final
hidden states (and here, the model's lm_head being untied, the embedding
loaded for the head), drafts each request's next step right after sampling
it; the drafts ride to rank 0 with the tokens, fill the slots its scheduler
reserved, and reach every stage with the step. Greedy output at PP 2 equals
plain decoding's and HF transformers', drafts accepted, with paths and
trees, one micro-batch and two; seeded sampling equals plain seeded
sampling, and unseeded sampling's logprobs are the target's (its drafts
verified against the q they were drawn from, which never leaves the last
stage); the same at TP 2 x PP 2. Method auto with the head among its
choices keeps plain greedy output at PP 2, the head drafting for the
requests auto gave it and suffix or n-gram for the others."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.spec.head import EagleHead
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.parallel.test_tp_draft import max_logprob_gap
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=s, ignore_eos=True) for s in range(3)]
# No warm-up: these tests time nothing, and each engine start would pay a full-size prefill.
ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, warm_up=False)
# k fixed: on a loaded 2-core box the cost-aware controller may stop drafting.
SPEC = {"method": "head", "num_speculative_tokens": 3, "adaptive": False, "cost_aware": False,
        "batch_token_threshold": 10**6}
# A token repeated (the echo head's drafts hold on), and a passage repeated.
PROMPTS = [[5, 5, 5, 5], [7] * 20, [11, 40, 99, 3, 250] * 4]


def write_echo_head(target: str, path: Path) -> Path:
    """An echo head for ``target`` at ``path`` (fc = [0 | I], no MLP: its draft
    is the token the target's own lm_head gives the hidden state)."""
    hidden = json.loads((Path(target) / "config.json").read_text())["hidden_size"]
    head = EagleHead(hidden, 64)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.down.weight.zero_()
    head.save(path, target="echo")
    return path


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A tiny Llama of 4 layers (2 a stage), its lm_head not tied to the
    embedding; an echo head (fc = [0 | I], no MLP: its draft is the token the
    target's own lm_head gives the hidden state, the newest token again);
    plain decoding's greedy (checked against HF) and seeded tokens."""
    root = tmp_path_factory.mktemp("pp-head")
    target = str(make_tiny_checkpoint(root, arch="llama", num_hidden_layers=4, max_position_embeddings=1024))
    assert not json.loads((Path(target) / "config.json").read_text()).get("tie_word_embeddings")
    write_echo_head(target, root / "echo.safetensors")
    hf = load_hf(target)
    plain = LLM(model=target, **ENGINE)
    try:
        greedy = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, GREEDY)]
        seeded = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, SEEDED)]
    finally:
        plain.engine.core.close()
    for p, ours in zip(PROMPTS, greedy):
        assert_greedy_match(hf, p, ours, hf_greedy(hf, p, MAX_NEW))
    return target, str(root / "echo.safetensors"), greedy, seeded


def _llm(target: str, head: str, **kwargs) -> LLM:  # noqa: ANN003
    spec = {**SPEC, "model": head, **kwargs.pop("spec", {})}
    return LLM(model=target, **ENGINE, speculative=spec, pipeline_parallel_size=2, cpu_threads_per_rank=1, **kwargs)


@pytest.mark.parametrize("tree, micro_batches, tp", [(False, 1, 1), (True, 2, 1), (False, 1, 2)],
                         ids=["path", "tree-2-micro-batches", "tp2-pp2"])
def test_draft_head_over_two_stages_keeps_plain_output(case, tree, micro_batches, tp):
    """At TP 2 x PP 2 the last stage's two ranks draft together (the head's
    lookups and logits are their collectives), its TP rank 0's tokens and
    sampled drafts shared within the step."""
    target, head, greedy, seeded = case
    llm = _llm(target, head, spec={"draft_tree": tree}, pp_micro_batches=micro_batches, tensor_parallel_size=tp)
    try:
        assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY)] == greedy
        stats = llm.engine.stats()
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        if not tree:
            assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, SEEDED)] == seeded
            unseeded = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.9, ignore_eos=True,
                                                            logprobs=0))
            assert max_logprob_gap(target, PROMPTS, unseeded) < 1e-4  # every verified row the target's own
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2-pp2"])
def test_auto_with_a_head_over_two_stages_keeps_plain_output(case, tp):
    """Method auto picks per request among suffix, n-gram and the head: the
    last stage drafts ahead for every request, but only the requests rank
    0's scheduler gave the head take its drafts (and are verified against
    their q); the others verify the scheduler's own drafts. At TP 2 x PP 2
    the last stage's two ranks take auto's choice with the step alike."""
    target, head, greedy, _ = case
    rng = random.Random(5)
    # The repeated prompts find suffix / n-gram drafts; text with no repeats leaves them none: the head's.
    fresh = [rng.sample(range(3, 380), 12) for _ in range(2)]
    plain = LLM(model=target, **ENGINE)
    try:
        fresh_greedy = [r.outputs[0].token_ids for r in plain.generate(fresh, GREEDY)]
    finally:
        plain.engine.core.close()
    llm = _llm(target, head, spec={"method": "auto"}, tensor_parallel_size=tp)
    try:
        scheduler = llm.engine.core.scheduler
        auto = scheduler.proposer
        assert auto.has_head and llm.engine.core.runner.head_requests is auto.head_requests
        head_accepted, rollback = [], scheduler._rollback_drafts

        def noting(request, drafts: list[int], sampled: list[int]) -> None:
            if drafts and request.request_id in auto.head_requests:  # the step's choice, until the next proposal
                head_accepted.append(len(sampled) - 1)
            rollback(request, drafts, sampled)

        scheduler._rollback_drafts = noting
        assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS + fresh, GREEDY)] == greedy + fresh_greedy
        assert auto.num_chosen["head"] > 0 and auto.num_chosen["suffix"] + auto.num_chosen["ngram"] > 0, \
            auto.num_chosen
        assert sum(head_accepted) > 0, head_accepted  # the head's own drafts held, not only the scheduler's
        stats = llm.engine.stats()
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()


@pytest.mark.parametrize("micro_batches, tp", [(1, 1), (2, 1), (1, 2)],
                         ids=["one-micro-batch", "two-micro-batches", "tp2-pp2"])
def test_a_draft_model_over_two_stages_keeps_plain_output(case, micro_batches, tp):
    """Method draft: the draft model runs whole on the last stage, which
    drafts ahead as the head does, its KV following every token the step
    computed (a prompt chunk that sampled nothing too); at TP 2 x PP 2 on the
    last stage's TP rank 0 alone, which samples. The target as its own
    draft: its greedy drafts hold wherever its KV followed the target's."""
    target, _, greedy, seeded = case
    llm = LLM(model=target, **ENGINE, speculative={**SPEC, "method": "draft", "model": target},
              pipeline_parallel_size=2, cpu_threads_per_rank=1, pp_micro_batches=micro_batches,
              tensor_parallel_size=tp, max_num_batched_tokens=16)  # the 20-token prompts go in two chunks
    try:
        assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY)] == greedy
        stats = llm.engine.stats()
        # Every draft held: its KV at the positions it drafted from was the target's prompt and tokens,
        # written ahead into slots the KV manager held past the step's tokens (lookahead_tokens).
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens, stats
        assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, SEEDED)] == seeded
        unseeded = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.9, ignore_eos=True,
                                                        logprobs=0))
        assert max_logprob_gap(target, PROMPTS, unseeded) < 1e-4
        llm.engine.check_integrity()
    finally:
        llm.engine.core.close()
