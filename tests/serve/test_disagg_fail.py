"""``kvferry serve --mode disagg --kv-transfer-failure fail`` through real
processes, real HTTP and real signals: a transfer that never completes (the
prefill core frozen with SIGSTOP) ends the request with a clear
OpenAI-style error, a 503 body or an in-band SSE error event, within the
lease and without a hang; the server keeps serving the same greedy text as
a colocated one, and every core's pool goes back to idle. A killed decode
core (the only one) makes /health a 503 until it is restarted."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.serve.server_process import MODEL_NAME, start_server
from tests.serve.test_router import PROMPTS, _client, _greedy, _workers

LEASE_S = 3


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("disagg-fail") / "server.log",
                       ["--mode", "disagg", "--prefill", "1", "--decode", "1",
                        "--kv-transfer-failure", "fail", "--kv-transfer-timeout-s", str(LEASE_S),
                        # Frozen prefill cores stand for stuck transfers here, not hangs.
                        "--engine-heartbeat-timeout", "120"])
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"


class Frozen:
    """The prefill cores stopped (SIGSTOP) inside the block, resumed after."""

    def __init__(self, srv) -> None:
        self.pids = [w["pid"] for w in _workers(srv).values() if w["role"] == "prefill"]

    def __enter__(self) -> "Frozen":
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        for pid in self.pids:
            os.kill(pid, signal.SIGCONT)


def _body(prompt: str, stream: bool) -> dict:
    return dict(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, stream=stream)


def _assert_idle(srv, timeout_s: float = 30.0) -> None:
    """No request, queued prefill or KV block held on any core."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = _workers(srv)
        busy = {n: w for n, w in workers.items()
                if w["num_requests"] or w["queued_prefill_tokens"] or w["num_running"] or w["num_waiting"]
                or w["kv_blocks_used"]}
        if not busy:
            return
        assert time.monotonic() < deadline, f"not idle: {busy}"
        time.sleep(0.2)


def test_failed_transfer_is_a_clear_error_then_the_server_serves_on(failing, client):
    expected = _greedy(client, PROMPTS[0], max_tokens=8)
    with _client(failing) as c:
        assert _greedy(c, PROMPTS[0], max_tokens=8) == expected  # the pair works before the fault

    # 1. Not streamed: the lease runs out on the decode core, which is told
    # to fail; the client gets a 503 whose body names the transfer.
    with Frozen(failing):
        t0 = time.monotonic()
        r = httpx.post(f"{failing.api_url}/completions", json=_body(PROMPTS[1], stream=False), timeout=60)
        elapsed = time.monotonic() - t0
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "kv_transfer_failed"
    assert "KV transfer failed" in error["message"] and "timeout" in error["message"]
    assert LEASE_S - 0.5 < elapsed < LEASE_S + 20  # the lease, not a hang

    # 2. Streamed: the headers went out at once, so the error comes in-band,
    # as one SSE error event, then [DONE]; no token was streamed.
    with Frozen(failing):
        events = []
        with httpx.stream("POST", f"{failing.api_url}/completions", json=_body(PROMPTS[2], stream=True),
                          timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert [p["error"]["code"] for p in payloads if "error" in p] == ["kv_transfer_failed"]
    assert not any(ch.get("text") for p in payloads for ch in p.get("choices", []))

    # 3. The prefill core comes back: its stale transfers are refused and
    # freed, and the same server answers as a colocated one would.
    with _client(failing) as c:
        for prompt in PROMPTS[:3]:
            assert _greedy(c, prompt, max_tokens=8) == _greedy(client, prompt, max_tokens=8)
    assert httpx.get(f"{failing.base_url}/health", timeout=10).json()["status"] == "ok"
    _assert_idle(failing)


def test_no_decode_core_is_503_until_it_is_restarted(failing, client):
    """The only decode core killed: no request can get through, so /health
    is a 503 (not 200 "degraded") while it restarts; a new request waits for
    the restarted core, which serves the same greedy text."""
    victim = _workers(failing)["decode-0"]
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (health := httpx.get(f"{failing.base_url}/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, health.text  # the sentinel reports the death within a second
        time.sleep(0.05)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_restarting", health.text
    assert "decode-0" in health.json()["error"]["message"]
    r = httpx.post(f"{failing.api_url}/completions", json=_body(PROMPTS[0], stream=False), timeout=150)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _greedy(client, PROMPTS[0], max_tokens=8)
    deadline = time.monotonic() + 120
    while (health := httpx.get(f"{failing.base_url}/health", timeout=10)).status_code != 200:
        assert time.monotonic() < deadline, failing.log()[-3000:]
        time.sleep(0.1)
    assert health.json()["status"] == "ok"
    workers = _workers(failing)
    assert workers["decode-0"]["alive"] and workers["decode-0"]["pid"] != victim["pid"], workers
    assert workers["decode-0"]["num_restarts"] == 1
    with _client(failing) as c:
        assert _greedy(c, PROMPTS[1], max_tokens=8) == _greedy(client, PROMPTS[1], max_tokens=8)
    _assert_idle(failing)
