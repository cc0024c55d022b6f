"""Speculative decoding on a disaggregated pair (two in-process engine
cores with their real transfer sockets; the test plays the router): for
each method the decode core drafts from its first step, greedy output is
colocated plain decoding's, and the decode core computes no prompt
position, the target's or the draft model's. Mismatched speculation is
refused at hand-over."""
from __future__ import annotations

import pytest

from kvferry import LLM, SamplingParams
from tests.disagg.driver import (
    Result, closing_cores, decode_side, finish_decode, make_core, prefill_side, run_disagg, settle, step_until,
)
from tests.disagg.test_disagg_engine import prompt_of
from tests.tiny_models import make_tiny_checkpoint, make_random_head

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("disagg-spec"), arch="llama", num_hidden_layers=2,
                                    max_position_embeddings=1024))


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory):
    """A smaller model on the same tokenizer: fewer layers, fewer KV heads,
    another head size, so its KV blocks differ from the target's in shape."""
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("disagg-spec-draft"), arch="llama", seed=3,
                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                    hidden_size=32, intermediate_size=64, max_position_embeddings=1024))


@pytest.fixture(scope="module")
def head_file(checkpoint, tmp_path_factory):
    return make_random_head(checkpoint, tmp_path_factory.mktemp("disagg-spec-head"))


@pytest.fixture(scope="module")
def plain(checkpoint):
    return LLM(model=checkpoint, dtype="float32")


def spec_of(method: str, checkpoint: str, draft_checkpoint: str, head_file: str) -> dict:
    # k fixed whatever the step timings, so two runs draft alike
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False, "cost_aware": False,
            "batch_token_threshold": 10**6}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1  # the first token alone finds a match (see repetitive_prompt)
    elif method == "draft":
        spec["model"] = checkpoint  # the target as its own draft: every greedy draft holds
    elif method == "head":
        spec["model"] = head_file
    return spec


def repetitive_prompt(vocab_size: int = 384) -> list[int]:
    """Every id once (whatever the first token, prompt lookup finds it),
    then a passage three times."""
    passage = prompt_of(23, seed=5)
    return list(range(vocab_size)) + passage * 3 + passage[:4]


@pytest.mark.parametrize(("method", "transport"), [("ngram", "shm"), ("head", "tcp"), ("draft", "shm"),
                                                    ("draft", "tcp")])
def test_decode_core_drafts_at_its_first_step_and_recomputes_nothing(
        checkpoint, draft_checkpoint, head_file, plain, method, transport):
    spec = spec_of(method, checkpoint, draft_checkpoint, head_file)
    prefill = make_core(checkpoint, speculative=spec, kv_transport=transport, max_num_batched_tokens=32)
    decode = make_core(checkpoint, speculative=spec)
    with closing_cores(prefill, decode):
        prompt = repetitive_prompt()
        expected = list(plain.generate([prompt], GREEDY)[0].outputs[0].token_ids)
        result = Result(destination=decode_side(decode, "a", prompt, GREEDY))
        first = prefill_side(prefill, "a", prompt, GREEDY, result.destination)
        assert first.finish_reason == "prefilled"
        result.tokens = list(first.new_token_ids)
        # The decode core's first step that gives tokens already verified drafts.
        outs = step_until(decode, lambda seen: any(o.new_token_ids for o in seen))
        stats = decode.stats()
        assert stats.num_drafts == 1 and stats.num_draft_tokens == 3, stats
        result.tokens += [t for o in outs for t in o.new_token_ids]
        finish_decode(decode, "a", result)
        assert result.tokens == expected
        assert not result.transfer_errors
        stats = decode.stats()
        if method != "head":  # a random head's drafts are rarely right; prompt lookup's and the self-draft's are
            assert stats.num_accepted_tokens > 0, stats
        # The decode core drafted exactly as a colocated core does: the same
        # drafter state (context, hidden state, draft KV) from the first step.
        colocated = LLM(model=checkpoint, dtype="float32", speculative=spec)
        assert list(colocated.generate([prompt], GREEDY)[0].outputs[0].token_ids) == expected
        c = colocated.engine.stats()
        assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                stats.num_accepted_tokens_per_pos) == (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                                                       c.num_accepted_tokens_per_pos)
        assert stats.num_prompt_tokens_computed == 0
        assert stats.num_draft_prompt_tokens_computed == 0
        if method == "draft":  # the prefill core's draft computed the whole prompt
            assert prefill.stats().num_draft_prompt_tokens_computed == len(prompt)
        assert prefill.stats().num_prompt_tokens_computed == len(prompt)
        settle(prefill, decode)


def test_draft_model_of_another_shape_ships_its_own_layers(checkpoint, draft_checkpoint, plain):
    """A draft whose blocks differ in shape from the target's (1 layer, 1 KV
    head of 16): the same block ids index both pools, so the transfer sends
    the draft's layer as layer 2 of the same blocks."""
    spec = {"method": "draft", "model": draft_checkpoint, "num_speculative_tokens": 2}
    prefill = make_core(checkpoint, speculative=spec)
    decode = make_core(checkpoint, speculative=spec)
    with closing_cores(prefill, decode):
        draft_kv = decode.runner.drafter.kv_cache
        assert draft_kv.shape[0] == 1 and draft_kv.shape[3:] != decode.runner.kv_cache.shape[3:]
        prompt = prompt_of(40, seed=9)
        result = run_disagg(prefill, decode, "a", prompt, GREEDY)
        assert result.tokens == list(plain.generate([prompt], GREEDY)[0].outputs[0].token_ids)
        assert not result.transfer_errors
        blocks = result.destination.block_ids
        # The decode core's draft pool holds exactly the prefill core's draft KV for the prompt.
        src = prefill.runner.drafter.kv_cache
        assert decode.stats().num_draft_prompt_tokens_computed == 0
        assert decode.stats().num_draft_tokens > 0
        assert src.abs().sum() > 0 and draft_kv[:, :, blocks].abs().sum() > 0


def test_mismatched_speculation_is_refused_at_hand_over(checkpoint, draft_checkpoint, head_file, plain):
    """A prefill core without the decode core's draft model: the decode core
    refuses the transfer, naming both configurations, and recomputes."""
    prefill = make_core(checkpoint)
    decode = make_core(checkpoint, speculative=spec_of("draft", checkpoint, draft_checkpoint, head_file))
    with closing_cores(prefill, decode):
        prompt = prompt_of(30, seed=2)
        result = run_disagg(prefill, decode, "a", prompt, GREEDY)
        assert result.tokens == list(plain.generate([prompt], GREEDY)[0].outputs[0].token_ids)
        assert result.transfer_errors and "speculative configurations differ" in result.transfer_errors[0]
        assert "'none'" in result.transfer_errors[0] and "draft:" in result.transfer_errors[0]
        assert decode.stats().num_prompt_tokens_computed == len(prompt)  # recomputed here
