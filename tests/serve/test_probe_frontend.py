"""The front end's findings of the issue 45 probe, each sent as the probe
sent it to the session server: long bodies that stalled the event loop,
prompt_logprobs ignored, a 9.5 MB body answered with a reset, a worker
address of any file, and a grammar library's build path in an error."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve.server_process import MAX_MODEL_LEN, MODEL_NAME

pytestmark = pytest.mark.usefixtures("healthy")

# Just under the default 2 MiB body limit, as the probe's bodies were.
LONG_TEXT = ("lorem ipsum dolor sit amet " * 80000)[:1_900_000]


def _post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                      timeout=timeout)


# ---- tokenization and the event loop ------------------------------------------------

def test_long_bodies_leave_health_responsive(server):
    """Four 1.9 MiB bodies at once (tokenize and chat) used to stall /health
    for seconds: tokenization held the GIL. Now such text is refused from
    its length alone, at once, and /health keeps answering."""
    bodies = [(f"{server.base_url}/tokenize", {"model": MODEL_NAME, "prompt": LONG_TEXT}),
              (f"{server.api_url}/chat/completions",
               {"model": MODEL_NAME, "messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 1}),
              (f"{server.api_url}/completions", {"model": MODEL_NAME, "prompt": LONG_TEXT, "max_tokens": 1}),
              (f"{server.base_url}/tokenize",
               {"model": MODEL_NAME, "messages": [{"role": "user", "content": LONG_TEXT}]})]
    latencies: list[float] = []
    statuses: set[int] = set()
    done = threading.Event()

    def poll_health() -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as c:
            while not done.is_set():
                start = time.perf_counter()
                statuses.add(c.get("/health").status_code)
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        time.sleep(0.3)
        with ThreadPoolExecutor(4) as pool:
            for _ in range(2):
                answers = list(pool.map(lambda ub: _post(*ub), bodies))
                for (url, _), r in zip(bodies, answers):
                    assert r.status_code == 400, (url, r.text[:300])
                    error = r.json()["error"]
                    assert error["param"] in ("prompt", "messages") and "characters" in error["message"], error
        time.sleep(0.3)
    finally:
        done.set()
        poller.join()
    assert statuses == {200} and len(latencies) > 5 and max(latencies) < 1.0, sorted(latencies)[-5:]


def test_an_over_long_prompt_is_refused_fast_naming_the_field(server):
    start = time.perf_counter()
    r = _post(f"{server.api_url}/completions", {"model": MODEL_NAME, "prompt": LONG_TEXT, "max_tokens": 1})
    elapsed = time.perf_counter() - start
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in r.json()["error"]["message"]
    assert elapsed < 2.0, elapsed  # encoding it took 3-4 s
    # A list of prompts names the one that is too long.
    r = _post(f"{server.api_url}/completions", {"model": MODEL_NAME, "prompt": ["Hi", LONG_TEXT], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt[1]: "), r.text
    r = _post(f"{server.api_url}/embeddings", {"model": MODEL_NAME, "input": LONG_TEXT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_the_character_bound_is_the_longest_token_times_the_context(server):
    """The bound refuses only text that cannot fit: max_model_len tokens of
    the longest entry of the vocabulary (in characters) and no more."""
    from kvferry.model.gguf_convert import convert_gguf, embedded_gguf_path
    from kvferry.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(convert_gguf(embedded_gguf_path()))
    longest = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
    bound = tokenizer.max_prompt_chars(MAX_MODEL_LEN)
    assert bound == MAX_MODEL_LEN * longest
    r = _post(f"{server.base_url}/tokenize", {"model": MODEL_NAME, "prompt": "a" * bound})
    assert r.status_code == 200, r.text  # encoded (and counted), not refused
    r = _post(f"{server.base_url}/tokenize", {"model": MODEL_NAME, "prompt": "a" * (bound + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_encoding_a_long_text_on_a_thread_leaves_the_gil_to_others():
    """Tokenization runs on a worker thread; it must not hold the GIL for
    its whole length (the tokenizer's plain encode did, for 3 s)."""
    from kvferry.model.gguf_convert import convert_gguf, embedded_gguf_path
    from kvferry.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(convert_gguf(embedded_gguf_path()))
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        start = time.perf_counter()
        encoder = threading.Thread(target=lambda: tokenizer.encode(LONG_TEXT))
        encoder.start()
        encoder.join()
        took = time.perf_counter() - start
        chat = threading.Thread(target=lambda: tokenizer.encode_chat([{"role": "user", "content": LONG_TEXT}]))
        chat.start()
        chat.join()
    finally:
        done.set()
        ticker.join()
    assert took > 0.2 and max(gaps) < 0.5 * took and max(gaps) < 0.5, (took, max(gaps))


# ---- prompt_logprobs -------------------------------------------------------------------

def test_prompt_logprobs_match_the_echo_path(server):
    prompt = "The capital of France is Paris, and the capital of Italy is"
    r = _post(f"{server.api_url}/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2,
                                                "temperature": 0, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == r.json()["usage"]["prompt_tokens"] and entries[0] is None
    echo = _post(f"{server.api_url}/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1,
                                                   "temperature": 0, "echo": True, "logprobs": 3}).json()
    logprobs = echo["choices"][0]["logprobs"]
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert len(ids) == len(entries)
    for k in range(1, len(ids)):
        entry = entries[k]
        mine = entry[str(ids[k])]
        assert mine["logprob"] == pytest.approx(logprobs["token_logprobs"][k], abs=1e-4)
        assert mine["decoded_token"] == logprobs["tokens"][k] and mine["rank"] >= 1
        top = sorted((v for v in entry.values() if v["rank"] <= 3), key=lambda v: v["rank"])
        assert [v["rank"] for v in top] == [1, 2, 3]
        for v in top:  # echo's top_logprobs: token string -> logprob
            assert logprobs["top_logprobs"][k][v["decoded_token"]] == pytest.approx(v["logprob"], abs=1e-4)
        assert len(entry) in (3, 4)  # the top 3, and the prompt token where it is not among them
    # Both asked together: each answer has its own count.
    both = _post(f"{server.api_url}/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1,
                                                   "temperature": 0, "echo": True, "logprobs": 1,
                                                   "prompt_logprobs": 5}).json()["choices"][0]
    assert all(len(t) <= 2 for t in both["logprobs"]["top_logprobs"][1:])
    assert all(sum(v["rank"] <= 5 for v in e.values()) == 5 for e in both["prompt_logprobs"][1:])
    plain = _post(f"{server.api_url}/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
    assert plain.json()["choices"][0]["prompt_logprobs"] is None


@pytest.mark.parametrize("value", [-1, 21, 2**64, 2**63, "3", True])
def test_bad_prompt_logprobs_are_400_naming_the_field(server, value):
    r = _post(f"{server.api_url}/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1,
                                                "prompt_logprobs": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_prompt_logprobs_with_stream_is_400(server):
    r = _post(f"{server.api_url}/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1,
                                                "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


# ---- a body past the limit -------------------------------------------------------------

BIG_BODY = json.dumps({"prefix": "x" * 9_500_000}).encode()


def _assert_413(status: int, body: bytes) -> None:
    assert status == 413, body[:300]
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error", error


def test_a_9_5_mb_body_gets_413_not_a_reset_from_urllib(server):
    """urllib sends its whole body before reading (and asks to close): the
    server used to close with the body unread, a reset, and urllib never
    saw the 413."""
    request = urllib.request.Request(f"{server.base_url}/v1/kv/public_prefixes", data=BIG_BODY,
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    _assert_413(caught.value.code, caught.value.read())


@pytest.mark.parametrize("close", [False, True])
def test_a_9_5_mb_body_gets_413_from_httpx(server, close):
    headers = {"content-type": "application/json", **({"connection": "close"} if close else {})}
    r = httpx.post(f"{server.base_url}/v1/kv/public_prefixes", content=BIG_BODY, headers=headers, timeout=60)
    _assert_413(r.status_code, r.content)


def test_a_client_that_never_finishes_its_body_is_cut_off(server):
    """The lingering read is bounded: a client that stops sending a refused
    body is closed once it has been idle for the linger timeout."""
    from kvferry.serve.lingering_close import LINGER_TIMEOUT_S

    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/kv/public_prefixes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 9500000\r\n\r\n" + b"x" * 100_000)
        data = b""
        while chunk := sock.recv(65536):  # the answer, then the server's FIN (it still reads)
            data += chunk
        assert data.startswith(b"HTTP/1.1 413") and b"request_too_large" in data, data[:300]
        time.sleep(LINGER_TIMEOUT_S + 1)
        deadline = time.monotonic() + 10
        with pytest.raises(OSError):  # closed by now: a reset answers what we send
            while time.monotonic() < deadline:
                sock.sendall(b"x" * 65536)
                time.sleep(0.2)


# ---- joining a worker -------------------------------------------------------------------

def _join(server, address: str) -> tuple[httpx.Response, float]:
    start = time.perf_counter()
    r = httpx.post(f"{server.base_url}/v1/admin/workers", json={"address": address}, timeout=120)
    return r, time.perf_counter() - start


def test_a_worker_address_that_is_no_socket_is_400_at_once(server, tmp_path):
    for name in ("core-input", "core-output"):
        (tmp_path / name).write_text("not a socket")
    for address in ("ipc:///etc/passwd", f"ipc://{tmp_path}/core", "tcp://127.0.0.1:65535", "tcp://127.0.0.1:0",
                    "ipc://", "file:///etc/passwd"):
        r, seconds = _join(server, address)
        assert r.status_code == 400 and r.json()["error"]["param"] == "address", (address, r.text)
        assert seconds < 5, (address, seconds)


def test_a_peer_that_does_not_speak_zeromq_is_502_fast(server):
    """A listener that accepts and says nothing used to hold the join for
    its whole 30 s handshake timeout."""
    silent = [socket.create_server(("127.0.0.1", 0))]
    port = silent[0].getsockname()[1]
    try:
        silent.append(socket.create_server(("127.0.0.1", port + 1)))
    except OSError:
        pytest.skip("the port after a free one is taken")
    try:
        r, seconds = _join(server, f"tcp://127.0.0.1:{port}")
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_unreachable", r.text
        assert seconds < 15, seconds
    finally:
        for s in silent:
            s.close()
    assert httpx.get(f"{server.base_url}/v1/admin/workers", timeout=10).json()["data"][0]["alive"]


# ---- grammar errors --------------------------------------------------------------------

_INTERNALS = re.compile(r"\.(cc|cpp|h)\b|/project/|\[\d{2}:\d{2}:\d{2}\]")


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/x"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 1}}}},
    {"structured_outputs": {"regex": "(?<=a)b"}},
    {"structured_outputs": {"grammar": "root ::= foo"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/x"}}}],
     "tool_choice": "required"},
])
def test_grammar_errors_keep_the_reason_without_build_internals(server, body):
    r = _post(f"{server.api_url}/chat/completions",
              {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert not _INTERNALS.search(message), message
    assert len(message) > 20 and "compiled" in message, message


def test_the_library_reason_is_kept():
    from kvferry.structured.errors import library_reason

    raw = "[06:48:19] /project/cpp/json_schema_converter.cc:5088: Cannot find field '$defs' in #/$defs/x\n"
    assert library_reason(RuntimeError(raw)) == "Cannot find field '$defs' in #/$defs/x"
    assert library_reason("minimum must be a number, see schema.py") == "minimum must be a number, see schema.py"
