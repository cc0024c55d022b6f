"""What one tenant could learn or spoil of another's through the API (the
probe of issue 45), against the shared tenant server: stored responses
and public-prefix declarations."""
from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.tenants.conftest import BLOCK_SIZE, make_client

MODEL = "SmolLM2-135M-Instruct"


def _respond(server, key: str, request_id: str, **body) -> httpx.Response:
    return httpx.post(f"{server.api_url}/responses", json={"model": MODEL, "max_output_tokens": 2, **body},
                      headers={"Authorization": f"Bearer {key}", "X-Request-Id": request_id}, timeout=120)


def test_another_tenant_cannot_replace_or_read_a_stored_response(tenant_server):
    """Tenant B posting with A's X-Request-Id used to land on A's stored
    response (its id was resp_<X-Request-Id>) and replace it: A's GET and
    previous_response_id then said 404."""
    request_id = f"shared-{uuid.uuid4().hex[:8]}"
    a = _respond(tenant_server, "sk-acme-1", request_id, input="Say hi.")
    assert a.status_code == 200, a.text
    assert a.headers["x-request-id"] == request_id  # still the request's trace id, echoed
    b = _respond(tenant_server, "sk-beta-1", request_id, input="Say bye.")
    assert b.status_code == 200, b.text
    a_id, b_id = a.json()["id"], b.json()["id"]
    assert a_id != b_id and a_id.startswith("resp_") and request_id not in a_id  # the server's own ids
    with make_client(tenant_server, "sk-acme-1") as acme, make_client(tenant_server, "sk-beta-1") as beta:
        assert acme.responses.retrieve(a_id).output_text == a.json()["output"][0]["content"][0]["text"]
        follow = acme.responses.create(model=MODEL, input="Again.", max_output_tokens=2, previous_response_id=a_id)
        assert follow.previous_response_id == a_id
        # B can neither read, continue nor delete A's, even knowing its id.
        for attempt in (lambda: beta.responses.retrieve(a_id), lambda: beta.responses.delete(a_id),
                        lambda: beta.responses.create(model=MODEL, input="x", max_output_tokens=2,
                                                      previous_response_id=a_id)):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert acme.responses.retrieve(a_id).id == a_id
        with pytest.raises(openai.NotFoundError):
            acme.responses.retrieve(b_id)  # and the other way round
        assert beta.responses.retrieve(b_id).id == b_id


def _declare(server, key: str, prefix) -> dict:
    r = httpx.post(f"{server.base_url}/v1/kv/public_prefixes", json={"prefix": prefix},
                   headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _mine(server, key: str) -> set[str]:
    r = httpx.get(f"{server.base_url}/v1/kv/public_prefixes", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return {d["id"] for d in r.json()["data"]}


def test_a_publisher_learns_nothing_of_another_publishers_declaration(tenant_server):
    """delta declaring a prefix acme already declared used to get acme's id
    with "new": false. Now the answer is the same as for a fresh prefix."""
    # Ends in a newline: the prompts below then begin with its tokens.
    text = f"You are the archivist of the {uuid.uuid4().hex} collection." + " Answer in one line." * 8 + "\n"
    fresh = f"You are the archivist of the {uuid.uuid4().hex} collection." + " Answer in one line." * 8 + "\n"
    acme = _declare(tenant_server, "sk-acme-1", text)
    before = _declare(tenant_server, "sk-delta-1", fresh)  # what delta sees for a prefix nobody declared
    seen = _declare(tenant_server, "sk-delta-1", text)  # and for acme's
    try:
        assert acme["new"] and before["new"] and seen["new"]
        assert seen["id"] != acme["id"]
        assert seen["num_public_prefixes"] == before["num_public_prefixes"] + 1  # delta's own count
        assert _declare(tenant_server, "sk-delta-1", text)["new"] is False  # its own earlier declaration
        assert seen["id"] in _mine(tenant_server, "sk-delta-1") and acme["id"] not in _mine(tenant_server,
                                                                                             "sk-delta-1")
        # Each deletes its own; the prefix stays public while the other holds it.
        r = httpx.delete(f"{tenant_server.base_url}/v1/kv/public_prefixes/{acme['id']}",
                         headers={"Authorization": "Bearer sk-delta-1"})
        assert r.status_code == 404
        r = httpx.delete(f"{tenant_server.base_url}/v1/kv/public_prefixes/{acme['id']}",
                         headers={"Authorization": "Bearer sk-acme-1"}, timeout=120)
        assert r.status_code == 200, r.text
        with make_client(tenant_server, "sk-beta-1") as beta:
            first = beta.completions.create(model=MODEL, prompt=text + uuid.uuid4().hex, max_tokens=1)
            assert first.usage.prompt_tokens_details.cached_tokens == seen["num_blocks"] * BLOCK_SIZE > 0
    finally:
        for pid in (seen["id"], before["id"]):
            httpx.delete(f"{tenant_server.base_url}/v1/kv/public_prefixes/{pid}",
                         headers={"Authorization": "Bearer sk-delta-1"}, timeout=120)
