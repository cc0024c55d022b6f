"""A client that goes away aborts its request and frees its KV blocks."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.serve.server_process import MODEL_NAME

pytestmark = pytest.mark.usefixtures("healthy")

BLOCKS = "kvferry:kv_blocks_used"
RUNNING = "kvferry:num_requests_running"
# Long enough that, unaborted, the request would run for minutes.
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}


def _wait_idle(server, timeout_s: float = 30.0) -> None:
    assert server.wait_for_metric(BLOCKS, lambda v: v == 0, timeout_s) == 0
    assert server.metric(RUNNING) == 0


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_disconnect_frees_blocks(server, endpoint):
    _wait_idle(server)
    aborts_before = server.metric("kvferry:request_success_total", finished_reason="abort")
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story."}]}
    else:
        path, body = "/v1/completions", {"prompt": "Once upon a time"}
    body.update(model=MODEL_NAME, stream=True, **LONG)
    start = time.monotonic()
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.base_url + path, json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 2:
                        # Checked inside the loop: leaving it closes the
                        # iterator, and httpx then drops the connection.
                        assert server.metric(BLOCKS) > 0  # the request holds blocks while it runs
                    if events == 3:
                        break
        # Leaving the blocks closes the response and the connection.
    _wait_idle(server, timeout_s=20)
    assert time.monotonic() - start < 60  # far less than 900 tokens would take
    assert server.metric("kvferry:request_success_total", finished_reason="abort") == aborts_before + 1


def test_non_stream_disconnect_frees_blocks(server):
    _wait_idle(server)
    body = {"model": MODEL_NAME, "prompt": "Write an essay about the sea.", **LONG}
    with pytest.raises(httpx.ReadTimeout):
        # The client gives up after 2 s without reading a byte.
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=2.0))
    _wait_idle(server, timeout_s=20)


def test_disconnect_during_long_prefill(server):
    """A client that leaves before its first token (mid-prefill)."""
    _wait_idle(server)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.base_url + "/v1/completions",
                         json={"model": MODEL_NAME, "prompt": "word " * 900, "max_tokens": 2, "stream": True}):
            pass  # headers only, then gone
    _wait_idle(server, timeout_s=60)
