"""The draft head beside a P/D transfer over pipeline stages (two in-process
engine cores with their real transfer sockets and stage processes; the test
plays the router), on a tiny Llama of 4 layers (2 a stage) with an echo head
(fc = [0 | I], no MLP: its draft is the token the target's lm_head gives the
hidden state it is handed, so a wrong or missing state drafts otherwise):

- P(pp 2) / D(pp 1), method head: the prefill core's last stage, which alone
  has the hidden state the head drafts from, sends it to stage 0 with the
  step's output, and stage 0's Done carries it; the decode core drafts from
  its first step exactly as a colocated core does (the same drafts, the same
  accepted counts per position).
- P(pp 2) / D(pp 2), method auto with the head among its choices: the
  decode core's last stage drafts ahead from its own first step on.

Greedy output equals plain decoding's and HF transformers' in float32, and
the decode core computes no prompt position."""
from __future__ import annotations

import pytest

from kvferry import LLM, SamplingParams
from tests.disagg.driver import Result, closing_cores, decode_side, finish_decode, make_core, prefill_side, settle, \
    step_until
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.parallel.test_pp_head import write_echo_head
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# k fixed: on a loaded 2-core box the cost-aware controller may stop drafting.
SPEC = {"method": "head", "num_speculative_tokens": 3, "adaptive": False, "cost_aware": False,
        "batch_token_threshold": 10**6}
# A repeated token and a repeated passage (the echo head's drafts hold there); the second spans
# several prefill chunks (max_num_batched_tokens 32).
PROMPTS = [[7] * 20, [11, 40, 99, 3, 250] * 10]
STAGES = dict(pipeline_parallel_size=2, cpu_threads_per_rank=1)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(target, echo head, plain greedy tokens checked against HF)."""
    root = tmp_path_factory.mktemp("pd-pp-head")
    target = str(make_tiny_checkpoint(root, arch="llama", num_hidden_layers=4, max_position_embeddings=1024))
    write_echo_head(target, root / "echo.safetensors")
    hf = load_hf(target)
    plain = LLM(model=target, dtype="float32", kv_cache_memory_gb=0.02, warm_up=False)
    try:
        greedy = [list(r.outputs[0].token_ids) for r in plain.generate(PROMPTS, GREEDY)]
    finally:
        plain.engine.core.close()
    for p, ours in zip(PROMPTS, greedy):
        assert_greedy_match(hf, p, ours, hf_greedy(hf, p, MAX_NEW))
    return target, str(root / "echo.safetensors"), greedy


def _pair(target: str, spec: dict, prefill_stages: bool, decode_stages: bool):
    prefill = make_core(target, speculative=spec, max_num_batched_tokens=32, warm_up=False,
                        **(STAGES if prefill_stages else {}))
    decode = make_core(target, speculative=spec, warm_up=False, **(STAGES if decode_stages else {}))
    return prefill, decode


def _hand_over(prefill, decode, rid: str, prompt: list[int]) -> Result:
    """Up to the prefill core's first token; the decode core has the KV ordered."""
    result = Result(destination=decode_side(decode, rid, prompt, GREEDY))
    first = prefill_side(prefill, rid, prompt, GREEDY, result.destination)
    assert first.finish_reason == "prefilled", first
    result.tokens = list(first.new_token_ids)
    return result


def test_prefill_over_stages_ships_the_heads_hidden_state(case):
    target, head, greedy = case
    spec = {**SPEC, "model": head}
    prefill, decode = _pair(target, spec, prefill_stages=True, decode_stages=False)
    with closing_cores(prefill, decode):
        for i, (prompt, want) in enumerate(zip(PROMPTS, greedy)):
            before = decode.stats()
            result = _hand_over(prefill, decode, f"r{i}", prompt)
            # The decode core's first step that gives tokens verified drafts made from the shipped state.
            outs = step_until(decode, lambda seen: any(o.new_token_ids for o in seen))
            stats = decode.stats()
            assert (stats.num_drafts - before.num_drafts, stats.num_draft_tokens - before.num_draft_tokens) == (1, 3)
            result.tokens += [t for o in outs if o.request_id == f"r{i}" for t in o.new_token_ids]
            finish_decode(decode, f"r{i}", result)
            assert result.tokens == want and not result.transfer_errors
        # Drafted exactly as a colocated core: the same hidden state from the first step.
        colocated = LLM(model=target, dtype="float32", kv_cache_memory_gb=0.02, warm_up=False, speculative=spec)
        try:
            for prompt, want in zip(PROMPTS, greedy):  # one at a time, as the pair ran them
                assert list(colocated.generate([prompt], GREEDY)[0].outputs[0].token_ids) == want
            c = colocated.engine.stats()
        finally:
            colocated.engine.core.close()
        stats = decode.stats()
        assert c.num_accepted_tokens > 0
        assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                stats.num_accepted_tokens_per_pos) == (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                                                       c.num_accepted_tokens_per_pos)
        assert stats.num_prompt_tokens_computed == 0
        settle(prefill, decode)


def test_auto_with_a_head_on_both_pools_over_stages(case):
    target, head, greedy = case
    prefill, decode = _pair(target, {**SPEC, "method": "auto", "model": head}, prefill_stages=True,
                            decode_stages=True)
    with closing_cores(prefill, decode):
        assert decode.scheduler.proposer.has_head
        for i, (prompt, want) in enumerate(zip(PROMPTS, greedy)):
            result = finish_decode(decode, f"a{i}", _hand_over(prefill, decode, f"a{i}", prompt), timeout_s=120)
            assert result.tokens == want and not result.transfer_errors
        stats = decode.stats()
        assert stats.num_prompt_tokens_computed == 0
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        settle(prefill, decode, timeout_s=60)
