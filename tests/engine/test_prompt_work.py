"""Prompt logprobs and pooling in the engine (offline, tiny checkpoint)
against HF transformers: through chunked prefill, next to requests that ask
for nothing, across preemption, and past a prefix-cache hit."""
from __future__ import annotations

import pytest
import torch

from kvferry.engine.llm import LLM
from kvferry.sampling import SamplingParams
from tests.tiny_models import load_hf_model, make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="qwen3"))


@torch.no_grad()
def _reference(hf, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    out = hf(torch.tensor([ids]), output_hidden_states=True)
    return torch.log_softmax(out.logits[0].float(), dim=-1), out.hidden_states[-1][0].float()


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 380 + 3 for j in range(length)] for i in range(n)]


def test_prompt_logprobs_through_preemption_and_next_to_plain_requests(tiny):
    hf = load_hf_model(tiny)
    # 14 blocks of 16 tokens for four 70-token prompts growing by 24 tokens:
    # they cannot all run, so some are preempted and recomputed.
    llm = LLM(tiny, dtype="float32", warm_up=False, max_model_len=256, max_num_batched_tokens=32,
              num_kv_blocks=14)
    prompts = _prompts(4, 70)
    plain = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    asking = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, prompt_logprobs=3)
    baseline = [o.token_ids for o in llm.generate(prompts, plain)]
    outs = llm.generate(prompts, [asking, plain, asking, plain])
    assert llm.engine.core.scheduler.num_preemptions > 0
    for i, (ids, out) in enumerate(zip(prompts, outs)):
        assert out.token_ids == baseline[i]  # asking changes nothing else
        if i % 2:
            assert out.prompt_logprobs is None
            continue
        ref, _ = _reference(hf, ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for j in range(1, len(ids)):
            e = out.prompt_logprobs[j]
            assert e.token_id == ids[j] and abs(e.logprob - ref[j - 1, ids[j]].item()) < 1e-4
            assert e.rank == int((ref[j - 1] > ref[j - 1, ids[j]]).sum()) + 1
            assert e.top_token_ids == ref[j - 1].topk(3).indices.tolist()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooling_is_prompt_only_and_skips_the_prefix_cache(tiny, pooling):
    hf = load_hf_model(tiny)
    llm = LLM(tiny, dtype="float32", warm_up=False, max_model_len=256, max_num_batched_tokens=32)
    prompts = _prompts(3, 60)
    llm.generate(prompts, SamplingParams(max_tokens=1))  # their blocks are now cached
    outs = llm.generate(prompts, SamplingParams(pooling=pooling))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == [] and out.finish_reason == "length"
        _, hidden = _reference(hf, ids)
        vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        expected = torch.nn.functional.normalize(vector, dim=0)
        assert (torch.tensor(out.embedding) - expected).abs().max().item() < 1e-5
    assert llm.engine.core.scheduler.kv.pool.num_used_blocks == 0  # nothing held once finished


def test_bad_prompt_work_params():
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="max")
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    assert SamplingParams(pooling="mean").prompt_only
