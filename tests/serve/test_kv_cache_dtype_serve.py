"""``kvferry serve --kv-cache-dtype fp8``: the core stores K/V in float8, the
pool holds four times a float32 pool's blocks in the same memory, and the
server answers through the real openai client."""
from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from tests.serve.server_process import MODEL_NAME, SERVE_ARGS, start_server


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("fp8") / "server.log", ["--kv-cache-dtype", "fp8"])
    yield srv
    assert srv.stop() == 0, srv.log()[-5000:]


def test_fp8_server_answers_and_holds_four_times_the_blocks(fp8_server, server, client):
    with openai.OpenAI(base_url=fp8_server.api_url, api_key="unused", max_retries=0, timeout=120) as fp8:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = fp8.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
        exact = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
        assert r.choices[0].message.content and 0 < r.usage.completion_tokens <= 16
        # The first tokens of a short answer survive the rounding.
        assert r.choices[0].message.content.split()[:2] == exact.choices[0].message.content.split()[:2]
        stream = fp8.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices)
    # Both servers get --kv-cache-memory-gb from SERVE_ARGS: float32 elements
    # are four bytes, fp8's one.
    assert fp8_server.metric("kvferry:kv_blocks_total") == pytest.approx(4 * server.metric("kvferry:kv_blocks_total"),
                                                                        abs=4)


def test_a_bad_kv_cache_dtype_names_the_flag(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", *SERVE_ARGS, "--kv-cache-dtype", "int4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--kv-cache-dtype" in proc.stderr and "int4" in proc.stderr
