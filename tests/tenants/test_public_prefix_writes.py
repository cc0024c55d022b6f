"""Public blocks are written only by their declaration, through a real server.

The probe this closes: a tenant with publish rights declared ten versions of
another tenant's prompt, one per candidate PIN; the victim's request wrote
its blocks in the public namespace because they matched a declaration, so
the right candidate then hit 16 more tokens than the wrong ones. Now a
declaration prefills itself, readers never write public blocks, and every
candidate looks alike, in cached_tokens and in time.
"""
from __future__ import annotations

import json
import statistics
import time
import uuid

import httpx

from tests.tenants.conftest import BLOCK_SIZE, make_client

MODEL = "SmolLM2-135M-Instruct"
# The probe declared ten; four check the same (the leak shows on the right
# candidate against any wrong one: the right one, the timed wrong one and two
# more). Each DELETE drops only its declaration's own blocks (kv_routes.py)
# and prefills nothing again.
CANDIDATES = 4
FIRST_OFFSET = -2  # the candidates: pin - 2 .. pin + 1, the right one and the timed wrong one among them
# Each round checks every candidate's hits (deterministic: one round finds
# the leak) and alternates which prompt the attacker times first. The
# timing check compares medians: a leak makes the right candidate a cache
# hit (~5 of ~125 prompt tokens computed), several times faster than the
# wrong one; a Mann-Whitney test would need 7+ rounds of 23 requests each
# to be able to fail at p <= 0.001.
ROUNDS = 3
LEAK_RATIO = 0.6  # right's median below this share of wrong's: the hit shows in the timing


def secret_text(tag: str, pin: int) -> str:
    # ~120 tokens of which the last few hold the PIN, all unique to the tag.
    body = " ".join(f"Account {tag} note {i}: transfer approved by the desk." for i in range(10))
    return f"{body} The PIN of account {tag} is {pin:04d}"


def declare(server, key: str, prefix) -> dict:
    r = httpx.post(f"{server.base_url}/v1/kv/public_prefixes", json={"prefix": prefix},
                   headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def delete(server, key: str, prefix_id: str) -> httpx.Response:
    return httpx.delete(f"{server.base_url}/v1/kv/public_prefixes/{prefix_id}",
                        headers={"Authorization": f"Bearer {key}"}, timeout=60)


def timed(client, prompt: str) -> tuple[float, int]:
    start = time.perf_counter()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    return time.perf_counter() - start, r.usage.prompt_tokens_details.cached_tokens


def test_a_publisher_cannot_tell_which_candidate_another_tenant_sent(tenant_server):
    right_s, wrong_s = [], []
    with make_client(tenant_server, "sk-acme-1") as attacker, make_client(tenant_server, "sk-beta-1") as victim:
        for round_ in range(ROUNDS):
            tag, pin = uuid.uuid4().hex[:8], 1000 + round_ * 7
            victim_prompt = secret_text(tag, pin)
            timed(victim, victim_prompt)
            ids, hits = [], []
            for guess in range(pin + FIRST_OFFSET, pin + FIRST_OFFSET + CANDIDATES):
                ids.append(declare(tenant_server, "sk-acme-1", secret_text(tag, guess))["id"])
            assert declare(tenant_server, "sk-acme-1", secret_text(tag, pin))["new"] is False
            # The victim sends its prompt again: it reads the public blocks of
            # the matching declaration (or its own), and writes none.
            timed(victim, victim_prompt)
            wrong = secret_text(tag, pin + 1)
            order = [victim_prompt, wrong] if round_ % 2 else [wrong, victim_prompt]
            for prompt in order:
                seconds, cached_tokens = timed(attacker, prompt)
                hits.append(cached_tokens)
                (right_s if prompt == victim_prompt else wrong_s).append(seconds)
            for guess in range(pin + FIRST_OFFSET, pin + FIRST_OFFSET + CANDIDATES):
                if guess not in (pin, pin + 1):
                    hits.append(timed(attacker, secret_text(tag, guess))[1])
            assert len(set(hits)) == 1, hits  # every candidate alike
            for prefix_id in ids:
                assert delete(tenant_server, "sk-acme-1", prefix_id).status_code == 200
    print(f"medians: right {statistics.median(right_s):.4f} wrong {statistics.median(wrong_s):.4f} s")
    assert statistics.median(right_s) > LEAK_RATIO * statistics.median(wrong_s), (right_s, wrong_s)


def test_a_tenant_keeps_its_private_hits_after_a_declaration(tenant_server):
    # ops (no device quota: beta's may be full by now, and refused blocks
    # are not cached) is the tenant whose prompt a declaration matches.
    with make_client(tenant_server, "sk-root") as beta:
        prompt = secret_text(uuid.uuid4().hex[:8], 4242) + " and more words follow here."
        timed(beta, prompt)
        _, before = timed(beta, prompt)
        assert before >= 7 * BLOCK_SIZE
        declared = declare(tenant_server, "sk-acme-1", secret_text(prompt.split()[1], 4242)[:200])
        assert declared["prefilled"] and declared["num_blocks"] >= 1
        _, after = timed(beta, prompt)
        assert after >= before, (before, after)
        assert delete(tenant_server, "sk-acme-1", declared["id"]).status_code == 200
        _, after_delete = timed(beta, prompt)
        assert after_delete >= before, (before, after_delete)


def test_declarations_are_listed_and_deleted_by_their_owner_or_an_admin(tenant_server):
    text = "Shared guidance for every support conversation: " + " ".join(["be kind."] * 40)
    declared = declare(tenant_server, "sk-acme-1", text)
    url = f"{tenant_server.base_url}/v1/kv/public_prefixes"

    def listed(key: str) -> set[str]:
        r = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
        return {d["id"] for d in r.json()["data"]}

    assert declared["id"] in listed("sk-acme-1") and declared["id"] in listed("sk-root")
    assert declared["id"] not in listed("sk-beta-1")
    # Another tenant's declaration is as unknown as a made-up id.
    assert delete(tenant_server, "sk-beta-1", declared["id"]).status_code == 404
    assert delete(tenant_server, "sk-acme-1", "pp-nope").status_code == 404
    with make_client(tenant_server, "sk-beta-1") as beta:
        _, hit = timed(beta, text + " Question: " + uuid.uuid4().hex)
        assert hit == declared["num_blocks"] * BLOCK_SIZE
        assert delete(tenant_server, "sk-root", declared["id"]).status_code == 200
        assert declared["id"] not in listed("sk-root")
        # No declaration any more: a new tenant request is all private.
        _, hit = timed(beta, text + " Question: " + uuid.uuid4().hex)
        assert hit == 0


def test_operator_route_bodies_get_4xx_never_5xx(tenant_server):
    url = f"{tenant_server.base_url}/v1/kv/public_prefixes"
    auth = {"Authorization": "Bearer sk-acme-1", "Content-Type": "application/json"}
    admin = {"Authorization": "Bearer sk-root", "Content-Type": "application/json"}
    deep = b'{"prefix": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    surrogate = b'{"prefix": "\\ud800abc"}'
    for body in (deep, surrogate, b'{"prefix": 1}', b"[]", b"{", b'{"prefix": [{"role": "user", "content": 3}]}'):
        r = httpx.post(url, content=body, headers=auth, timeout=60)
        assert r.status_code == 400, (body[:40], r.text)
        assert r.json()["error"]["param"] == "prefix"
        for method in ("POST", "DELETE"):
            r = httpx.request(method, f"{tenant_server.base_url}/v1/admin/workers", content=body, headers=admin,
                              timeout=60)
            assert r.status_code == 400, (method, body[:40], r.text)
    # A body past the server's limit: 413 before it is tokenized.
    huge = json.dumps({"prefix": "word " * 2_000_000}).encode()
    r = httpx.post(url, content=huge, headers=auth, timeout=60)
    assert r.status_code == 413, r.text
    # A prefix longer than the context cannot be prefilled: 400 naming it.
    r = httpx.post(url, json={"prefix": "token " * 3000}, headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prefix", r.text
    assert httpx.get(f"{tenant_server.base_url}/health", timeout=10).status_code == 200


def test_a_restarted_core_gets_the_public_prefixes_again(tenant_server):
    """The pinned public blocks die with their core; the server prefills
    every declaration again once the new core is up (the last test of this
    file: it restarts the shared server's core)."""
    import os
    import signal

    from tests.serve.test_core_process import core_pid, wait_healthy

    text = "Standing instructions of the night shift: " + " ".join(["check the gauges."] * 30)
    declared = declare(tenant_server, "sk-acme-1", text)
    core = core_pid(tenant_server.proc.pid)
    os.kill(core, signal.SIGKILL)
    assert core_pid(tenant_server.proc.pid, timeout_s=180, other_than=core) != core
    assert wait_healthy(tenant_server.base_url, 180).status_code == 200, tenant_server.log()[-3000:]
    with make_client(tenant_server, "sk-beta-1") as beta:
        deadline = time.monotonic() + 60
        while True:
            _, hit = timed(beta, text + " Question: " + uuid.uuid4().hex)
            if hit == declared["num_blocks"] * BLOCK_SIZE or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert hit == declared["num_blocks"] * BLOCK_SIZE, tenant_server.log()[-3000:]
    assert delete(tenant_server, "sk-acme-1", declared["id"]).status_code == 200
