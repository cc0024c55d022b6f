"""``kvferry serve`` as two processes: the front end ("kvferry: api-server")
and the engine core ("kvferry: engine-0"). A dead core turns into ended
streams and 503s, never a hang, and is started again (a death past
--engine-restarts ends the server, non-zero); a dead front end takes its
core with it; bad flags and busy ports fail before any model loads."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvferry import peer_auth
from tests.serve.server_process import start_server
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", max_position_embeddings=4096))


def proc_title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an exited child nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def core_pid(server_pid: int, timeout_s: float = 10.0, other_than: int | None = None) -> int:
    """The engine core child of a server process (``other_than``: a new one,
    not that pid)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == other_than:
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == server_pid and proc_title(int(entry.name)).startswith("kvferry: engine-0"):
                return int(entry.name)
        time.sleep(0.1)
    raise AssertionError(f"no engine core child of {server_pid}")


def wait_healthy(base_url: str, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(base_url + "/health", timeout=5)
        if r.status_code == 200 or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while is_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_process_titles_and_no_orphan_core(tiny, tmp_path):
    srv = start_server(tmp_path / "server.log", ["--model", tiny, "--dtype", "float32"])
    try:
        assert proc_title(srv.proc.pid).startswith("kvferry: api-server"), proc_title(srv.proc.pid)
        core = core_pid(srv.proc.pid)
        assert proc_title(core).startswith("kvferry: engine-0")
        # The front end vanishes without any chance to clean up.
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        assert wait_gone(core, 5.0), f"engine core {core} outlived its front end: {proc_title(core)}"
    finally:
        srv.stop(signal.SIGKILL)


class _Stream(threading.Thread):
    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.events: list[dict] = []
        self.done = False
        self.ended_at: float | None = None
        self.first = threading.Event()

    def run(self) -> None:
        body = {"model": self.model, "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        self.first.set()
        finally:
            self.ended_at = time.monotonic()
            self.first.set()


def test_killed_core_ends_streams_then_is_restarted(tiny, tmp_path):
    srv = start_server(tmp_path / "server.log", ["--model", tiny, "--dtype", "float32"])
    model = httpx.get(srv.api_url + "/models", timeout=10).json()["data"][0]["id"]
    try:
        stream = _Stream(srv.base_url, model)
        stream.start()
        assert stream.first.wait(60) and stream.events and "choices" in stream.events[0]
        core = core_pid(srv.proc.pid)
        killed = time.monotonic()
        os.kill(core, signal.SIGKILL)
        stream.join(10)
        assert not stream.is_alive() and stream.ended_at is not None
        assert stream.ended_at - killed < 1.0, stream.ended_at - killed
        # The stream ended properly: an error event, then [DONE].
        assert stream.done and "error" in stream.events[-1], stream.events[-2:]
        assert stream.events[-1]["error"]["code"] == "engine_unavailable"
        # While the core restarts (a backoff, then a model load), the probe
        # says so with its own code, naming the death; a new request waits
        # for the new core (--engine-restart-wait) and is served by it.
        health = httpx.get(srv.base_url + "/health", timeout=5)
        assert health.status_code == 503, health.text
        assert health.json()["error"]["code"] == "engine_restarting"
        assert "exited with code -9" in health.json()["error"]["message"]
        r = httpx.post(srv.api_url + "/completions", json={"model": model, "prompt": "hi", "max_tokens": 2},
                       timeout=150)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert wait_healthy(srv.base_url, 120).status_code == 200, srv.log()[-3000:]
        assert core_pid(srv.proc.pid, other_than=core) != core
        r = httpx.post(srv.api_url + "/completions", json={"model": model, "prompt": "hi", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert "restarting engine core engine-0" in srv.log() and "engine core engine-0 restarted" in srv.log()
        # The front end still shuts down cleanly.
        code = srv.stop(signal.SIGTERM, timeout_s=30)
        assert code == 0, srv.log()[-3000:]
    finally:
        srv.stop(signal.SIGKILL)


def test_a_core_dying_past_its_restart_budget_ends_the_server(tiny, tmp_path):
    """--engine-restarts 1: the first death is restarted, the second ends
    the server with a non-zero status (for a supervisor to restart it)."""
    srv = start_server(tmp_path / "server.log", ["--model", tiny, "--dtype", "float32", "--engine-restarts", "1",
                                                 "--engine-restart-wait", "0"])
    try:
        first = core_pid(srv.proc.pid)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(srv.base_url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # --engine-restart-wait 0: a request during the restart is answered at once.
        r = httpx.post(srv.api_url + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_restarting", r.text
        assert wait_healthy(srv.base_url, 120).status_code == 200, srv.log()[-3000:]
        second = core_pid(srv.proc.pid, other_than=first)
        assert srv.proc.poll() is None
        os.kill(second, signal.SIGKILL)
        code = srv.proc.wait(60)
        assert code == 3, srv.log()[-3000:]
        assert "no engine restart left (1 within 600 s)" in srv.log(), srv.log()[-3000:]
    finally:
        srv.stop(signal.SIGKILL)


def test_sigterm_while_a_core_restarts_leaves_no_core_behind(tiny, tmp_path):
    """The server stops in the middle of a restart (the new core spawned,
    its handshake not done): it still exits 0, and the half-started core
    goes with it."""
    srv = start_server(tmp_path / "server.log", ["--model", tiny, "--dtype", "float32"])
    try:
        first = core_pid(srv.proc.pid)
        os.kill(first, signal.SIGKILL)
        second = core_pid(srv.proc.pid, other_than=first)
        assert httpx.get(srv.base_url + "/health", timeout=5).json()["error"]["code"] == "engine_restarting"
        code = srv.stop(signal.SIGTERM, timeout_s=30)
        assert code == 0, srv.log()[-3000:]
        assert wait_gone(second, 5.0), f"restarted core {second} outlived its front end: {proc_title(second)}"
        assert "Traceback" not in srv.log() and "never retrieved" not in srv.log(), srv.log()[-3000:]
    finally:
        srv.stop(signal.SIGKILL)


def _serve(args: list[str], timeout_s: float = 120) -> tuple[int, str, float]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", *args], capture_output=True, text=True,
                       timeout=timeout_s)
    return r.returncode, r.stdout + r.stderr, time.monotonic() - start


def test_bad_port_fails_before_the_model_loads():
    code, out, _ = _serve(["--port", "99999"])
    assert code == 2 and "port must be in [0, 65535], got 99999" in out, out
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # No model given: loading the embedded one would take seconds and log.
        code, out, _ = _serve(["--port", str(port), "--log-level", "info"])
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in out, out
    assert "engine core" not in out and "Traceback" not in out, out


def test_core_start_failure_is_a_clear_error(tiny, tmp_path):
    # A mistake only the loaded core finds (the front end checks the rest
    # before it starts one, tests/serve/test_flag_errors.py): a file that
    # is no draft head.
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(2, dtype=np.float32)}, str(tmp_path / "head.safetensors"))
    code, out, _ = _serve(["--port", "0", "--model", tiny, "--speculative-config",
                           json.dumps({"method": "head", "model": str(tmp_path / "head.safetensors")})])
    assert code == 2, out
    assert "kvferry serve: error: the engine core failed to start" in out, out
    assert "is not a draft head file" in out and "Traceback" not in out, out


def test_bad_engine_flag_is_a_usage_error():
    code, out, _ = _serve(["--max-num-seqs", "0"])
    assert code == 2 and "max_num_seqs must be an integer >= 1" in out, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_core_alone_over_tcp(tiny):
    """``kvferry engine-core`` serves whoever connects to its addresses (as a
    worker on another node would): handshake, a request, shutdown."""
    from kvferry.engine.core_client import CoreAddresses, CoreConnection
    from kvferry.messages import (
        CoreOutput, EngineCoreOutputs, EngineCoreReady, EngineCoreRequest, EngineCoreShutdown, decode,
    )
    from kvferry.sampling import SamplingParams

    addresses = CoreAddresses(f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}")
    peer_auth.socket_secret()  # inherited by the core: its inputs must carry this tree's token
    proc = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "engine-core", "--model", tiny, "--dtype",
                             "float32", "--num-kv-blocks", "64", "--name", "engine-7", "--log-level", "warning",
                             "--input-address", addresses.input, "--output-address", addresses.output])
    conn = CoreConnection(addresses)
    try:
        ready = conn.wait_ready(timeout_s=120)
        assert ready.pid == proc.pid and ready.num_kv_blocks == 64 and ready.max_model_len == 64 * 16
        assert proc_title(proc.pid).startswith("kvferry: engine-7")
        params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
        conn.send(EngineCoreRequest(request_id="r", prompt_token_ids=[5, 6, 7], sampling_params=params,
                                    eos_token_ids=[2], arrival_time=time.monotonic()))
        tokens, finish = [], None
        while finish is None:
            assert conn.output.poll(30_000), "no output from the core"
            message = decode(conn.output.recv(), CoreOutput)
            if isinstance(message, EngineCoreReady):
                continue  # the answer to wait_ready's hello, when the first handshake beat it
            assert isinstance(message, EngineCoreOutputs) and message.engine_error is None
            for out in message.outputs:
                tokens += out.new_token_ids
                finish = out.finish_reason
        assert len(tokens) == 5 and finish == "length"
        conn.send(EngineCoreShutdown())
        assert proc.wait(30) == 0
    finally:
        conn.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_restarted_core_leaves_no_stale_socket_registration(tiny):
    """Regression: the front end's asyncio reader for a dead core's output
    socket outlived that socket. Its fd number, freed when the connection
    closed, stayed in asyncio's selector map (epoll itself dropped it), so
    the next socket given that number (a later restarted core's output
    socket, an HTTP connection) was never polled: every request to it hung.
    Here a socket is given the dead connection's fd number on purpose, and
    must be read; the restarted core must still serve."""
    from kvferry.config import EngineArgs
    from kvferry.sampling import SamplingParams
    from kvferry.serve.engine_client import AsyncEngineClient

    async def main():
        client = AsyncEngineClient.launch(EngineArgs(model=tiny, dtype="float32"), ready_timeout_s=120)
        await client.start()
        loop = asyncio.get_running_loop()
        try:
            for restart in (1, 2):
                old = client.workers["engine-0"]
                await asyncio.sleep(0.2)  # its output loop waits in recv: its fd is registered
                old_fd = old.connection.output.FD
                os.kill(old.process.pid, signal.SIGKILL)
                deadline = time.monotonic() + 120
                while not (client.workers["engine-0"] is not old and client.workers["engine-0"].alive):
                    assert time.monotonic() < deadline, f"restart {restart} did not end"
                    await asyncio.sleep(0.05)
                # The dead core's connection is closed: its fd number is the lowest free one or near it.
                pairs = []
                try:
                    reader = None
                    for _ in range(64):
                        pairs.append(socket.socketpair())
                        reader = next((s for s in pairs[-1] if s.fileno() == old_fd), None)
                        if reader is not None:
                            break
                    assert reader is not None, f"fd {old_fd} was not free after restart {restart}"
                    writer = next(s for s in pairs[-1] if s is not reader)
                    reader.setblocking(False)
                    received = asyncio.ensure_future(loop.sock_recv(reader, 1))
                    await asyncio.sleep(0.05)  # registered before the data is there
                    writer.send(b"x")
                    assert await asyncio.wait_for(received, 5) == b"x"
                finally:
                    for pair in pairs:
                        for s in pair:
                            s.close()
                stream = await client.add_request(f"r{restart}", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
                outs = await asyncio.wait_for(_collect(stream), 30)
                assert outs[-1].finished, outs
        finally:
            await client.shutdown()

    async def _collect(stream):
        return [out async for out in stream]

    asyncio.run(main())
