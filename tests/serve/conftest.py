"""Fixtures for the server tests: one real server for the session (``default_server``)."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.server_process import ServerProcess


@pytest.fixture(scope="session")
def server(default_server) -> ServerProcess:
    return default_server  # tests/conftest.py: shared with the bench tests and the docs' examples


@pytest.fixture(scope="session")
def client(server):
    import openai

    with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def healthy(server):
    """Asserts after the test that the engine loop is still alive (with
    --check-kv-integrity a broken KV invariant kills it, and /health says 503)."""
    yield
    r = httpx.get(f"{server.base_url}/health", timeout=10)
    assert r.status_code == 200, f"{r.text}\n{server.log()[-5000:]}"
