"""Private prompts never hit across tenants; declared public prefixes do,
and only for the blocks wholly inside them. Greedy outputs do not depend on
where (or whether) a prefix hit."""
from __future__ import annotations

import uuid

import httpx

from tests.tenants.conftest import BLOCK_SIZE, PUBLIC_TEXT


def unique_prompt(words: int = 60) -> str:
    """A prompt no one has sent (a fresh random tag in every sentence)."""
    tag = uuid.uuid4().hex[:8]
    return " ".join(f"Item {i} of batch {tag} is a widget." for i in range(words // 6)) + " Summary:"


def cached(client, prompt: str, max_tokens: int = 4) -> tuple[int, str, int]:
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=max_tokens,
                                  temperature=0)
    return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text, r.usage.prompt_tokens


def test_private_prompt_never_hits_across_tenants(acme, acme2, beta):
    prompt = unique_prompt()
    first, _, n = cached(acme, prompt)
    assert first == 0 and n > 3 * BLOCK_SIZE
    assert cached(beta, prompt)[0] == 0  # another tenant: nothing
    again, _, _ = cached(acme, prompt)
    assert again == (n - 1) // BLOCK_SIZE * BLOCK_SIZE  # the owner: every full block but the last token's
    assert cached(acme2, prompt)[0] == again  # the same tenant under another key
    assert cached(beta, prompt)[0] == again  # beta's own copy from its first request, not acme's


def test_cache_salt_narrows_a_tenants_namespace(acme, acme2, beta):
    prompt = unique_prompt()

    def salted(client, salt):
        r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"cache_salt": salt} if salt else None)
        return r.usage.prompt_tokens_details.cached_tokens

    assert salted(acme, "s1") == 0
    assert salted(acme, None) == 0  # unsalted: another namespace of the same tenant
    assert salted(acme2, "s2") == 0  # another salt: another namespace
    assert salted(beta, "s1") == 0  # the same salt in another tenant: never widened
    assert salted(acme2, "s1") > 0  # the same salt within the tenant hits


def test_public_prefix_hits_across_tenants_and_stops_at_the_boundary(acme, beta, tenant_server):
    num_prefix_tokens = _register(tenant_server, "sk-acme-1", PUBLIC_TEXT)["num_tokens"]
    public_tokens = num_prefix_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert public_tokens >= 2 * BLOCK_SIZE
    prompt_a = PUBLIC_TEXT + unique_prompt()
    cached_a, _, n = cached(acme, prompt_a)
    assert cached_a in (0, public_tokens)  # 0 unless an earlier test warmed the public blocks
    # beta sends acme's exact prompt: only the public blocks hit, not acme's private tail.
    assert cached(beta, prompt_a)[0] == public_tokens
    assert n > num_prefix_tokens + 2 * BLOCK_SIZE
    # and beta's own repeat now hits its private tail too.
    assert cached(beta, prompt_a)[0] == (n - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_greedy_output_is_the_same_cold_public_and_private(acme, beta):
    prompt = PUBLIC_TEXT + unique_prompt()
    # Cold for acme's private blocks, public hit for the prefix (or cold, first time).
    c1, text1, n = cached(acme, prompt, 12)
    c2, text2, _ = cached(beta, prompt, 12)  # public hit only
    c3, text3, _ = cached(acme, prompt, 12)  # full private hit
    assert c2 < c3 == (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert text1 == text2 == text3 and text1


def test_cold_output_matches_a_hit(acme, acme2):
    # A prompt outside the public prefix: the first request computes all of it.
    prompt = unique_prompt(90)
    c1, text1, _ = cached(acme, prompt, 12)
    c2, text2, _ = cached(acme2, prompt, 12)
    assert c1 == 0 < c2 and text1 == text2


def test_chat_prefix_registered_through_the_api_is_shared(acme, beta, tenant_server):
    system = {"role": "system", "content": "You answer questions about the tides of the " + uuid.uuid4().hex
              + " bay. " + "Tides rise and fall twice a day. " * 6}
    body = _register(tenant_server, "sk-acme-1", [system])
    assert body["num_blocks"] == body["num_tokens"] // BLOCK_SIZE >= 2 and body["new"]
    assert _register(tenant_server, "sk-acme-1", [system])["new"] is False

    def ask(client, question: str) -> int:
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2, temperature=0,
                                           messages=[system, {"role": "user", "content": question}])
        return r.usage.prompt_tokens_details.cached_tokens

    # The declaration prefilled the prefix: every tenant reads it at once,
    # the publisher included.
    assert ask(acme, "When is high tide? " + uuid.uuid4().hex) == body["num_blocks"] * BLOCK_SIZE
    assert ask(beta, "Why are there two tides? " + uuid.uuid4().hex) == body["num_blocks"] * BLOCK_SIZE


def test_publish_needs_permission_and_bad_bodies_are_400(tenant_server):
    url = f"{tenant_server.base_url}/v1/kv/public_prefixes"
    r = httpx.post(url, json={"prefix": "anything"}, headers={"Authorization": "Bearer sk-beta-1"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    for body in ({"prefix": ""}, {"prefix": [{"role": "user"}]}, {"nope": 1}, [1]):
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer sk-acme-1"})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == "prefix"


def _register(server, key: str, prefix) -> dict:
    r = httpx.post(f"{server.base_url}/v1/kv/public_prefixes", json={"prefix": prefix},
                   headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_hits_are_split_by_scope_in_metrics_and_per_tenant_stats(acme, beta, tenant_server):
    def scoped() -> tuple[float, float]:
        return (tenant_server.metric("kvferry:prefix_cache_hits_total", scope="private"),
                tenant_server.metric("kvferry:prefix_cache_hits_total", scope="public"))

    def stats(key: str) -> dict:
        r = httpx.get(f"{tenant_server.base_url}/v1/kv/stats", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()["tenants"]

    num_public = _register(tenant_server, "sk-acme-1", PUBLIC_TEXT)["num_tokens"] // BLOCK_SIZE * BLOCK_SIZE
    prompt = PUBLIC_TEXT + unique_prompt()
    cached(acme, prompt)  # warms the public blocks (if not yet) and acme's tail
    private0, public0 = scoped()
    beta0 = stats("sk-beta-1")["beta"]
    assert cached(beta, prompt)[0] == num_public
    private1, public1 = scoped()
    assert (private1 - private0, public1 - public0) == (0, num_public)
    _, _, n = cached(beta, prompt)
    private2, public2 = scoped()
    assert (private2 - private1, public2 - public1) == ((n - 1) // BLOCK_SIZE * BLOCK_SIZE - num_public, num_public)
    beta1 = stats("sk-beta-1")
    assert set(beta1) == {"beta"}  # a tenant sees only itself
    assert beta1["beta"]["prefix_cache_hits_public"] - beta0["prefix_cache_hits_public"] == 2 * num_public
    assert beta1["beta"]["prefix_cache_queries"] - beta0["prefix_cache_queries"] == 2 * n
    assert {"acme", "beta"} <= set(stats("sk-root"))  # an admin sees every tenant


def test_device_quota_caps_what_a_tenant_caches(tenant_server):
    from tests.tenants.conftest import make_client

    prompt = unique_prompt()
    with make_client(tenant_server, "sk-tiny-1") as tiny:
        assert cached(tiny, prompt)[0] == 0
        assert cached(tiny, prompt)[0] == 2 * BLOCK_SIZE  # only the quota's two blocks were cached
    r = httpx.get(f"{tenant_server.base_url}/v1/kv/stats", headers={"Authorization": "Bearer sk-tiny-1"})
    stats = r.json()["tenants"]["tiny"]
    assert stats["cached_blocks"] == 2 and stats["quota_refused_blocks"] >= 2
