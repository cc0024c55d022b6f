"""--deterministic: in bf16, a prompt's greedy tokens and logprobs are the
same bits alone, in a batch, chunked, and after 0, 160 or all-but-the-last
cached tokens (issue 45: greedy output depended on the batch and on prefix
hits). Without the flag these runs differ in their low bits on an AMX CPU
(oneDNN picks its blocking by the row count; the attention kernel groups
a chunk's query tokens and splits long contexts by the step's size)."""
from __future__ import annotations

import random

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.model import small_gemm
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 16
CACHED = 160  # a block-aligned prefix (block_size 16)

pytestmark = pytest.mark.skipif(not small_gemm.cpu_supports(torch.bfloat16),
                                reason="needs AVX512-BF16 for the batch-invariant bf16 matmul")


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    # Wide enough (K = 256 / 512) that a reduction order shows in bf16's low bits.
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("det"), "llama", hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    rng = random.Random(45)
    vocab = 384
    prompt = _prompt(rng, 300, vocab)
    others = [_prompt(rng, n, vocab) for n in (37, 211, 5, 90)]
    return str(path), prompt, others, prompt[:CACHED] + _prompt(rng, 60, vocab)


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="bfloat16", deterministic=True, num_kv_blocks=512, block_size=16, **kw)


def _result(out) -> tuple[list[int], list[list[float]]]:
    o = out.outputs[0]
    return list(o.token_ids), [list(lp.top_logprobs) for lp in o.logprobs]


@pytest.fixture(scope="module")
def runs(case):
    path, prompt, others, shares_prefix = case
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=5, ignore_eos=True)
    # Decodes of different lengths: the batch shrinks as its requests finish.
    mixed = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=5, ignore_eos=True) for n in (3, 9, 1, 12)]
    got = {}
    fresh = _llm(path, enable_prefix_caching=False)
    got["alone"] = _result(fresh.generate([prompt], params)[0])
    outs = fresh.generate([others[0], prompt, *others[1:]], [mixed[0], params, *mixed[1:]])
    got["in a batch"] = _result(outs[1])
    chunked = _llm(path, enable_prefix_caching=False, max_num_batched_tokens=32)
    got["chunked"] = _result(chunked.generate([prompt], params)[0])
    got["chunked in a batch"] = _result(chunked.generate([others[1], prompt], [mixed[1], params])[1])
    cached = _llm(path, enable_prefix_caching=True)
    cached.generate([shares_prefix], params)
    got[f"{CACHED} cached"] = _result(cached.generate([prompt], params)[0])
    got["all cached"] = _result(cached.generate([prompt], params)[0])
    got["all cached in a batch"] = _result(cached.generate([others[2], prompt, others[3]],
                                                           [mixed[2], params, mixed[3]])[1])
    return got


@pytest.mark.parametrize("how", ["in a batch", "chunked", "chunked in a batch", f"{CACHED} cached", "all cached",
                                 "all cached in a batch"])
def test_same_bits_as_alone(runs, how):
    want_tokens, want_logprobs = runs["alone"]
    tokens, logprobs = runs[how]
    assert tokens == want_tokens
    assert logprobs == want_logprobs  # exact floats: the logits' bits, not a tolerance


def test_flag_reaches_the_model_and_is_validated(case):
    with pytest.raises(ValueError, match="deterministic"):
        LLM(model=case[0], dtype="bfloat16", deterministic="yes")
    with pytest.raises(ValueError, match="deterministic"):
        LLM(model=case[0], device="cuda", deterministic=True)


def test_disaggregated_same_bits_first_time_and_on_a_prefix_hit(case, runs):
    """P/D (issue 45: the second ask, a prefix hit on the prefill core, gave
    other greedy text): the prefill core's first token and the decode core's
    tokens, with their logprobs, are the prompt's colocated bits, both times."""
    from tests.disagg.driver import decode_side, drain, make_core, prefill_side, step_until

    path, prompt, _, _ = case
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=5, ignore_eos=True)
    kw = dict(dtype="bfloat16", deterministic=True, num_kv_blocks=128, kv_transport="tcp")
    prefill, decode = make_core(path, max_num_batched_tokens=40, **kw), make_core(path, **kw)
    try:
        for rid in ("first", "again"):
            first = prefill_side(prefill, rid, prompt, params, decode_side(decode, rid, prompt, params))
            outs = [first] + step_until(decode, lambda seen: any(o.finished and o.request_id == rid for o in seen))
            mine = [o for o in outs if o.request_id == rid]
            assert not any(o.kv_transfer_error for o in mine)
            tokens = [t for o in mine for t in o.new_token_ids]
            logprobs = [list(lp.top_logprobs) for o in mine for lp in (o.new_logprobs or [])]
            assert (tokens, logprobs) == runs["alone"], rid
        drain(prefill)
        drain(decode)
    finally:
        prefill.close()
        decode.close()


def test_step_budget_bound_matches_the_kernel(case):
    from kvferry.config import DETERMINISTIC_MAX_BATCHED_TOKENS
    from kvferry.model.attention import kernel_max_chunk_tokens

    assert DETERMINISTIC_MAX_BATCHED_TOKENS == kernel_max_chunk_tokens()
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(model=case[0], dtype="bfloat16", deterministic=True, max_num_batched_tokens=9000)
