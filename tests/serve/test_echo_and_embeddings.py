"""Echo with prompt logprobs on /v1/completions, and /v1/embeddings, through
the openai client on a real server of a tiny random checkpoint, against the
same checkpoint in HF transformers (float32 on both sides).

The server runs small steps (--max-num-batched-tokens 32) so that the prompts
here are prefilled in several chunks: prompt logprobs and mean pooling are
computed chunk by chunk.
"""
from __future__ import annotations

import base64
import math

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.serve.server_process import start_server
from tests.tiny_models import load_hf_model, make_tiny_checkpoint

MODEL = "tiny"
PROMPT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
          "the cat sat on the mat; the dog sat on the log; they are friends and they play")
SERVE_ARGS = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256",
              "--max-num-batched-tokens", "32", "--kv-cache-memory-gb", "0.05", "--no-warm-up",
              "--check-kv-integrity", "--disable-uvicorn-access-log", "--log-level", "warning"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama"))


@pytest.fixture(scope="module")
def hf(tiny):
    return load_hf_model(tiny)


def _serve(tiny, log_dir, pooling: str):
    srv = start_server(log_dir / "server.log", ["--model", tiny, "--embedding-pooling", pooling],
                       serve_args=SERVE_ARGS)
    try:
        with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120) as client:
            yield srv, client
    finally:
        code = srv.stop()
    assert code == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    yield from _serve(tiny, tmp_path_factory.mktemp("last"), "last")


@pytest.fixture(scope="module")
def served_mean(tiny, tmp_path_factory):
    yield from _serve(tiny, tmp_path_factory.mktemp("mean"), "mean")


def _token_ids(srv, text: str) -> list[int]:
    r = httpx.post(f"{srv.base_url}/tokenize", json={"prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@torch.no_grad()
def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the distribution of the token after ids[i]."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@torch.no_grad()
def _hf_embedding(hf, ids: list[int], pooling: str) -> np.ndarray:
    hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()  # after the norm
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0).numpy()


def _check_prompt_logprobs(lp, ids: list[int], ref: torch.Tensor, num_top: int) -> None:
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    for i in range(1, len(ids)):
        expected = ref[i - 1, ids[i]].item()
        assert abs(lp.token_logprobs[i] - expected) < 1e-3, (i, lp.token_logprobs[i], expected)
        # The top-n plus the prompt token itself, keyed by token string (two
        # tokens holding parts of one UTF-8 character share the key U+FFFD,
        # and the later one's value stays, as in vLLM).
        top = lp.top_logprobs[i]
        allowed = [*ref[i - 1].topk(num_top).values.tolist(), expected]
        assert 1 <= len(top) <= num_top + 1
        assert all(min(abs(v - a) for a in allowed) < 1e-3 for v in top.values()), (i, top, allowed)


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(served, hf):
    srv, client = served
    ids = _token_ids(srv, PROMPT)
    assert len(ids) > 64  # several prefill chunks of 32
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2,
                                    temperature=0.0)
    choice = out.choices[0]
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ids)
    assert "".join(choice.logprobs.tokens) == PROMPT
    _check_prompt_logprobs(choice.logprobs, ids, _hf_logprobs(hf, ids), 2)


def test_lm_eval_loglikelihood_request_shape(served, hf):
    """lm-eval's local-completions: token ids, echo, logprobs=1, max_tokens=1;
    it sums token_logprobs[ctxlen:-1]. The same prompt twice: the second
    time its blocks are in the prefix cache, which the request must not use."""
    srv, client = served
    ids = _token_ids(srv, PROMPT)
    ref = _hf_logprobs(hf, ids)
    client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0.0)  # caches the prefix
    for _ in range(2):
        out = client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                        temperature=0.0, seed=1234)
        lp = out.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + 1
        _check_prompt_logprobs(lp, ids, ref, 1)
        # The generated (greedy) token's logprob comes last.
        assert abs(lp.token_logprobs[-1] - ref[-1].max().item()) < 1e-3
        ctxlen = len(ids) // 2
        summed = sum(lp.token_logprobs[ctxlen:-1])
        expected = sum(ref[i - 1, ids[i]].item() for i in range(ctxlen, len(ids)))
        assert abs(summed - expected) < 1e-3
        prompt_text = httpx.post(f"{srv.base_url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
        assert out.choices[0].text.startswith(prompt_text)


def test_echo_without_logprobs_and_errors(served):
    _, client = served
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, echo=True, temperature=0.0)
    assert out.choices[0].text.startswith("Hello world")
    assert out.usage.completion_tokens == 3 and out.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=0)  # no echo: nothing to return


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_embeddings_last_token_pooling(served, hf, fmt):
    srv, client = served
    texts = ["Paris is the capital of France.", PROMPT]
    ids = [_token_ids(srv, t) for t in texts]
    out = client.embeddings.create(model=MODEL, input=texts, encoding_format=fmt)
    assert [d.index for d in out.data] == [0, 1]
    assert out.usage.prompt_tokens == sum(len(i) for i in ids) == out.usage.total_tokens
    for d, i in zip(out.data, ids):
        if fmt == "base64":  # asked for explicitly, the client leaves it as sent: little-endian float32 bytes
            assert isinstance(d.embedding, str)
            got = np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
            floats = client.embeddings.create(model=MODEL, input=i, encoding_format="float").data[0].embedding
            assert np.array_equal(got, np.asarray(floats, dtype=np.float32))  # the very same floats
        else:
            got = np.asarray(d.embedding, dtype=np.float32)
        assert np.abs(got - _hf_embedding(hf, i, "last")).max() < 1e-4
        assert math.isclose(float(np.linalg.norm(got)), 1.0, rel_tol=1e-5)


def test_embeddings_input_forms_and_errors(served, hf):
    srv, client = served
    ids = _token_ids(srv, "the cat sat on the mat")
    one = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")  # one input as token ids
    many = client.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    assert len(one.data) == 1 and len(many.data) == 2
    assert np.abs(np.asarray(one.data[0].embedding) - _hf_embedding(hf, ids, "last")).max() < 1e-4
    assert np.abs(np.asarray(many.data[1].embedding) - _hf_embedding(hf, ids[:3], "last")).max() < 1e-4
    for body, param in [({"input": []}, "input"), ({"input": ""}, "input"), ({"input": "x", "dimensions": 8},
                        "dimensions"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": [10**9]}, None)]:
        r = httpx.post(f"{srv.api_url}/embeddings", json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        if param is not None:
            assert r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200


def test_embeddings_mean_pooling(served_mean, hf):
    srv, client = served_mean
    texts = [PROMPT, "Hello world! How are you today?"]
    ids = [_token_ids(srv, t) for t in texts]
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)  # its prefix is cached: not used
    out = client.embeddings.create(model=MODEL, input=texts)  # the client's default: base64
    for d, i in zip(out.data, ids):
        assert np.abs(np.asarray(d.embedding, dtype=np.float32) - _hf_embedding(hf, i, "mean")).max() < 1e-4
