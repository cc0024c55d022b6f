"""Inputs that once broke or held the server, each sent as the request that
exposed it (raw bytes where the JSON escape matters), against real servers:
the session one, and one started here with short read timeouts and a
generation-length policy."""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve.keepalive import KeepAlive
from tests.serve.server_process import MODEL_NAME, ServerProcess, start_server

pytestmark = pytest.mark.usefixtures("healthy")

HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
KEEP_ALIVE_S = 5  # longer than the header deadline: an idle connection outlives it
MAX_TOKENS_DEFAULT = 5
MAX_TOKENS_LIMIT = 40
ORIGIN = "http://agent.example"


CUSTOM_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                   "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory) -> ServerProcess:
    folder = tmp_path_factory.mktemp("strict")
    (folder / "template.jinja").write_text(CUSTOM_TEMPLATE)
    srv = start_server(folder / "server.log", ["--chat-template", str(folder / "template.jinja"),
        "--header-read-timeout", str(HEADER_TIMEOUT_S), "--body-read-timeout", str(BODY_TIMEOUT_S),
        "--timeout-keep-alive", str(KEEP_ALIVE_S),
        "--max-tokens-default", str(MAX_TOKENS_DEFAULT), "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
        "--allowed-origins", ORIGIN, "--max-header-count", "50",
    ])
    yield srv
    assert srv.stop() == 0, srv.log()[-5000:]


def _error(data: bytes) -> dict:
    body = json.loads(data)
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


GOOD_COMPLETION = b'{"prompt":"Hello","max_tokens":2}'

# The raw JSON escape \ud800 (a lone surrogate) in each place it was found.
SURROGATE_BODIES = {
    "prompt": ("/v1/completions", b'{"prompt":"ab\\ud800cd","max_tokens":2}'),
    "chat content": ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi \\ud800"}],"max_tokens":2}'),
    "content part": ("/v1/chat/completions",
                     b'{"messages":[{"role":"user","content":[{"type":"text","text":"\\udfff x"}]}],"max_tokens":2}'),
    "role": ("/v1/chat/completions", b'{"messages":[{"role":"us\\ud800er","content":"hi"}],"max_tokens":2}'),
    "model": ("/v1/completions", b'{"model":"\\udc00","prompt":"hi","max_tokens":2}'),
    "tokenize": ("/tokenize", b'{"prompt":"\\ud800"}'),
}


@pytest.mark.parametrize("where", list(SURROGATE_BODIES))
def test_lone_surrogate_is_400_and_keeps_connection(server, where):
    path, body = SURROGATE_BODIES[where]
    conn = KeepAlive(server.base_url)
    try:
        status, headers, data = conn.post(path, body)
        assert status == 400, data
        assert headers.get("connection") != "close"
        assert "JSON" in _error(data)["message"]
        status, _, data = conn.post("/v1/completions", GOOD_COMPLETION)  # same connection
        assert status == 200, data
    finally:
        conn.close()


def test_surrogate_pair_is_a_character(server):
    # A valid pair (\ud83d\ude00 is U+1F600) must still work.
    conn = KeepAlive(server.base_url)
    status, _, data = conn.post("/tokenize", b'{"prompt":"\\ud83d\\ude00"}')
    conn.close()
    assert status == 200
    ids = json.loads(data)["tokens"]
    detok = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}).json()
    assert detok["prompt"] == "\U0001F600"


LAX_TYPES = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "logprobs": "yes"}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1},
                              "stream": True}, "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": None}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
]


@pytest.mark.parametrize("path,body,param", LAX_TYPES, ids=[f"{p}-{param}" for p, _, param in LAX_TYPES])
def test_wrong_types_and_roles_rejected(server, path, body, param):
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert _error(r.content)["param"] == param


def test_roles_accepted(client):
    # developer is system; an assistant turn with tool calls may omit content.
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_logprobs_bytes_rebuild_emoji(client):
    """Byte-level tokens of an emoji decode alone to U+FFFD; their bytes
    must be their real bytes so that the text can be rebuilt from them."""
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Reply with only emoji: 😀😃😄😁😆😅🤣😂🙂🙃😉😊😇"}],
        max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    entries = choice.logprobs.content
    assert any(e.token == "\ufffd" for e in entries), "expected split emoji tokens"
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8") == choice.message.content
    assert all(t.bytes != [239, 191, 189] for e in entries for t in e.top_logprobs)


def test_header_count_and_size_limits(strict_server):
    many = {f"x-h{i}": "1" for i in range(60)}
    r = httpx.get(f"{strict_server.base_url}/health", headers=many)
    assert r.status_code == 431 and r.headers["connection"] == "close"
    r = httpx.get(f"{strict_server.base_url}/health", headers={"x-big": "a" * 20000})
    assert r.status_code in (400, 431)


def _raw(base_url: str, data: bytes, timeout_s: float) -> tuple[float, bytes]:
    """Send ``data`` and read until the server answers and closes."""
    host, port = base_url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
    return time.monotonic() - start, received


SLOW_CLIENTS = {
    "partial-headers": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl", b"408"),
    "partial-body": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" b'{"prompt":', b"408"),
    "idle": (b"", b""),  # a connection that never sends anything is closed too
}


def test_slow_clients_are_cut_off(strict_server):
    # All at once, each on its own connection: each waits out its own deadline.
    with ThreadPoolExecutor(len(SLOW_CLIENTS)) as pool:
        futures = {case: pool.submit(_raw, strict_server.base_url, data, 20)
                   for case, (data, _) in SLOW_CLIENTS.items()}
        results = {case: future.result() for case, future in futures.items()}
    for case, (_, expect) in SLOW_CLIENTS.items():
        elapsed, received = results[case]
        assert elapsed < HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 5, (case, elapsed)
        assert (received.startswith(b"HTTP/1.1 " + expect) if expect else received == b""), (case, received)
        if expect:
            assert b"connection: close" in received.lower(), (case, received)


def _read_response(sock: socket.socket) -> bytes:
    """One whole response (head and a Content-Length body) off a kept-alive socket."""
    def more() -> bytes:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the kept-alive connection"
        return chunk

    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += more()
    return head


def test_kept_alive_connection_idles_until_the_keep_alive_timeout(strict_server):
    """Between requests a connection is the keep-alive timer's, not the header
    deadline's: a client idle past the header deadline (as httpx reuses a
    connection for 5 s) still gets an answer; the next head's deadline runs
    from its first bytes; an idle connection closes at the keep-alive timeout."""
    host, port = strict_server.base_url.removeprefix("http://").split(":")
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    idle: list[tuple[bytes, float]] = []  # (what the idle connection received, seconds until it closed)

    def idle_until_closed(sock: socket.socket) -> None:
        start = time.monotonic()
        idle.append((sock.recv(4096), time.monotonic() - start))

    # The idle connection waits out its keep-alive timeout on a thread while
    # the other connection's checks run (two waits at once, not one after the other).
    with socket.create_connection((host, int(port)), timeout=20) as idler, \
            socket.create_connection((host, int(port)), timeout=20) as sock:
        idler.sendall(health)
        assert _read_response(idler).startswith(b"HTTP/1.1 200")
        waiter = threading.Thread(target=idle_until_closed, args=(idler,))
        waiter.start()
        sock.sendall(health)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(HEADER_TIMEOUT_S + 1)
        sock.sendall(health)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(HEADER_TIMEOUT_S + 1)
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # a head that never ends
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
        assert received.startswith(b"HTTP/1.1 408")
        assert HEADER_TIMEOUT_S - 0.5 < time.monotonic() - start < HEADER_TIMEOUT_S + 2
        waiter.join(30)
    assert idle and idle[0][0] == b"", idle  # closed, with nothing sent
    assert KEEP_ALIVE_S - 0.5 < idle[0][1] < KEEP_ALIVE_S + 2, idle


def test_slow_body_does_not_block_others(strict_server):
    # A held-open body occupies one connection only.
    t = threading.Thread(target=_raw, args=(strict_server.base_url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                            b"Content-Length: 50\r\n\r\n{", 20))
    t.start()
    r = httpx.post(f"{strict_server.api_url}/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    t.join()


def test_max_tokens_default_and_limit(strict_server):
    url = f"{strict_server.api_url}/chat/completions"
    body = {"messages": [{"role": "user", "content": "Count to fifty."}], "ignore_eos": True}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS_DEFAULT
    r = httpx.post(url, json={**body, "max_completion_tokens": MAX_TOKENS_LIMIT + 1}, timeout=60)
    assert r.status_code == 400 and _error(r.content)["param"] == "max_completion_tokens"
    r = httpx.post(f"{strict_server.api_url}/completions", json={"prompt": "a", "ignore_eos": True}, timeout=60)
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS_DEFAULT


def test_request_id_echo(server):
    headers = {"X-Request-Id": "agent-42"}
    ids = []

    def one() -> None:  # the same X-Request-Id twice at once must not collide in the engine
        r = httpx.post(f"{server.api_url}/completions", json={"prompt": "Hi", "max_tokens": 4}, headers=headers,
                       timeout=60)
        assert r.status_code == 200 and r.headers["x-request-id"] == "agent-42"
        ids.append(r.json()["id"])

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ids == ["cmpl-agent-42", "cmpl-agent-42"]
    r = httpx.post(f"{server.api_url}/completions", json={"prompt": "Hi"}, headers={"X-Request-Id": "a b"})
    assert r.status_code == 400 and _error(r.content)["param"] == "X-Request-Id"


def test_cors(strict_server, server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    r = httpx.options(f"{strict_server.api_url}/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(f"{strict_server.api_url}/chat/completions", headers={**preflight, "Origin": "http://evil"})
    assert r.status_code == 400
    # Without --allowed-origins no CORS headers are sent.
    r = httpx.get(f"{server.base_url}/health", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers


def test_tokenize_detokenize(server, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL_NAME, "messages": messages})
    assert r.status_code == 200
    body = r.json()
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert body["count"] == len(body["tokens"]) == chat.usage.prompt_tokens
    assert body["max_model_len"] > 0
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert "What is the capital of France?" in text and "<|im_start|>" in text
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "x", "messages": messages})
    assert r.status_code == 400
    r = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and _error(r.content)["param"] == "tokens.0"


def test_chat_template_flag_replaces_the_models(strict_server):
    r = httpx.post(f"{strict_server.base_url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    text = httpx.post(f"{strict_server.base_url}/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text == "[user]hi[assistant]"
