"""The engine loop thread and the HTTP layer, in-process, over a real
LLMEngine with a tiny random-weight checkpoint: command batching,
responsiveness during long steps, rejections, aborts, the idle integrity check.

Step times of the tiny model on a CPU (2 cores): a 1000-token prefill takes
~0.1 s, a 4000-token one ~1 s (one step: attention is quadratic), and running
a sequence to 4000 tokens takes tens of seconds. The tests lean on those
orders of magnitude only."""
from __future__ import annotations

import asyncio
import re
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from kvferry.engine.engine import LLMEngine
from kvferry.sampling import SamplingParams
from kvferry.serve.app import ServerConfig, build_app
from kvferry.serve.engine_client import AsyncEngineClient, EngineDeadError
from tests.tiny_models import make_tiny_checkpoint

MAX_LEN = 4096
MODEL = "tiny"
LONG_PROMPT = [3 + i % 300 for i in range(1000)]  # valid ids (vocab 384); a ~0.1 s prefill step
HUGE_PROMPT = [3 + i % 300 for i in range(4000)]  # a ~1 s prefill step


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", max_position_embeddings=MAX_LEN))


@pytest.fixture
def engine(checkpoint) -> LLMEngine:
    # Room for two sequences of MAX_LEN; a HUGE_PROMPT prefill fits in one step.
    return LLMEngine.from_args(model=checkpoint, dtype="float32", num_kv_blocks=2 * MAX_LEN // 16 + 8,
                               block_size=16, max_num_batched_tokens=MAX_LEN)


@contextmanager
def serving(engine: LLMEngine, **config):
    """The real app under uvicorn, in a thread, on a free port. Yields the
    base URL and the app's AsyncEngineClient."""
    app = build_app(engine, ServerConfig([MODEL], **config))
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


def _assert_nothing_left(engine: LLMEngine, client: AsyncEngineClient, timeout_s: float = 10.0) -> None:
    """Only while the loop is idle (or stopped): the engine is not thread-safe."""
    assert _wait_until(lambda: client.stats.kv_blocks_used == 0 and client.num_active_requests == 0, timeout_s), \
        client.stats
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    engine.check_integrity()


def test_commands_are_drained_before_each_step(engine):
    """Requests arriving during a step all join the next one: their first
    tokens come out of the same step (one dispatch, one timestamp)."""
    async def main():
        client = AsyncEngineClient(engine)
        await client.start()
        try:
            # Accepted means the loop has applied the add and is about to run
            # (or is inside) the long prefill step; the burst lands meanwhile.
            long = await client.add_request("long", LONG_PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
            burst = await asyncio.gather(*(
                client.add_request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
                for i in range(8)))
            finals = [[o async for o in stream][-1] for stream in burst]
            assert [len(o.outputs[0].token_ids) for o in finals] == [3] * 8
            assert all(o.finished for o in finals)
            first_token_times = {stream.first_token_time for stream in burst}
            # One command per loop turn would give 8 distinct steps.
            assert len(first_token_times) <= 2, sorted(first_token_times)
            assert [o async for o in long][-1].finished
        finally:
            await client.shutdown()
        _assert_nothing_left(engine, client)

    asyncio.run(main())


def test_http_stays_responsive_while_the_engine_steps(engine):
    with serving(engine) as (url, client):
        done = threading.Event()
        result = {}

        def generate():
            r = httpx.post(url + "/v1/completions", timeout=60, json=_body(prompt=HUGE_PROMPT, max_tokens=20))
            result["status"] = r.status_code
            done.set()

        t = threading.Thread(target=generate)
        start = time.monotonic()
        t.start()
        assert _wait_until(lambda: client.num_active_requests == 1)
        latencies = []
        with httpx.Client(base_url=url, timeout=5) as http:
            while not done.is_set():
                t0 = time.monotonic()
                assert http.get("/health").status_code == 200
                assert http.get("/metrics").status_code == 200
                latencies.append(time.monotonic() - t0)
        t.join()
        total = time.monotonic() - start
        assert result["status"] == 200
        # The generation (a ~1 s prefill step, then 20 decode steps) took a
        # while; health and metrics kept answering throughout, well under a step.
        assert len(latencies) >= 5, (latencies, total)
        assert max(latencies) < min(0.5, total / 3), (latencies, total)


def test_engine_rejection_is_a_400_and_leaves_nothing_behind(engine):
    with serving(engine) as (url, client):
        r = httpx.post(url + "/v1/completions", json=_body(prompt=[5, 6, 10**6]), timeout=10)
        assert r.status_code == 400, r.text
        assert "outside the vocabulary" in r.json()["error"]["message"]
        _assert_nothing_left(engine, client)
        r = httpx.post(url + "/v1/completions", json=_body(prompt=[5, 6, 7]), timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        _assert_nothing_left(engine, client)


def test_client_disconnects_abort_in_the_engine(engine):
    with serving(engine) as (url, client):
        # Running to max_tokens would take tens of seconds; an abort, milliseconds.
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True,
        }) as r:
            assert r.status_code == 200
            next(r.iter_lines())
            assert _wait_until(lambda: client.stats.kv_blocks_used > 0)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=_body(max_tokens=4000), timeout=httpx.Timeout(10, read=0.5))
        _assert_nothing_left(engine, client, timeout_s=3)
        metrics = httpx.get(url + "/metrics", timeout=5).text
        aborted = re.search(r'^kvferry:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$',
                            metrics, re.M)
        assert aborted and float(aborted.group(1)) == 2.0, metrics


def test_client_api_directly(engine):
    """The seam the router will use: add, iterate, close; n > 1 ends after all
    n; rejections raise ValueError; nothing works after shutdown."""
    async def main():
        client = AsyncEngineClient(engine)
        await client.start()
        try:
            await _exercise(client)
        finally:
            await client.shutdown()
        assert not client.is_alive
        _assert_nothing_left(engine, client)
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
        await stream.__anext__()
        for _ in range(300):  # the published stats lag the outputs by a moment
            if client.stats.num_running == 1:
                break
            await asyncio.sleep(0.01)
        assert client.stats.num_running == 1 and client.stats.kv_blocks_used > 0, client.stats
        stream.close()
        for _ in range(300):  # 3 s; running to the end would take tens of seconds
            if client.stats.kv_blocks_used == 0 and client.stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert client.stats.kv_blocks_used == 0 and client.stats.num_running == 0, client.stats

    asyncio.run(main())


def test_integrity_checked_when_idle_and_failure_reported(engine):
    with serving(engine, check_integrity_when_idle=True) as (url, client):
        assert httpx.post(url + "/v1/completions", json=_body(), timeout=10).status_code == 200
        assert _wait_until(lambda: client.stats.kv_blocks_used == 0 and not engine.has_unfinished_requests())
        time.sleep(0.2)  # let the loop finish its turn (and the passing idle check)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        # A genuine bookkeeping fault: a block taken from the pool that no
        # request owns, made while the loop is idle (blocked on its queue).
        engine.scheduler.kv.pool.allocate(1)
        assert httpx.post(url + "/v1/completions", json=_body(), timeout=10).status_code == 200
        # Going idle again runs the check, which kills the loop.
        assert _wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 503, 5)
        health = httpx.get(url + "/health", timeout=5).json()["error"]
        assert health["code"] == "engine_unavailable" and "AssertionError" in health["message"], health
        r = httpx.post(url + "/v1/completions", json=_body(), timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
