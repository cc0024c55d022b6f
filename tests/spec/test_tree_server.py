"""Draft trees on a real server (``kvferry serve --speculative-config
'{"method": "suffix", "draft_tree": true, ...}'``, the real openai client):
greedy text is plain decoding's for a batch of two requests drafting
trees side by side, and drafts are accepted; a bad ``draft_tree`` is
refused at start with the field named.

k is fixed (no adaptive or cost-aware controller) so that the step really
drafts trees of k tokens whatever the machine's timings."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvferry import LLM, SamplingParams
from tests.serve.server_process import MAX_MODEL_LEN, MODEL_NAME, start_server

SPEC = {"method": "suffix", "num_speculative_tokens": 8, "draft_tree": True, "adaptive": False, "cost_aware": False}
CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n\n\ndef scale(width, height, factor):\n    return width * factor, height * factor\n")
PROMPTS = [f"Here is my file:\n\n{CODE}\nRepeat the file exactly, then rename `area` to `rect_area`.\n\n{CODE}",
           f"{CODE}\n# The same file, with `scale` renamed to `resize`:\n\n"]
MAX_TOKENS = 24
ACCEPTED = "kvferry:spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server, and plain decoding's text of PROMPTS (computed here while
    the server starts: its start is mostly one process's imports)."""
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start_server, tmp_path_factory.mktemp("tree-server") / "server.log",
                               ["--speculative-config", json.dumps(SPEC)])
        try:
            plain = _plain()
        except BaseException:
            if starting.exception() is None:  # no server left behind
                starting.result().stop()
            raise
        srv = starting.result()
    yield srv, plain
    assert srv.stop() == 0, srv.log()[-5000:]


def _plain() -> list[str]:
    # No warm-up: its full-size prefill costs more than this whole reference.
    llm = LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, warm_up=False)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return [o.text for o in llm.generate(PROMPTS, params)]
    finally:
        llm.engine.core.close()


def complete(srv, prompt: str) -> str:
    with openai.OpenAI(base_url=srv.api_url, api_key="x", max_retries=0, timeout=300) as client:
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_TOKENS
    return r.choices[0].text


def test_tree_drafts_keep_greedy_text_batched(server):
    server, plain = server
    before = server.metric(ACCEPTED)
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda p: complete(server, p), PROMPTS)) == plain
    assert server.metric(ACCEPTED) - before >= MAX_TOKENS // 2


def test_a_bad_draft_tree_is_refused_by_name():
    spec = json.dumps({"method": "ngram", "draft_tree": True})
    done = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", "--speculative-config", spec],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "draft_tree" in done.stderr, done.stderr[-2000:]
