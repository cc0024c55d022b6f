"""``kvferry serve --kv-dram-gb``: the server starts the node's KV store, a
paused conversation resumes from it after the device pool was flushed, and
the tiers show in /metrics and /v1/kv/stats. Real server, real store
process, real ``openai`` client."""
from __future__ import annotations

import os
import subprocess
import time

import httpx
import openai
import pytest

from tests.serve.server_process import MODEL_NAME, start_server

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
