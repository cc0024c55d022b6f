"""Fixtures for the server tests: one real server for the session."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.serve.server_process import ServerProcess, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> ServerProcess:
    # For iterating on tests: KVFERRY_TEST_SERVER=http://127.0.0.1:PORT reuses
    # a server started by hand with SERVE_ARGS (it is left running).
    if url := os.environ.get("KVFERRY_TEST_SERVER"):
        yield ServerProcess(None, url.rstrip("/"), Path(os.devnull))
        return
    srv = start_server(tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"


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
