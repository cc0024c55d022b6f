"""The engine loop thread and the HTTP layer, with a fake engine (no model):
crashes, command batching, responsiveness during slow steps, aborts."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from kvferry.sampling import SamplingParams
from kvferry.serve.app import ServerConfig, build_app
from kvferry.serve.engine_client import AsyncEngineClient, EngineDeadError
from tests.serve.fake_engine import FakeEngine


@contextmanager
def serving(engine: FakeEngine, **config):
    """The real app under uvicorn, in a thread, on a free port."""
    app = build_app(engine, ServerConfig(["fake"], **config))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _body(**fields):
    return {"model": "fake", "prompt": "abc", "max_tokens": 5, **fields}


def test_engine_crash_ends_streams_and_health_says_503():
    engine = FakeEngine(step_delay_s=0.02)
    with serving(engine) as url:
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=_body(max_tokens=1000, stream=True), timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        engine.crash_on_step = True
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "engine loop died" in error["message"] and error["code"] == "engine_unavailable"
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and "fake engine crashed" in health.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json=_body(), timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"


def test_commands_are_drained_before_each_step():
    """Requests arriving during a step all join the next one."""
    engine = FakeEngine(step_delay_s=0.4)
    with serving(engine) as url:
        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                first = asyncio.create_task(http.post("/v1/completions", json=_body(max_tokens=6)))
                while not engine.num_steps:  # the loop is now inside a slow step
                    await asyncio.sleep(0.01)
                rest = [http.post("/v1/completions", json=_body(max_tokens=2)) for _ in range(8)]
                return await asyncio.gather(first, *rest)

        responses = asyncio.run(burst())
        assert all(r.status_code == 200 for r in responses)
        steps = {engine.added_at_step[rid] for rid in engine.added[1:]}
        assert len(steps) <= 2, engine.added_at_step  # batched, not one step per arrival


def test_http_stays_responsive_during_a_slow_step():
    engine = FakeEngine(step_delay_s=1.5)
    with serving(engine) as url:
        t = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=_body(max_tokens=2), timeout=30))
        t.start()
        while not engine.num_steps:
            time.sleep(0.01)
        start = time.monotonic()
        for _ in range(5):
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            assert httpx.get(url + "/metrics", timeout=5).status_code == 200
        assert time.monotonic() - start < 1.0
        t.join()


def test_engine_rejection_is_a_400_and_leaves_nothing_behind():
    engine = FakeEngine()
    with serving(engine) as url:
        r = httpx.post(url + "/v1/completions", json=_body(prompt="!bad"), timeout=10)
        assert r.status_code == 400
        assert "fake engine rejects" in r.json()["error"]["message"]
        assert not engine.seqs
        assert httpx.post(url + "/v1/completions", json=_body(), timeout=10).status_code == 200


def test_client_disconnects_abort_in_the_engine():
    engine = FakeEngine(step_delay_s=0.02)
    with serving(engine) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10000, "stream": True,
        }) as r:
            next(r.iter_lines())
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=_body(max_tokens=10000), timeout=httpx.Timeout(10, read=0.5))
        deadline = time.monotonic() + 5
        while engine.seqs and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.seqs
        assert len(set(engine.aborted)) == 2


def test_client_api_directly():
    """The seam the router will use: add, iterate, close; n > 1 ends after all n."""
    async def main():
        engine = FakeEngine(reply="xyz")
        client = AsyncEngineClient(engine)
        await client.start()
        stream = await client.add_request("r1", [1, 2, 3], SamplingParams(n=2, max_tokens=3))
        outs = [out async for out in stream]
        assert sorted((o.outputs[0].index, o.finished) for o in outs if o.finished) == [(0, True), (1, True)]
        assert {o.outputs[0].text for o in outs if o.finished} == {"xyz"}
        with pytest.raises(ValueError, match="rejects"):
            await client.add_request("r2", [ord("!")], SamplingParams())
        stream = await client.add_request("r3", [1], SamplingParams(max_tokens=10**6))
        await stream.__anext__()
        stream.close()
        for _ in range(100):
            if not engine.seqs:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["r3"]
        await client.shutdown()
        assert not client.is_alive
        with pytest.raises(EngineDeadError):
            await client.add_request("r4", [1], SamplingParams())

    asyncio.run(main())


def test_integrity_checked_when_idle_and_failure_reported():
    engine = FakeEngine()
    with serving(engine, check_integrity_when_idle=True) as url:
        assert httpx.post(url + "/v1/completions", json=_body(), timeout=10).status_code == 200
        deadline = time.monotonic() + 5
        while engine.num_integrity_checks == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_integrity_checks >= 1
        engine.broken_integrity = True
        assert httpx.post(url + "/v1/completions", json=_body(), timeout=10).status_code == 200
        deadline = time.monotonic() + 5
        while httpx.get(url + "/health", timeout=5).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and "bookkeeping is broken" in health.json()["error"]["message"]
