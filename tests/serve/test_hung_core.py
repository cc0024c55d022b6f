"""A hung engine core, through a real server and real signals: a core
stopped with SIGSTOP misses its heartbeat deadline, /health names it, its
stream ends with an error, it is killed and restarted, and a request sent
meanwhile is served by the new core. A long but healthy step (the core's
input thread answers hellos while the step thread computes) must not trip
the same deadline."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve.server_process import MODEL_NAME, ServerProcess, start_server

HEARTBEAT_S = 3.0
# Detection takes the deadline plus one hello interval; the margin is for a
# loaded 2-core machine (the test suite's, shared).
MARGIN_S = 15.0
LONG_PROMPT_TOKENS = 2000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("hung") / "server.log", [
        "--engine-heartbeat-timeout", str(HEARTBEAT_S), "--health-check-interval", "0.5",
        # Room for one long prefill step (the whole prompt in one step).
        "--max-model-len", "2048", "--max-num-batched-tokens", "2048"])
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300)


def _worker(srv: ServerProcess) -> dict:
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=10)
    assert r.status_code == 200, r.text
    [worker] = r.json()["data"]
    return worker


def _state(pid: int) -> str | None:
    """The process's state letter (T: stopped, Z: zombie), None once reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _ends_with(client: openai.OpenAI, prompt: str) -> tuple[str, float]:
    """The error a request ends with, and when (it must not succeed)."""
    start = time.monotonic()
    try:
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
    except openai.APIError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("a request on the stopped core succeeded")


def test_a_long_healthy_step_does_not_miss_the_heartbeat(server):
    before = _worker(server)
    with _client(server) as c:
        start = time.monotonic()
        out = c.completions.create(model=MODEL_NAME, prompt=[100 + i % 5000 for i in range(LONG_PROMPT_TOKENS)],
                                   max_tokens=2, temperature=0)
        elapsed = time.monotonic() - start
    assert out.choices[0].finish_reason == "length"
    after = _worker(server)
    assert after["alive"] and after["pid"] == before["pid"] and after["num_restarts"] == 0, server.log()[-3000:]
    assert httpx.get(f"{server.base_url}/health", timeout=10).json() == {"status": "ok"}
    if elapsed < HEARTBEAT_S:
        pytest.skip(f"this CPU ran the {LONG_PROMPT_TOKENS}-token step in {elapsed:.1f} s: shorter than the test needs")


def test_a_stopped_core_is_reported_ended_killed_and_restarted(server):
    """Runs last on this server: it stops the core, which is restarted."""
    with _client(server) as c:
        stream = c.completions.create(model=MODEL_NAME, prompt="Tell me a very long story:", max_tokens=1000,
                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)  # it runs
        old = _worker(server)
        pid = old["pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        pool = ThreadPoolExecutor(1)
        try:
            # A request that arrives before the hang is noticed goes to the
            # stopped core: it ends with the error too, it does not wait on.
            late = pool.submit(_ends_with, c, "The capital of France is")
            # /health stops saying ok, and names the core and why.
            while (health := httpx.get(f"{server.base_url}/health", timeout=10)).status_code == 200:
                assert time.monotonic() - stopped_at < HEARTBEAT_S + MARGIN_S, health.text
                time.sleep(0.1)
            assert time.monotonic() - stopped_at < HEARTBEAT_S + MARGIN_S
            assert health.status_code == 503
            body = health.json()["error"]
            assert body["code"] == "engine_restarting"
            assert "engine-0" in body["message"] and "missed its heartbeat" in body["message"], body
            # Its stream ends with that error, not a hang.
            with pytest.raises(openai.APIError, match="missed its heartbeat"):
                for _ in chunks:
                    pass
            assert time.monotonic() - stopped_at < HEARTBEAT_S + 2 * MARGIN_S
            error, elapsed = late.result(timeout=HEARTBEAT_S + 2 * MARGIN_S)
            assert "missed its heartbeat" in error and elapsed < HEARTBEAT_S + 2 * MARGIN_S, (error, elapsed)
            # The stopped process was killed (SIGKILL reaches a stopped process).
            deadline = time.monotonic() + 30
            while _state(pid) not in (None, "Z"):
                assert time.monotonic() < deadline, f"pid {pid} still {_state(pid)}"
                time.sleep(0.1)
            # A request sent while the core restarts waits for the new one.
            out = c.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=8,
                                       temperature=0)
            assert out.choices[0].finish_reason == "length" and out.choices[0].text
        finally:
            if _state(pid) == "T":
                os.kill(pid, signal.SIGCONT)
            pool.shutdown()
    new = _worker(server)
    assert new["alive"] and new["pid"] != pid and new["num_restarts"] == 1, new
    assert httpx.get(f"{server.base_url}/health", timeout=10).json() == {"status": "ok"}
    assert f"engine core engine-0 (pid {pid}) missed its heartbeat" in server.log()
