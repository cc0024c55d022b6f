"""`kvferry serve --device cuda`: the two-process server with its core on a
GPU (Triton attention, decode CUDA graphs) answers through the real openai
client as the offline engine does on that GPU (which matches HF's greedy
tokens), streams, and drains on SIGTERM (skipped without a GPU)."""
import pytest

from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.engine.test_equivalence import mixed_prompts
from tests.serve.server_process import start_server
from tests.tiny_models import make_tiny_checkpoint


@pytest.mark.gpu
def test_cuda_server_matches_offline_and_hf(tmp_path):
    import openai

    from kvferry import LLM, SamplingParams

    path = str(make_tiny_checkpoint(tmp_path, arch="llama", max_position_embeddings=1024))
    hf = load_hf(path)
    prompts = mixed_prompts(hf.config.vocab_size, lengths=(3, 40, 200))
    llm = LLM(model=path, dtype="float32", device="cuda", max_model_len=1024, kv_cache_memory_gb=0.5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    offline = [llm.generate([p], params)[0] for p in prompts]  # one at a time, as the server gets them
    for p, o in zip(prompts, offline):
        assert_greedy_match(hf, p, o.token_ids, hf_greedy(hf, p, 8))
    server = start_server(tmp_path / "server.log", ["--model", path, "--device", "cuda"])
    try:
        with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id
            for prompt, want in zip(prompts, offline):
                r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 8
                assert r.choices[0].text == want.text
            stream = client.completions.create(model=model, prompt=prompts[1], max_tokens=8, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in stream if c.choices) == offline[1].text
    finally:
        code = server.stop()
    assert code == 0, server.log()[-5000:]
