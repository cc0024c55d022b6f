"""A draft model (method "draft") beside a P/D transfer over pipeline
stages (two in-process engine cores with their real transfer sockets and
stage processes; the test plays the router), on a tiny Llama of 4 layers
(2 a stage), the target as its own draft (its greedy drafts hold wherever
its KV follows the target's).

The draft runs whole on the last stage of a core of stages. Beside a KV
transfer its pool is in shared memory: a prefill core's last stage sends
its layers of each step's prompt blocks (numbered after the model's) once
its draft has run, before its part of the transfer ends; a decode core's
stage 0 receives them into that pool and tells the last stage, with the
next step, whose prompt's draft KV is in place. Every layout of the pair
(P pp 2 / D pp 2, P pp 2 / D pp 1, P pp 1 / D pp 2, and TP 2 x PP 2 on
both sides) keeps plain decoding's
greedy output, every draft the decode core made is accepted (the draft
KV it received is the target's own), and the decode core computes no
prompt position, neither the target's nor the draft's."""
from __future__ import annotations

import pytest

from kvferry import LLM, SamplingParams
from tests.disagg.driver import Result, closing_cores, decode_side, finish_decode, make_core, prefill_side, settle
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# A repeated token and a repeated passage; the second spans several prefill chunks (max_num_batched_tokens 32).
PROMPTS = [[7] * 20, [11, 40, 99, 3, 250] * 10]
STAGES = dict(pipeline_parallel_size=2, cpu_threads_per_rank=1)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(target, plain greedy tokens checked against HF)."""
    root = tmp_path_factory.mktemp("pd-pp-draft")
    target = str(make_tiny_checkpoint(root, arch="llama", num_hidden_layers=4, max_position_embeddings=1024))
    hf = load_hf(target)
    plain = LLM(model=target, dtype="float32", kv_cache_memory_gb=0.02, warm_up=False)
    try:
        greedy = [list(r.outputs[0].token_ids) for r in plain.generate(PROMPTS, GREEDY)]
    finally:
        plain.engine.core.close()
    for p, ours in zip(PROMPTS, greedy):
        assert_greedy_match(hf, p, ours, hf_greedy(hf, p, MAX_NEW))
    return target, greedy


@pytest.mark.parametrize("prefill_stages, decode_stages, tp",
                         [(True, True, 1), (True, False, 1), (False, True, 1), (True, True, 2)],
                         ids=["p-pp2-d-pp2", "p-pp2-d-pp1", "p-pp1-d-pp2", "p-tp2-pp2-d-tp2-pp2"])
def test_a_draft_model_beside_a_kv_transfer_over_stages(case, prefill_stages, decode_stages, tp):
    """At TP 2 x PP 2 the draft runs on the last stage's TP rank 0 alone,
    which sends its layers and maps the decode pool's draft segment."""
    target, greedy = case
    # k fixed: on a loaded 2-core box the cost-aware controller may stop drafting.
    spec = {"method": "draft", "model": target, "num_speculative_tokens": 3, "adaptive": False,
            "cost_aware": False, "batch_token_threshold": 10**6}
    prefill = make_core(target, speculative=spec, max_num_batched_tokens=32, warm_up=False, tensor_parallel_size=tp,
                        **(STAGES if prefill_stages else {}))
    decode = make_core(target, speculative=spec, warm_up=False, tensor_parallel_size=tp,
                       **(STAGES if decode_stages else {}))
    with closing_cores(prefill, decode):
        for i, (prompt, want) in enumerate(zip(PROMPTS, greedy)):
            result = Result(destination=decode_side(decode, f"d{i}", prompt, GREEDY))
            first = prefill_side(prefill, f"d{i}", prompt, GREEDY, result.destination)
            assert first.finish_reason == "prefilled", first
            result.tokens = list(first.new_token_ids)
            result = finish_decode(decode, f"d{i}", result, timeout_s=120)
            assert result.tokens == want and not result.transfer_errors
        stats = decode.stats()
        assert stats.num_prompt_tokens_computed == 0
        assert stats.num_draft_prompt_tokens_computed == 0, stats  # the prefill core's draft KV, received
        assert prefill.stats().num_draft_prompt_tokens_computed == sum(map(len, PROMPTS))
        # Every draft the decode core made holds (the target drafting itself over the draft KV it received);
        # a decode core of stages keeps placeholders in its first step's slots (its last stage drafts ahead,
        # from that step on), verified and rejected.
        placeholders = 3 * len(PROMPTS) if decode_stages else 0
        assert stats.num_draft_tokens > placeholders
        assert stats.num_accepted_tokens == stats.num_draft_tokens - placeholders, stats
        settle(prefill, decode, timeout_s=60)
