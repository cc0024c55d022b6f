"""The engine on the Triton attention backend gives HF's greedy tokens:
chunked prefill, prefix hits and batched decodes through the kernels
(Triton's interpreter on CPU; compiled on a GPU, where test_cuda.py also runs
the CUDA graphs)."""
import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.model import triton_attention
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.engine.test_equivalence import mixed_prompts
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not triton_attention.triton_available(), reason="needs triton")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_greedy_matches_hf(tmp_path, arch):
    path = str(make_tiny_checkpoint(tmp_path, arch=arch, max_position_embeddings=1024))
    hf = load_hf(path)
    # Triton's interpreter runs every kernel instance in Python: short, but a
    # 90-token prompt prefills in two chunks of --max-num-batched-tokens 64.
    prompts = mixed_prompts(hf.config.vocab_size, lengths=(1, 17, 90))
    prompts.append(prompts[2][:70] + prompts[0])  # a prefix hit on a shared 64-token prefix
    expected = [hf_greedy(hf, p, 4) for p in prompts]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter runs CPU tensors
    llm = LLM(model=path, dtype="float32", attention_backend="triton", max_num_batched_tokens=64, device=device,
              enforce_eager=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_match(hf, p, o.token_ids, e)
