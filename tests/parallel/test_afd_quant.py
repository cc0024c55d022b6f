"""Quantized FFN workers: attention/FFN disaggregation with int8 weights and
with a GGUF file's blocks (tiny random Qwen3-MoE, 8 experts, top-2). The
greedy output equals the same quantization colocated:

- ``--quantization int8`` at 1 FFN worker (a dense layer among the sparse
  ones), and at 2 on an all-sparse config (each worker quantizes its four
  whole experts, so every weight's per-channel scale is the colocated one);
- a Q8_0 ``.gguf`` at 1 FFN worker, its blocks (the experts' included)
  kept on the worker as the colocated core keeps them, and at 2 on the
  all-sparse config: each worker reads only its four whole experts' blocks
  (model/gguf_shard.py), the colocated bytes. Its greedy output agrees
  with colocated up to colocated's first near tie (the test's docstring).

``LLM(ffn=M)`` runs one core with its own M workers: the same worker
processes and loading as ``kvferry serve --mode afd``."""
from __future__ import annotations

import pytest

from kvferry import LLM, SamplingParams
from tests.parallel.afd_helpers import PROMPTS
from tests.tiny_moe_models import make_tiny_moe_checkpoint, write_tiny_moe_gguf

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PARAMS_LOGPROBS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("afd-quant")
    mixed = make_tiny_moe_checkpoint(root / "mixed", "qwen3_moe_top2", max_position_embeddings=1024)
    sparse = make_tiny_moe_checkpoint(root / "sparse", "qwen3_moe_top2", max_position_embeddings=1024,
                                      mlp_only_layers=[])
    return {"mixed": str(mixed), "sparse": str(sparse),
            "gguf": str(write_tiny_moe_gguf(mixed, root / "tiny-moe-q8.gguf", "Q8_0")),
            "gguf_sparse": str(write_tiny_moe_gguf(sparse, root / "tiny-sparse-moe-q8.gguf", "Q8_0"))}


def greedy(model: str, ffn: int, logprobs: bool = False, **kwargs) -> list:
    """Each prompt's greedy token ids; with ``logprobs``, its completions (top-2 logprobs per token)."""
    llm = LLM(model=model, dtype="float32", kv_cache_memory_gb=0.02, ffn=ffn, **kwargs)
    try:
        if ffn:
            assert len(llm.engine.core.ranks()) == ffn + 1
        if logprobs:
            return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS_LOGPROBS)]
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.engine.core.close()


@pytest.mark.parametrize(("case", "ffn"), [("mixed", 1), ("sparse", 2)])
def test_int8_ffn_workers_equal_int8_colocated(models, case, ffn):
    assert greedy(models[case], ffn, quantization="int8") == greedy(models[case], 0, quantization="int8")


@pytest.mark.parametrize(("case", "ffn"), [("gguf", 1), ("gguf_sparse", 2)])
def test_gguf_blocks_on_the_ffn_workers_equal_the_gguf_colocated(models, case, ffn):
    """Greedy agrees with colocated, and where they part it is at a near tie
    of colocated's. The workers' logprobs are not the colocated bits (measured:
    up to 0.02 nats apart, 0.06 a few tokens on, on prompts long enough for the
    prefill tiles; the 2-token prompt's are equal), and this random model's
    near-flat logits put near ties (top-2 within 0.0001-0.05 nats) in most
    continuations, where either may pick the other token."""
    workers = greedy(models[case], ffn, logprobs=True)
    colocated = greedy(models[case], 0, logprobs=True)
    for w, c in zip(workers, colocated):
        for step, lp in enumerate(c.logprobs):
            assert abs(w.logprobs[step].top_logprobs[0] - lp.top_logprobs[0]) < 0.1, (step, w, c)
            if w.token_ids[step] != c.token_ids[step]:
                assert lp.top_logprobs[0] - lp.top_logprobs[1] < 0.1, (step, w, c)  # a near tie
                break  # the two continue from different tokens
