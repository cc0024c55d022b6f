"""The front end's engine client and the HTTP layer over a real engine core
behind real sockets, with a tiny random-weight checkpoint: input batching,
responsiveness during long steps, rejections, aborts, the idle integrity
check.

The core runs in a thread of the test process (the same EngineCoreProc,
sockets and threads as in ``kvferry serve``'s core process) so that tests
can look at, and break, its bookkeeping while it is idle.
(tests/serve/test_core_process.py covers the separate process itself.)

Step times of the tiny model on a CPU (2 cores): a 1000-token prefill takes
~0.1 s, a 4000-token one ~1 s (one step: attention is quadratic), and running
a sequence to 4000 tokens takes tens of seconds. The tests lean on those
orders of magnitude only."""
from __future__ import annotations

import asyncio
import gc
import re
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from kvferry.config import EngineArgs
from kvferry.engine.core import EngineCore
from kvferry.engine.core_client import CoreConnection, ipc_addresses
from kvferry.engine.core_proc import EngineCoreProc
from kvferry.sampling import SamplingParams
from kvferry.serve.app import ServerConfig, build_app
from kvferry.serve.engine_client import AsyncEngineClient, EngineDeadError
from tests.tiny_models import make_tiny_checkpoint

MAX_LEN = 4096
MODEL = "tiny"
LONG_PROMPT = [3 + i % 300 for i in range(1000)]  # valid ids (vocab 384); a ~0.1 s prefill step
HUGE_PROMPT = [3 + i % 300 for i in range(4000)]  # the longest prefill step here (0.1-1 s, by machine)
PROBE_WINDOW_S = 2.0  # how long the responsiveness test probes the HTTP side while the engine steps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", max_position_embeddings=MAX_LEN))


@dataclass
class ThreadCore:
    """An engine core serving on ipc sockets from a thread of this process."""

    core: EngineCore
    proc: EngineCoreProc
    thread: threading.Thread
    connection: CoreConnection
    socket_folder: str

    def stop(self) -> None:
        self.proc.request_shutdown()
        self.thread.join(10)
        shutil.rmtree(self.socket_folder, ignore_errors=True)
        assert not self.thread.is_alive(), "the core loop did not stop"

    def client(self) -> AsyncEngineClient:
        ready = self.connection.wait_ready(timeout_s=30)
        return AsyncEngineClient(self.connection, ready, self.core.loaded.tokenizer)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    # Room for two sequences of MAX_LEN; a HUGE_PROMPT prefill fits in one step.
    args = EngineArgs(model=checkpoint, dtype="float32", num_kv_blocks=2 * MAX_LEN // 16 + 8,
                      block_size=16, max_num_batched_tokens=MAX_LEN)
    return args.create_engine_config(), EngineCore(args.create_engine_config()).loaded


def _start_core(loaded, check_integrity_when_idle: bool = False) -> ThreadCore:
    config, model = loaded
    core = EngineCore(config, model)  # a fresh pool and scheduler per test
    addresses, folder = ipc_addresses()
    proc = EngineCoreProc(core, addresses, check_integrity_when_idle)

    def run() -> None:
        try:
            proc.run()
        except BaseException:  # reported to the client as engine_error; the test checks that
            pass

    thread = threading.Thread(target=run, name="test-engine-core", daemon=True)
    thread.start()
    return ThreadCore(core, proc, thread, CoreConnection(addresses), folder)


@pytest.fixture
def core(loaded):
    tc = _start_core(loaded)
    yield tc
    tc.stop()


@contextmanager
def serving(client: AsyncEngineClient, **config):
    """The real app under uvicorn, in a thread, on a free port. Yields the
    base URL and the app's AsyncEngineClient."""
    app = build_app(client, ServerConfig([MODEL], **config))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app.state.client
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "server did not stop"


def _body(**fields):
    return {"model": MODEL, "prompt": "Hello world", "max_tokens": 4, "ignore_eos": True, **fields}


def _wait_until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _assert_nothing_left(core: ThreadCore, client: AsyncEngineClient, timeout_s: float = 10.0) -> None:
    """Only while the core is idle (or stopped): the core is not thread-safe."""
    assert _wait_until(lambda: client.stats.kv_blocks_used == 0 and client.num_active_requests == 0, timeout_s), \
        client.stats
    assert not client.output_processor.parents and not client.output_processor.seqs
    assert not core.core.has_unfinished_requests() and not core.core.scheduler.requests
    core.core.check_integrity()


def test_inputs_are_drained_before_each_step(core):
    """Requests arriving during a step all join the next one: their first
    tokens come out of the same step (one message, one timestamp)."""
    async def main():
        client = core.client()
        await client.start()
        try:
            # The long prefill occupies the core while the burst crosses the socket.
            long = await client.add_request("long", LONG_PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
            await asyncio.sleep(0.01)
            burst = await asyncio.gather(*(
                client.add_request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
                for i in range(8)))
            finals = [[o async for o in stream][-1] for stream in burst]
            assert [len(o.outputs[0].token_ids) for o in finals] == [3] * 8
            assert all(o.finished for o in finals)
            first_token_times = {stream.first_token_time for stream in burst}
            # One input per loop turn would give 8 distinct steps.
            assert len(first_token_times) <= 2, sorted(first_token_times)
            assert [o async for o in long][-1].finished
            _assert_nothing_left(core, client)
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_http_stays_responsive_while_the_engine_steps(checkpoint):
    """With the core in its own process (as ``kvferry serve`` runs it), a
    long step holds no lock the HTTP side needs."""
    args = EngineArgs(model=checkpoint, dtype="float32", num_kv_blocks=2 * MAX_LEN // 16 + 8,
                      block_size=16, max_num_batched_tokens=MAX_LEN)
    # This test process holds torch and transformers objects; a full garbage
    # collection of them can pause the in-process HTTP thread for a second on
    # a busy machine. Freezing them leaves only the server's own pauses.
    gc.freeze()
    try:
        _check_responsive(args)
    finally:
        gc.unfreeze()


def _check_responsive(args: EngineArgs) -> None:
    with serving(AsyncEngineClient.launch(args, ready_timeout_s=120)) as (url, client):
        stop = threading.Event()
        statuses: list[int] = []

        def generate():
            # Back to back, so that the engine steps for the whole probing
            # window however fast one generation is on this machine.
            while not stop.is_set():
                r = httpx.post(url + "/v1/completions", timeout=60, json=_body(prompt=HUGE_PROMPT, max_tokens=20))
                statuses.append(r.status_code)

        t = threading.Thread(target=generate)
        t.start()
        assert _wait_until(lambda: client.num_active_requests == 1)
        start = time.monotonic()
        latencies = []
        with httpx.Client(base_url=url, timeout=5) as http:
            while time.monotonic() - start < PROBE_WINDOW_S or len(statuses) < 2:
                t0 = time.monotonic()
                assert http.get("/health").status_code == 200
                assert http.get("/metrics").status_code == 200
                latencies.append(time.monotonic() - t0)
        stop.set()
        t.join()
        total = time.monotonic() - start
        assert statuses and all(s == 200 for s in statuses), statuses
        # Generations (each a 4000-token prefill step, then 20 decode steps)
        # ran throughout; health and metrics kept answering, well under a
        # step (with headroom for a machine shared with other work).
        assert len(latencies) >= 5, (latencies, total)
        assert max(latencies) < min(0.75, total / 3), (latencies, total)
        assert sorted(latencies)[len(latencies) // 2] < 0.05, latencies
    assert not client.process.is_alive() and client.process.exitcode == 0


def test_engine_rejection_is_a_400_and_leaves_nothing_behind(core):
    with serving(core.client()) as (url, client):
        r = httpx.post(url + "/v1/completions", json=_body(prompt=[5, 6, 10**6]), timeout=10)
        assert r.status_code == 400, r.text
        assert "outside the vocabulary" in r.json()["error"]["message"]
        _assert_nothing_left(core, client)
        r = httpx.post(url + "/v1/completions", json=_body(prompt=[5, 6, 7]), timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        _assert_nothing_left(core, client)


def test_client_disconnects_abort_in_the_engine(core):
    with serving(core.client()) as (url, client):
        # Running to max_tokens would take tens of seconds; an abort, milliseconds.
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True,
        }) as r:
            assert r.status_code == 200
            # Token chunks are flowing, so the sequence is running in the core
            # (and stays so while this stream is open: it is far from its end).
            lines = r.iter_lines()
            assert sum(1 for line in _take(lines, 8) if line.startswith("data: {")) >= 3
            assert _wait_until(lambda: client.stats.kv_blocks_used > 0 and client.stats.num_running == 1)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=_body(max_tokens=4000), timeout=httpx.Timeout(10, read=0.5))
        _assert_nothing_left(core, client, timeout_s=3)
        metrics = httpx.get(url + "/metrics", timeout=5).text
        aborted = re.search(r'^kvferry:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$',
                            metrics, re.M)
        assert aborted and float(aborted.group(1)) == 2.0, metrics


def _take(lines, n: int) -> list[str]:
    """The next n non-empty lines of an SSE stream."""
    taken = []
    for line in lines:
        if line:
            taken.append(line)
            if len(taken) == n:
                break
    return taken


def test_client_api_directly(core):
    """The seam the router will use: add, iterate, close; n > 1 ends after all
    n; rejections raise ValueError; nothing works after shutdown."""
    async def main():
        client = core.client()
        await client.start()
        try:
            await _exercise(client)
            _assert_nothing_left(core, client)
        finally:
            await client.shutdown()
        assert not client.is_alive
        with pytest.raises(EngineDeadError):
            await client.add_request("r4", [5], SamplingParams())

    async def _exercise(client):
        stream = await client.add_request("r1", [5, 6, 7], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
        outs = [out async for out in stream]
        finals = [o for o in outs if o.finished]
        assert sorted(o.outputs[0].index for o in finals) == [0, 1]
        assert all(len(o.outputs[0].token_ids) == 3 and o.outputs[0].finish_reason == "length" for o in finals)
        assert all(o.request_id == "r1" for o in outs)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await client.add_request("r2", [10**6], SamplingParams())
        with pytest.raises(ValueError, match="context length"):
            await client.add_request("r2", [5] * MAX_LEN, SamplingParams())
        stream = await client.add_request("r3", [5, 6, 7], SamplingParams(max_tokens=4000, ignore_eos=True))
        with pytest.raises(ValueError, match="already in use"):
            await client.add_request("r3", [5, 6, 7], SamplingParams())
        await stream.__anext__()
        for _ in range(300):  # the stats come with the next step's message
            if client.stats.num_running == 1:
                break
            await asyncio.sleep(0.01)
        assert client.stats.num_running == 1 and client.stats.kv_blocks_used > 0, client.stats
        client.abort("r3")
        # The stream ends (without an error) after whatever had already arrived.
        assert not any(o.finished for o in [o async for o in stream])
        for _ in range(300):  # 3 s; running to the end would take tens of seconds
            if client.stats.kv_blocks_used == 0 and client.stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert client.stats.kv_blocks_used == 0 and client.stats.num_running == 0, client.stats

    asyncio.run(main())


def test_integrity_checked_when_idle_and_failure_reported(loaded):
    tc = _start_core(loaded, check_integrity_when_idle=True)
    with serving(tc.client()) as (url, client):
        assert httpx.post(url + "/v1/completions", json=_body(), timeout=10).status_code == 200
        assert _wait_until(lambda: client.stats.kv_blocks_used == 0 and not tc.core.has_unfinished_requests())
        time.sleep(0.2)  # let the loop finish its turn (and the passing idle check)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        # A genuine bookkeeping fault: a block taken from the pool that no
        # request owns, made while the loop is idle (blocked on its queue).
        tc.core.scheduler.kv.pool.allocate(1)
        assert httpx.post(url + "/v1/completions", json=_body(), timeout=10).status_code == 200
        # Going idle again runs the check, which kills the loop; the core says why.
        assert _wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 503, 5)
        health = httpx.get(url + "/health", timeout=5).json()["error"]
        assert health["code"] == "engine_unavailable" and "AssertionError" in health["message"], health
        r = httpx.post(url + "/v1/completions", json=_body(), timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    tc.stop()
