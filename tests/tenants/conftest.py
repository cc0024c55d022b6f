"""One real server with API keys and a public prefix for the tenant tests."""
from __future__ import annotations

import json

import openai
import pytest

from tests.serve.server_process import ServerProcess, start_server

BLOCK_SIZE = 16
KEYS = {
    "sk-acme-1": {"tenant": "acme", "publish": True},
    "sk-acme-2": {"tenant": "acme"},
    "sk-beta-1": {"tenant": "beta", "quota": {"device_blocks": 100}},
    "sk-root": {"tenant": "ops", "admin": True},
    "sk-tiny-1": {"tenant": "tiny", "quota": {"device_blocks": 2}},
    "sk-delta-1": {"tenant": "delta", "publish": True},  # a second publisher
}
# Ends in a newline so the next word starts a new token (byte-level BPE
# never merges across it).
PUBLIC_TEXT = ("You are the support assistant of Example Corp. Answer briefly, politely and only about "
               "our products: routers, switches, cables and the warranty that covers them. Never "
               "invent prices; point to the price list instead. Refuse anything unrelated.\n")


@pytest.fixture(scope="session")
def tenant_server(tmp_path_factory) -> ServerProcess:
    d = tmp_path_factory.mktemp("tenants")
    (d / "keys.json").write_text(json.dumps(KEYS))
    (d / "secret").write_bytes(b"0123456789abcdef0123456789abcdef")
    (d / "public.json").write_text(json.dumps([PUBLIC_TEXT]))
    srv = start_server(d / "server.log", ["--api-keys", str(d / "keys.json"), "--cache-secret-file", str(d / "secret"),
                                          "--public-prefixes", str(d / "public.json"),
                                          "--block-size", str(BLOCK_SIZE)])
    srv.keys_path = d / "keys.json"
    srv.metrics_key = "sk-root"  # /metrics is an admin key's
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"


def make_client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def acme(tenant_server):
    with make_client(tenant_server, "sk-acme-1") as c:
        yield c


@pytest.fixture(scope="session")
def acme2(tenant_server):
    with make_client(tenant_server, "sk-acme-2") as c:
        yield c


@pytest.fixture(scope="session")
def beta(tenant_server):
    with make_client(tenant_server, "sk-beta-1") as c:
        yield c
