"""The cache scope a caller's API key makes reaches the engine core whole.

The front end builds one CacheScope per request (tenant namespace, cache
salt, public prefix blocks, quota, tenant, weight) and the core must run
the request in exactly that scope: a field lost on the way would quietly
put a tenant's blocks in the wrong namespace, lift its quota or drop its
weight. These tests drive the real app (auth middleware, routes, lifespan)
over a real engine core behind its sockets, look at the Request the core's
scheduler receives, and check the observable effect (public hits in
cached_tokens and in the tenant's stats).
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvferry.config import EngineArgs
from kvferry.core.hashing import CacheScope
from kvferry.engine.core import EngineCore
from kvferry.engine.engine import LLMEngine
from kvferry.sampling import SamplingParams
from kvferry.serve.api_flags import ApiOptions
from kvferry.serve.app import ServerConfig, build_app
from kvferry.serve.tenants import CacheNamespaces
from tests.serve.test_engine_client import MODEL, _start_core
from tests.tiny_models import make_tiny_checkpoint

BLOCK_SIZE = 16
SECRET = b"0123456789abcdef0123456789abcdef"
KEYS = {
    "sk-acme": {"tenant": "acme", "publish": True, "quota": {"device_blocks": 40}, "weight": 3},
    "sk-beta": {"tenant": "beta", "weight": 0.5},
    "sk-ops": {"tenant": "ops", "admin": True},
}
PUBLIC_TEXT = ("You are the support assistant of Example Corp. Answer briefly and only about our routers, "
               "switches and cables.\n")
TAIL = [3 + i % 300 for i in range(40)]  # valid ids of the tiny vocabulary


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="llama", max_position_embeddings=1024)
    args = EngineArgs(model=str(checkpoint), dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE)
    return args.create_engine_config(), EngineCore(args.create_engine_config()).loaded


def _api(tmp_path) -> ApiOptions:
    (tmp_path / "keys.json").write_text(json.dumps(KEYS))
    (tmp_path / "secret").write_bytes(SECRET)
    (tmp_path / "public.json").write_text(json.dumps([PUBLIC_TEXT]))
    return ApiOptions(api_keys_file=str(tmp_path / "keys.json"), cache_secret_file=str(tmp_path / "secret"),
                      public_prefixes_file=str(tmp_path / "public.json"))


async def _post(http: httpx.AsyncClient, path: str, key: str, body: dict) -> dict:
    r = await http.post(path, json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_scope_a_key_makes_is_the_one_the_core_runs(loaded, tmp_path, monkeypatch):
    tc = _start_core(loaded)
    received: dict[str, CacheScope] = {}  # request id -> the scope the core's scheduler got
    add = tc.core.scheduler.add_request

    def spy(request) -> None:
        received[request.request_id] = request.cache_scope  # immutable: a snapshot
        add(request)

    monkeypatch.setattr(tc.core.scheduler, "add_request", spy)
    ns = CacheNamespaces(SECRET)
    public_ids = tc.core.loaded.tokenizer.encode(PUBLIC_TEXT)
    num_public = len(public_ids) // BLOCK_SIZE
    assert num_public >= 2

    async def scenario() -> None:
        app = build_app(tc.client(), ServerConfig([MODEL], api=_api(tmp_path)))
        # The app's own lifespan on this thread's loop (it installs a SIGHUP
        # handler for the key file, which only the main thread may).
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://kvferry.test", timeout=60) as http:
            # The operator's prefix was prefilled at start-up, by the one
            # request that writes public blocks.
            (declaration,) = received.values()
            assert declaration == CacheScope(ns.tenant(""), ns.public, num_public, writes_public=True)

            # Completions: a prompt that begins with the public prefix.
            received.clear()
            body = await _post(http, "/v1/completions", "sk-acme", {"prompt": public_ids + TAIL, "max_tokens": 1})
            (scope,) = received.values()
            assert scope == CacheScope(ns.tenant("acme"), ns.public, num_public, quota_blocks=40,
                                       tenant="acme", tenant_weight=3.0)
            # ... and the core ran it in that scope: it read the public blocks.
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == num_public * BLOCK_SIZE
            r = await http.get("/v1/kv/stats", headers={"Authorization": "Bearer sk-ops"})
            acme = r.json()["tenants"]["acme"]
            assert acme["prefix_cache_hits_public"] == num_public * BLOCK_SIZE
            assert acme["prefix_cache_queries"] == len(public_ids) + len(TAIL)

            # Chat, n = 2: each sequence carries the scope; the cache salt narrows the namespace.
            received.clear()
            await _post(http, "/v1/chat/completions", "sk-beta", {
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "n": 2, "cache_salt": "s1"})
            assert len(received) == 2
            assert set(received.values()) == {CacheScope(ns.tenant("beta", "s1"), tenant="beta", tenant_weight=0.5)}

            # Responses.
            received.clear()
            await _post(http, "/v1/responses", "sk-beta", {"input": "Hello", "max_output_tokens": 1})
            (scope,) = received.values()
            assert scope == CacheScope(ns.tenant("beta"), tenant="beta", tenant_weight=0.5)

    try:
        asyncio.run(scenario())
    finally:
        tc.stop()


def test_offline_cache_namespace_is_honoured(loaded):
    config, model = loaded
    engine = LLMEngine(config, model)
    prompt = [3 + i % 300 for i in range(3 * BLOCK_SIZE + 1)]

    def cached(rid: str, namespace: str) -> int:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0), cache_namespace=namespace)
        while engine.has_unfinished_requests():
            finals = [out for out in engine.step() if out.finished]
            if finals:
                return finals[0].num_cached_tokens
        raise AssertionError("no output")

    assert cached("a1", "ns-a") == 0
    assert cached("b1", "ns-b") == 0  # another namespace shares nothing
    assert cached("a2", "ns-a") == 3 * BLOCK_SIZE
    # A namespace that a scope would overrule is refused, never dropped.
    with pytest.raises(ValueError, match="cache_namespace"):
        engine.input_processor.process("x", prompt, SamplingParams(), "ns-a", cache_scope=CacheScope("ns-b"))
