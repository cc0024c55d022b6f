"""P/D across tensor-parallel layouts with every lever on: a real
``kvferry serve --mode disagg --prefill-tp A --decode-tp B`` with a node KV
store (DRAM and disk tiers), API keys with tenants and a declared public
prefix, through the openai client. At prefill TP 2 / decode TP 1 and prefill
TP 1 / decode TP 2 the greedy text equals colocated serving at TP 1 (the
offline LLM), whether a prompt's blocks came from the public pool, the
tenant's own device cache, or the store after the device pools forgot them;
a tenant's private prefix never serves another tenant, neither from a
device pool nor from a tier."""
from __future__ import annotations

import json
import uuid
from functools import partial

import openai
import pytest

from kvferry import LLM, SamplingParams
from tests.parallel.afd_helpers import servers_at_once
from tests.serve.server_process import start_server
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 6
BLOCK = 16
KEYS = {"sk-acme": {"tenant": "acme", "publish": True}, "sk-beta": {"tenant": "beta"},
        "sk-root": {"tenant": "ops", "admin": True}}
PUBLIC = "You are the support assistant of Example Corp. Answer briefly and politely.\n"
LAYOUTS = [(2, 1), (1, 2)]


def _private(tag: str) -> str:
    return " ".join(f"Item {i} of batch {tag} is a widget." for i in range(3)) + " Summary:"


# Fixed texts (the expected outputs are computed once, colocated): a public
# one, a private one per layout, and the prompts that flood the device pools.
TAGS = {layout: uuid.uuid4().hex[:8] for layout in LAYOUTS}
PROMPTS = [PUBLIC + _private("tail"), *(_private(t) for t in TAGS.values())]
FLOOD = [_private(f"flood{i}") for i in range(10)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("pd-levers"), arch="llama", num_attention_heads=8,
                                    num_key_value_heads=4, max_position_embeddings=1024))


def _expected(checkpoint: str) -> dict[str, str]:
    """Colocated TP 1's greedy text of each prompt (no store, no tenants)."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    llm = LLM(model=checkpoint, dtype="float32", kv_cache_memory_gb=0.02, warm_up=False)
    try:
        return {p: r.outputs[0].text for p, r in zip(PROMPTS, llm.generate(PROMPTS, params))}
    finally:
        llm.engine.core.close()


def _start(checkpoint: str, d, prefill_tp: int, decode_tp: int):  # noqa: ANN001, ANN202 - a ServerProcess
    (d / "keys.json").write_text(json.dumps(KEYS))
    (d / "secret").write_bytes(b"0123456789abcdef0123456789abcdef")
    (d / "public.json").write_text(json.dumps([PUBLIC]))
    # 32 blocks a pool: the flood below evicts every earlier prompt's blocks.
    srv = start_server(d / "server.log", [
        "--model", checkpoint, "--dtype", "float32", "--mode", "disagg", "--prefill", "1", "--decode", "1",
        "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), "--cpu-threads-per-rank", "1",
        "--num-kv-blocks", "32", "--block-size", str(BLOCK), "--max-model-len", "256",
        "--kv-dram-gb", "0.05", "--kv-disk", str(d / "disk"), "--kv-disk-gb", "0.1",
        "--api-keys", str(d / "keys.json"), "--cache-secret-file", str(d / "secret"),
        "--public-prefixes", str(d / "public.json"),
        "--kv-transfer-failure", "fail", "--engine-heartbeat-timeout", "120"])
    srv.metrics_key = "sk-root"  # /metrics is an admin key's
    return srv


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    """Both layouts' servers, started at once while the colocated reference runs."""
    dirs = {layout: tmp_path_factory.mktemp(f"pd-levers-{layout[0]}-{layout[1]}") for layout in LAYOUTS}
    starts = {layout: partial(_start, checkpoint, dirs[layout], *layout) for layout in LAYOUTS}
    with servers_at_once(starts, meanwhile=partial(_expected, checkpoint)) as both:
        yield both


@pytest.fixture(scope="module")
def expected(servers) -> dict[str, str]:
    return servers[1]


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda x: f"p{x[0]}-d{x[1]}")
def pd(request, servers):
    return request.param, servers[0][request.param]


def _complete(srv, key: str, prompt: str) -> tuple[str, int, int]:
    """(text, cached prompt tokens, prompt tokens)."""
    with openai.OpenAI(base_url=srv.api_url, api_key=key, max_retries=0, timeout=300) as client:
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_NEW
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


def _loaded_tokens(srv) -> float:
    """Prompt tokens the cores loaded from the KV store (both pools)."""
    return sum(v for (name, _), v in srv.metrics().items() if name.startswith("kvferry:kv_store_loaded_tokens"))


def test_public_prefix_serves_every_tenant_with_colocated_output(pd, expected):
    _, srv = pd
    prompt = PROMPTS[0]
    text, cached, n = _complete(srv, "sk-beta", prompt)  # beta's first request: the public blocks hit
    assert text == expected[prompt]
    assert cached >= 2 * BLOCK and cached < n, (cached, n)
    assert _complete(srv, "sk-acme", prompt)[0] == expected[prompt]


def test_private_prefix_and_tiers_keep_colocated_output(pd, expected):
    layout, srv = pd
    prompt = _private(TAGS[layout])
    text, cached, n = _complete(srv, "sk-acme", prompt)
    assert (text, cached) == (expected[prompt], 0)
    full = (n - 1) // BLOCK * BLOCK
    text, cached, _ = _complete(srv, "sk-acme", prompt)  # acme's own device cache
    assert (text, cached) == (expected[prompt], full)
    # acme's other prompts make the device pools forget these blocks (fair
    # eviction takes the tenant most over its share first); the store keeps them.
    for flood in FLOOD:
        _complete(srv, "sk-acme", flood)
    loaded = _loaded_tokens(srv)
    text, cached, _ = _complete(srv, "sk-acme", prompt)
    # Every full block from a tier, whole: every rank's heads, gathered by
    # the layout that wrote it and split by the one that loads it; and the
    # client is told so, as a colocated core tells it (the prefill core's
    # load, not the decode core's empty device hit).
    assert (text, cached) == (expected[prompt], full)
    assert _loaded_tokens(srv) == loaded + full
    # Another tenant finds acme's blocks in neither a device pool nor a tier.
    text, cached, _ = _complete(srv, "sk-beta", prompt)
    assert (text, cached) == (expected[prompt], 0)
    assert _loaded_tokens(srv) == loaded + full
    log = srv.log()
    assert "KV transfer failed" not in log and "Traceback" not in log, log[-3000:]
