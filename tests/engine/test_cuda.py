"""The CUDA path gives HF's greedy tokens too (skipped without a GPU): the
Triton kernels with decode steps replayed from CUDA graphs, the same eagerly,
and torch's own ops."""
import pytest
import torch

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.engine.test_equivalence import mixed_prompts
from tests.tiny_models import make_tiny_checkpoint

CASES = {
    "graphs": dict(),
    "eager": dict(enforce_eager=True),
    "torch": dict(attention_backend="torch"),
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def reference(request, tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param,
                                    max_position_embeddings=1024))
    hf = load_hf(path)
    prompts = mixed_prompts(hf.config.vocab_size)
    prompts.append(prompts[4][:100] + prompts[1])  # shares 96 tokens with a prompt before it
    return path, hf, prompts, [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_greedy_matches_hf(reference, case):
    path, hf, prompts, expected = reference
    llm = LLM(model=path, dtype="float32", device="cuda", max_num_batched_tokens=64, **CASES[case])
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_match(hf, p, o.token_ids, e)
    graphs = llm.engine.core.runner.graphs
    if case == "graphs":
        assert graphs is not None and not graphs.disabled and graphs.replays > 0, "no decode step was replayed"
    else:
        assert graphs is None or graphs.replays == 0


@pytest.mark.gpu
def test_cuda_graph_batches_match_eager_bf16(reference):
    """Padded graph batches of every size give the eager path's tokens (bf16,
    sampled at temperature 0 and with seeds)."""
    path, hf, prompts, _ = reference
    prompts = [p for p in prompts for _ in range(3)][:17]  # 17 requests: batches 17 -> 32 padded, then fewer
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    eager = LLM(model=path, dtype="bfloat16", device="cuda", enforce_eager=True).generate(prompts, params)
    torch.cuda.synchronize()
    graphed = LLM(model=path, dtype="bfloat16", device="cuda").generate(prompts, params)
    same = sum(a.token_ids == b.token_ids for a, b in zip(eager, graphed))
    # bf16 matmuls of another batch shape may round differently: nearly all
    # sequences must still agree token for token.
    assert same >= len(prompts) - 2, [(a.token_ids, b.token_ids) for a, b in zip(eager, graphed)]
