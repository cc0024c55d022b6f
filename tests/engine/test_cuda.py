"""The CUDA path gives HF's greedy tokens too (skipped without a GPU)."""
import pytest

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.engine.test_equivalence import mixed_prompts
from tests.tiny_models import make_tiny_checkpoint


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_greedy_matches_hf(tmp_path, arch):
    path = str(make_tiny_checkpoint(tmp_path, arch=arch, max_position_embeddings=1024))
    hf = load_hf(path)
    prompts = mixed_prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    llm = LLM(model=path, dtype="float32", device="cuda", max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_match(hf, p, o.token_ids, e)
