"""``kvferry serve --kv-dram-gb``: the server starts the node's KV store, a
paused conversation resumes from it after the device pool was flushed, and
the tiers show in /metrics and /v1/kv/stats, and a killed store costs a
request a recompute, not a wait. Real server, real store process, real
``openai`` client."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from tests.serve.server_process import MODEL_NAME, start_server
from tests.serve.test_kv_tier_reliability import FLUSH_PROMPT, _cached, _complete, _kvstore_pid

BLOCK = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A device pool of 24 blocks of 16 tokens: a few other prompts flush it.
    srv = start_server(tmp_path_factory.mktemp("tiers") / "server.log",
                       ["--kv-dram-gb", "0.1", "--num-kv-blocks", "24", "--block-size", str(BLOCK)])
    yield srv
    children = _children(srv.proc.pid)
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"
    # The store (a child of the server) goes with it.
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children), "a child of the server outlived it"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose (its parent has not reaped it yet).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_paused_conversation_resumes_from_the_store(server):
    client = openai.OpenAI(base_url=server.api_url, api_key="x")
    messages = [{"role": "user", "content": "Name three colours of the rainbow and say why the sky is blue."}]
    turn1 = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0,
                                           extra_body={"kv_retention_s": 120})
    # Flush the device pool with other conversations.
    for i in range(3):
        client.completions.create(model=MODEL_NAME, prompt=f"{i} " + "lorem ipsum dolor sit amet " * 30,
                                  max_tokens=2, temperature=0)
    messages += [{"role": "assistant", "content": turn1.choices[0].message.content},
                 {"role": "user", "content": "And why are sunsets red?"}]
    loaded_before = server.metric("kvferry:kv_store_loaded_tokens_total")
    turn2 = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    # At least turn 1's whole prompt came back from the store (the reply
    # too, where its text re-tokenizes to the same ids).
    assert cached >= turn1.usage.prompt_tokens // BLOCK * BLOCK
    assert server.metric("kvferry:kv_store_loaded_tokens_total") - loaded_before >= cached
    assert server.wait_for_metric("kvferry:kv_tier_hits_total", lambda v: v > 0, tier="dram") > 0
    stats = httpx.get(f"{server.base_url}/v1/kv/stats", timeout=10).json()
    dram = next(iter(stats["tenants"].values()))["kv_tiers"]["dram"]
    assert dram["hits"] > 0 and 0 < dram["hit_rate"] <= 1


@pytest.mark.parametrize("value", [-1, 1e9, "soon", None])
def test_bad_kv_retention_is_a_400_naming_the_field(server, value):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "kv_retention_s": value}
    response = httpx.post(f"{server.api_url}/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "kv_retention_s" in (error.get("param") or "") + error["message"]
    # Still serving.
    ok = httpx.post(f"{server.api_url}/completions", json={**body, "kv_retention_s": 5}, timeout=60)
    assert ok.status_code == 200


def _wait_dead(pid: int, timeout_s: float = 10.0) -> None:
    """Until ``pid`` is gone or a zombie (its parent, the server, reaps it
    only at shutdown)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError):  # reaped between the open and the read
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} outlived SIGKILL")


def _stream(client: openai.OpenAI, prompt: str, max_tokens: int = 8) -> tuple[float, float, str]:
    """(seconds to the first token, seconds in all, text) of a streamed greedy completion."""
    start = time.monotonic()
    first, text = None, ""
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].text:
            first = first if first is not None else time.monotonic() - start
            text += chunk.choices[0].text
    assert first is not None, "no token came back"
    return first, time.monotonic() - start, text


# ~100 tokens (6 blocks): short, so that its recompute is quick and steady
# next to the 1 s a dead store used to cost.
SHORT_PROMPT = "The lighthouse keeper wrote in his log every night about ships, storms and gulls. " * 6


# Last in this module: it kills the module server's store (the server
# serves on with its tiers off; the fixture still checks its exit code and
# that no child outlives it), so it shares that server instead of starting
# one of the same flags.
def test_a_killed_store_costs_a_request_no_wait_and_the_server_keeps_serving(server):
    srv = server
    # A device pool of 24 blocks: one flush prompt (22 blocks) evicts the rest.
    client = openai.OpenAI(base_url=srv.api_url, api_key="x", max_retries=0)
    flush = FLUSH_PROMPT[: len(FLUSH_PROMPT) * 9 // 10]
    expected = _complete(client, SHORT_PROMPT).choices[0].text
    _complete(client, flush, max_tokens=2)
    # The request would load: its blocks are in the store, not on the device.
    loaded = _complete(client, SHORT_PROMPT)
    assert _cached(loaded) >= 5 * BLOCK and loaded.choices[0].text == expected
    _complete(client, "0 " + flush, max_tokens=2)
    # What the same work costs with no hit at all (the store up, missing).
    baseline = max(_stream(client, f"{i} " + SHORT_PROMPT)[0] for i in range(2))

    store = _kvstore_pid(srv.proc.pid)
    os.kill(store, signal.SIGKILL)
    _wait_dead(store)
    ttft, total, text = _stream(client, SHORT_PROMPT)
    assert text == expected  # recomputed: the same greedy text
    # The dead store is noticed at once (its end of the socket closed),
    # not after the client's 1 s call timeout on the step's path.
    assert ttft < baseline + 0.6, (ttft, baseline)
    assert total < 6.0
    # The server keeps serving, tiers off.
    again = _complete(client, "1 " + flush, max_tokens=2)
    assert again.choices[0].finish_reason == "length"
    assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200
