"""``kvferry chat`` through a pseudo-terminal against a real ``kvferry
serve`` of a tiny random checkpoint (one server for the module).

History is checked by the server's own count: ``--verbose`` prints the
usage's prompt_tokens of each answer, and the server's /tokenize renders
the messages the chat should have sent. With greedy decoding a first
answer is replayed through the openai client, so the second turn's count
must equal that of the whole conversation, exactly.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from kvferry.chat.session import printable
from tests.chat.pty_chat import PtyChat
from tests.serve.server_process import start_server
from tests.tiny_models import make_tiny_checkpoint
from tests.tcp_sockets import tcp_sockets

MODEL = "tiny"
# Fast to start and to step; no heartbeat deadline, since one test stops
# the core (SIGSTOP) to hold an answer in flight.
SERVER_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-gb", "0.05", "--no-warm-up",
                "--engine-heartbeat-timeout", "0", "--log-level", "warning"]
STATS = r"prompt tokens (\d+), answer tokens (\d+)"
SYSTEM = "You are a terse assistant."
U1 = "The quick brown fox jumps over the lazy dog."
U2 = "Paris is the capital of France."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama"))


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("chat") / "server.log", ["--model", tiny],
                       serve_args=["--served-model-name", MODEL, "--disable-uvicorn-access-log", *SERVER_FLAGS])
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"


@pytest.fixture
def chats():
    """PtyChat(...) for a test; each is closed after it, whatever happened."""
    started: list[PtyChat] = []

    def start(*args: str) -> PtyChat:
        started.append(PtyChat(list(args)))
        return started[-1]

    yield start
    for chat in started:
        chat.close()


def _count(srv, messages: list[dict]) -> int:
    """The prompt length the server renders for ``messages`` (chat template and all)."""
    r = httpx.post(f"{srv.base_url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _turn(chat: PtyChat, text: str) -> tuple[int, int]:
    chat.expect(r">>> ")
    chat.line(text)
    m = chat.expect(STATS)
    return int(m.group(1)), int(m.group(2))


def _assert_no_controls(chat: PtyChat) -> None:
    """What the terminal got holds no control character but its own line
    ends (the random model's answers hold some: shown as U+FFFD)."""
    bad = sorted({hex(ord(c)) for c in chat.text() if (ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) < 0xa0})
    assert not bad, bad


def _sys(text: str) -> dict:
    return {"role": "system", "content": text}


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_two_turns_keep_history_clear_and_system_reset_it(server, chats):
    chat = chats("--url", server.base_url, "--system", SYSTEM, "--temperature", "0", "--max-tokens", "8",
                 "--verbose")
    chat.expect(f"Chatting with {MODEL} at {server.base_url}")
    p1, n1 = _turn(chat, U1)
    assert p1 == _count(server, [_sys(SYSTEM), _user(U1)])
    p2, _ = _turn(chat, U2)
    # The first answer, as the chat got it: greedy, so the same request gives it again.
    with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120) as client:
        a1 = client.chat.completions.create(model=MODEL, messages=[_sys(SYSTEM), _user(U1)], max_tokens=8,
                                            temperature=0).choices[0].message.content
    history = [_sys(SYSTEM), _user(U1), {"role": "assistant", "content": a1}, _user(U2)]
    assert p2 == _count(server, history), chat.text()
    assert p2 > _count(server, [_sys(SYSTEM), _user(U2)]) + n1  # not the second message alone

    chat.expect(">>> ")
    chat.line("/clear")
    chat.expect("Cleared the conversation. The system prompt stays.")
    p3, _ = _turn(chat, U2)
    assert p3 == _count(server, [_sys(SYSTEM), _user(U2)])  # history gone, system prompt kept

    chat.expect(">>> ")
    chat.line("/system Answer in French.")
    chat.expect("Set the system prompt.")
    chat.expect(">>> ")
    chat.line("/clear")
    p4, _ = _turn(chat, U1)
    assert p4 == _count(server, [_sys("Answer in French."), _user(U1)])

    chat.expect(">>> ")
    chat.line("/help")
    chat.expect(r"/exit, /bye")
    chat.expect(">>> ")
    chat.line("/exit")
    assert chat.wait() == 0
    _assert_no_controls(chat)


def _worker_pid(srv) -> int:
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=10)
    assert r.status_code == 200, r.text
    [worker] = r.json()["data"]
    return worker["pid"]


def _aborted(srv) -> float:
    return srv.metric("kvferry:request_success_total", finished_reason="abort")


def _established_to(port: int, pid: int) -> bool:
    """An open TCP connection from process ``pid`` to ``port`` (the chat's
    request; not another client's, whose socket may linger)."""
    return any(remote == port for _, remote in tcp_sockets(pid, "01"))


def test_ctrl_c_stops_the_answer_and_the_server_aborts_it(server, chats):
    chat = chats("--url", server.base_url, "--temperature", "0", "--max-tokens", "16", "--verbose")
    chat.expect(">>> ")
    aborted_before = _aborted(server)
    pid = _worker_pid(server)
    port = int(server.base_url.rsplit(":", 1)[1])
    # The core stopped, the answer cannot finish before the Ctrl-C.
    os.kill(pid, signal.SIGSTOP)
    try:
        chat.line(U1)
        deadline = time.monotonic() + 60
        while not _established_to(port, chat.pid):
            assert time.monotonic() < deadline, "the chat never sent its request"
            time.sleep(0.1)
        time.sleep(0.5)
        chat.send("\x03")  # Ctrl-C, through the terminal's line discipline
        chat.expect(r"\[stopped\]", timeout_s=30)
        chat.expect(">>> ")
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while _aborted(server) < aborted_before + 1:
        assert time.monotonic() < deadline, f"the server never aborted the request:\n{server.log()[-3000:]}"
        time.sleep(0.2)
    # The stopped exchange is not in the history: the next prompt is the new message alone.
    chat.line(U2)
    p, _ = [int(g) for g in chat.expect(STATS).groups()]
    assert p == _count(server, [_user(U2)])
    chat.expect(">>> ")
    chat.send("\x03")  # Ctrl-C at the prompt leaves
    assert chat.wait() == 0
    _assert_no_controls(chat)


def test_control_characters_are_shown_replaced():
    assert printable("a\x1b]0;title\x07b\rc\x9b\n\td 日本") == "a\ufffd]0;title\ufffdb\ufffdc\ufffd\n\td 日本"


def test_piped_input_is_one_message(server):
    proc = subprocess.run([sys.executable, "-m", "kvferry.cli", "chat", "--url", server.base_url, "--max-tokens", "4",
                           "--temperature", "0"], input=U1, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "Chatting" not in proc.stdout


def test_a_model_the_server_does_not_serve_is_one_line(server):
    proc = subprocess.run([sys.executable, "-m", "kvferry.cli", "chat", "other-model", "--url", server.base_url],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"kvferry chat: error: the server at {server.base_url} serves {MODEL}, "
                                   "not other-model")


def test_without_a_server_it_starts_one_and_stops_it(tiny, chats):
    chat = chats(tiny, "--serve-args", " ".join(SERVER_FLAGS), "--temperature", "0", "--max-tokens", "4",
                 "--verbose")
    chat.expect("starting a server for")
    url = chat.expect(r"the server is ready at (http://127\.0\.0\.1:\d+)", timeout_s=300).group(1)
    chat.expect(f"Chatting with {os.path.basename(tiny)} at {url}")
    p, n = _turn(chat, U1)
    assert p > 0 and n > 0
    chat.expect(">>> ")
    chat.send("\x04")  # Ctrl-D
    assert chat.wait(90) == 0
    with pytest.raises(httpx.ConnectError):  # the server went with the chat
        httpx.get(f"{url}/health", timeout=5)


def test_a_missing_model_or_a_server_that_cannot_start_is_reported_not_hung(tmp_path):
    run = [sys.executable, "-m", "kvferry.cli", "chat"]
    missing = subprocess.run([*run, str(tmp_path / "no-model"), "--serve-args", " ".join(SERVER_FLAGS)],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1
    assert missing.stderr.startswith("kvferry chat: error: model path does not exist: ")
    assert len(missing.stderr.strip().splitlines()) == 1 and "starting" not in missing.stderr
    bad = subprocess.run([*run, "--serve-args", "--no-such-flag 1"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TMPDIR=str(tmp_path)))  # the failed server's log, kept
    assert bad.returncode == 1
    assert "the server exited with 2 before it was ready" in bad.stderr
    assert "unrecognized argument: --no-such-flag" in bad.stderr  # the server's own line, from its log
    [log] = tmp_path.glob("kvferry-chat-serve-*.log")
    assert f"its log: {log}" in bad.stderr
