"""vLLM's and OpenAI's routes that clients call: GET /v1/models/{id}
(client.models.retrieve), /ping, /v1/tokenize and /v1/detokenize; unknown
body fields named in X-Unknown-Fields and logged once per name."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.server_process import MAX_MODEL_LEN, MODEL_NAME

pytestmark = pytest.mark.usefixtures("healthy")


def test_models_retrieve(client):
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model" and card.max_model_len == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    err = info.value.body
    assert err["code"] == "model_not_found" and "no-such-model" in err["message"]


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping(server, method):
    r = httpx.request(method, f"{server.base_url}/ping", timeout=10)
    assert r.status_code == 200 and r.json()["status"] in ("ok", "degraded")


def test_v1_tokenize_aliases(server):
    plain = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
    r = httpx.post(f"{server.base_url}/v1/tokenize", json={"prompt": "Hello world"}, timeout=10)
    assert r.status_code == 200 and r.json()["tokens"] == plain["tokens"]
    r = httpx.post(f"{server.base_url}/v1/detokenize", json={"tokens": plain["tokens"]}, timeout=10)
    assert r.status_code == 200 and r.json()["prompt"] == "Hello world"


def test_unknown_fields_listed_and_logged_once(server, client):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1, "best_of_kvferry_test": 2, "frobnicate": True,
            "bad name\nX-Injected: 1": 1}
    for _ in range(2):
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        assert r.headers["x-unknown-fields"] == "best_of_kvferry_test, frobnicate, <other>"
        assert "x-injected" not in r.headers
    # streamed too, through the openai client (its raw response)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, stream=True,
        extra_body={"frobnicate": 1})
    assert raw.headers["x-unknown-fields"] == "frobnicate"
    for _ in raw.parse():
        pass
    # a known body has none
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1},
                   timeout=60)
    assert "x-unknown-fields" not in r.headers
    log = server.log()
    assert log.count("unknown body field 'best_of_kvferry_test'") == 1
    assert log.count("unknown body field 'frobnicate'") == 1


def test_unknown_fields_on_embeddings(server):
    r = httpx.post(f"{server.base_url}/v1/embeddings", timeout=60,
                   json={"model": MODEL_NAME, "input": "hi", "encoding_format": "float", "truncate_prompt_tokens": 4})
    assert r.status_code == 200 and r.headers["x-unknown-fields"] == "truncate_prompt_tokens"
