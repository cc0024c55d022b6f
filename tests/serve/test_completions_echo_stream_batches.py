"""/v1/completions: echo streamed, several prompts per request (lm-eval's
local-completions batches), and vLLM's --uvicorn-log-level, through the
openai client on one real server of a tiny random checkpoint.

The server runs small steps (--max-num-batched-tokens 32) so that the
prompts are prefilled in several chunks, at --log-level info with the access
log on but --uvicorn-log-level warning: no access line may appear.

Greedy answers are compared between requests that run alone (the same
batches, so the same numbers); echoed prompt logprobs, which do not depend
on sampling, also between a batch of prompts and each prompt alone.
"""
from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from kvferry.cli import main
from tests.serve.server_process import start_server
from tests.tiny_models import make_tiny_checkpoint

MODEL = "tiny"
MAX_MODEL_LEN = 256
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "the cat sat on the mat; the dog sat on the log; they are friends and they play",
    "def main():\n    print('hello')\n    return 0\n",
    "Hello world! How are you today?",
]
SERVE_ARGS = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
              "--max-num-batched-tokens", "32", "--kv-cache-memory-gb", "0.05", "--no-warm-up",
              "--check-kv-integrity", "--log-level", "info", "--uvicorn-log-level", "warning"]
TOL = 1e-4  # float32, batched or not


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tiny = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama")
    srv = start_server(tmp_path_factory.mktemp("log") / "server.log", ["--model", str(tiny)], serve_args=SERVE_ARGS)
    try:
        with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120) as client:
            yield srv, client
    finally:
        code = srv.stop()
    assert code == 0, srv.log()[-3000:]


def _token_ids(srv, text: str) -> list[int]:
    r = httpx.post(f"{srv.base_url}/tokenize", json={"prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _streamed(client, **kwargs) -> tuple[dict[int, dict], object, dict[int, str]]:
    """Per choice index: the concatenated text and logprobs lists, its
    finish_reason; the usage chunk's usage; each choice's first chunk's text."""
    got: dict[int, dict] = {}
    first: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            first.setdefault(c.index, c.text)
            d = got.setdefault(c.index, {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
                                         "text_offset": [], "finish_reason": None})
            d["text"] += c.text
            if c.logprobs is not None:
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    d[key] += getattr(c.logprobs, key)
            if c.finish_reason is not None:
                d["finish_reason"] = c.finish_reason
    return got, usage, first


def _close(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and abs(x - y) < TOL)
                                    for x, y in zip(a, b))


def _same_logprobs(streamed: dict, lp) -> None:
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert _close(streamed["token_logprobs"], lp.token_logprobs), (streamed["token_logprobs"], lp.token_logprobs)
    for s, t in zip(streamed["top_logprobs"], lp.top_logprobs):
        assert (s is None) == (t is None)
        if s is not None:
            assert s.keys() == t.keys() and all(abs(s[k] - t[k]) < TOL for k in s)


# -- echo, streamed -------------------------------------------------------------------

@pytest.mark.parametrize("max_tokens,logprobs,n", [(6, 2, 1), (0, 1, 1), (4, None, 2)])
def test_streamed_echo_is_the_non_streamed_answer(served, max_tokens, logprobs, n):
    srv, client = served
    ids = _token_ids(srv, PROMPTS[0])
    assert len(ids) > 64  # several prefill chunks of 32
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=max_tokens, echo=True, logprobs=logprobs, temperature=0.0, n=n,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    got, usage, first = _streamed(client, **kwargs)
    assert sorted(got) == list(range(n))
    for choice in whole.choices:
        streamed = got[choice.index]
        assert first[choice.index].startswith(PROMPTS[0])  # the prompt comes first, in one chunk
        assert streamed["text"] == choice.text and choice.text.startswith(PROMPTS[0])
        assert streamed["finish_reason"] == choice.finish_reason == "length"
        if logprobs is None:
            assert choice.logprobs is None and streamed["tokens"] == []
            continue
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
        _same_logprobs(streamed, lp)
    assert usage.prompt_tokens == whole.usage.prompt_tokens == len(ids)
    assert usage.completion_tokens == whole.usage.completion_tokens == n * max_tokens


# -- several prompts ---------------------------------------------------------------------

def test_lm_eval_batch_of_token_prompts_matches_each_prompt_alone(served):
    """lm-eval's local-completions loglikelihood batch: token-id prompts,
    echo, logprobs=1, max_tokens=0; choice i is prompt i."""
    srv, client = served
    batch = [_token_ids(srv, p) for p in PROMPTS]
    out = client.completions.create(model=MODEL, prompt=batch, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0.0, seed=1234)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.prompt_tokens == sum(map(len, batch)) and out.usage.completion_tokens == 0
    got, usage, _ = _streamed(client, model=MODEL, prompt=batch, max_tokens=0, echo=True, logprobs=1, temperature=0.0)
    assert sorted(got) == [0, 1, 2] and usage.prompt_tokens == out.usage.prompt_tokens
    for ids, choice in zip(batch, out.choices):
        alone = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                          temperature=0.0).choices[0]
        assert choice.text == alone.text and choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp.tokens == alone.logprobs.tokens and len(lp.tokens) == len(ids)
        assert _close(lp.token_logprobs, alone.logprobs.token_logprobs)
        _same_logprobs(got[choice.index], alone.logprobs)


def test_string_prompts_with_n_number_choices_prompt_major(served):
    srv, client = served
    n, max_tokens = 2, 3
    kwargs = dict(model=MODEL, prompt=PROMPTS[1:], max_tokens=max_tokens, n=n, echo=True, temperature=0.0,
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        assert c.text.startswith(PROMPTS[1 + c.index // n])  # choice prompt_index * n + i
    assert out.usage.prompt_tokens == sum(len(_token_ids(srv, p)) for p in PROMPTS[1:])
    assert out.usage.completion_tokens == 2 * n * max_tokens
    got, usage, _ = _streamed(client, **kwargs)
    assert sorted(got) == [0, 1, 2, 3]
    for c in out.choices:
        assert got[c.index]["text"].startswith(PROMPTS[1 + c.index // n])
        assert got[c.index]["finish_reason"] == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (out.usage.prompt_tokens, out.usage.completion_tokens)
    # A single token-id list is one prompt; a list of one string too.
    ids = _token_ids(srv, PROMPTS[2])
    assert len(client.completions.create(model=MODEL, prompt=ids, max_tokens=1).choices) == 1
    assert len(client.completions.create(model=MODEL, prompt=[PROMPTS[2]], max_tokens=1).choices) == 1


def _aborted_sequences(srv) -> float:
    return sum(v for (name, labels), v in srv.metrics().items()
               if name.startswith("kvferry:request_success") and ("finished_reason", "abort") in labels)


def test_a_client_leaving_a_streamed_batch_aborts_every_prompt(served):
    srv, _ = served
    before = _aborted_sequences(srv)
    body = {"model": MODEL, "prompt": ["Hello", "world", "again"], "max_tokens": 200, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    with httpx.stream("POST", f"{srv.api_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk, then the client leaves
    deadline = time.monotonic() + 30
    while _aborted_sequences(srv) - before < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _aborted_sequences(srv) - before == 3  # 200 tokens each: none had finished


def _finished_sequences(srv) -> float:
    return sum(v for (name, _), v in srv.metrics().items() if name.startswith("kvferry:request_success"))


@pytest.mark.parametrize("body,fragment", [
    ({"prompt": []}, "must not be empty"),
    ({"prompt": ["fine", ""]}, "prompt[1] must not be empty"),
    ({"prompt": [[1, 2], []]}, "prompt[1] must not be empty"),
    ({"prompt": [[1, 2], [3, 10**9]]}, "prompt[1]: token id 1000000000 is outside the vocabulary"),
    ({"prompt": ["fine", "word " * 400]}, "prompt[1]: This model's maximum context length"),
    ({"prompt": ["a"] * 2049}, "at most 2048"),
    ({"prompt": ["a"] * 17, "n": 128}, "17 prompts and n is 128"),
])
def test_a_bad_prompt_fails_the_whole_request_before_any_runs(served, body, fragment):
    srv, _ = served
    before = _finished_sequences(srv)
    r = httpx.post(f"{srv.api_url}/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and fragment in error["message"], error
    assert _finished_sequences(srv) == before  # none started, none aborted


# -- --uvicorn-log-level ----------------------------------------------------------------

def test_uvicorn_log_level_warning_leaves_no_access_line(served):
    srv, client = served
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
    assert httpx.get(f"{srv.api_url}/models", timeout=10).status_code == 200
    log = srv.log()
    # The access log is on (no --disable-uvicorn-access-log; at uvicorn's info level it logs each request:
    # test_operator_logs.py) but uvicorn's loggers are at warning: not one request line, nor uvicorn's
    # own start-up lines at info.
    assert "HTTP/1.1" not in log and "Application startup complete" not in log, log[-3000:]
    # kvferry's own loggers stay at --log-level info.
    assert re.search(r" INFO .*kvferry\.engine\.core: engine core ready", log), log[-3000:]
    assert "--uvicorn-log-level warning: uvicorn's loggers log at warning" in log


def test_uvicorn_log_level_bad_value_is_one_line_naming_the_flag(capsys):
    try:
        code = main(["serve", "--uvicorn-log-level", "loud"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "--uvicorn-log-level" in errors[0] and "loud" in errors[0], err
