"""A mixture-of-experts model (Qwen2-MoE with its shared expert) through a real
``kvferry serve`` and the openai client: concurrent greedy completions give
HF transformers' float32 tokens."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.engine.hf_reference import hf_greedy
from tests.serve.server_process import SERVE_ARGS, start_server
from tests.tiny_models import load_hf_model
from tests.tiny_moe_models import make_tiny_moe_checkpoint

MAX_NEW = 10


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_serve")
    path = make_tiny_moe_checkpoint(root, "qwen2_moe_top2")
    args = list(SERVE_ARGS)
    args[args.index("--max-model-len") + 1] = "256"  # the tiny model's max_position_embeddings
    srv = start_server(root / "server.log", ["--model", str(path), "--kv-cache-memory-gb", "0.05"], serve_args=args)
    yield srv, path
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"


def test_concurrent_greedy_completions_equal_hf(moe_server):
    import openai
    from tokenizers import Tokenizer

    srv, path = moe_server
    hf = load_hf_model(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    rng = random.Random(5)
    # Printable ASCII tokens only, so that the served text of HF's tokens is unambiguous.
    vocab = [i for i in range(3, hf.config.vocab_size) if tok.decode([i]).isascii() and tok.decode([i]).strip()]
    prompts = [[rng.choice(vocab) for _ in range(n)] for n in (3, 9, 17, 6)]
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300) as client:
        model = client.models.list().data[0].id

        def complete(prompt: list[int]):
            return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                             extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(len(prompts)) as pool:  # one batch: tokens of four requests share each step
            served = list(pool.map(complete, prompts))
    for prompt, out in zip(prompts, served):
        want = hf_greedy(hf, prompt, MAX_NEW)
        assert out.usage.completion_tokens == MAX_NEW
        assert out.choices[0].text == tok.decode(want), (prompt, want)
    assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200
