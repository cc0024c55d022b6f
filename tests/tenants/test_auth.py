"""API keys: 401 for a missing / unknown / malformed key, an open health
probe, /metrics for admin keys (or for anyone with --metrics-public, minus
the per-tenant series), and SIGHUP reloading the key file."""
from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest

from tests.tenants.conftest import KEYS, make_client

MODEL = "SmolLM2-135M-Instruct"


def test_missing_and_wrong_keys_are_401(tenant_server):
    for key in ("sk-nope", "sk-acme-1x", "sk-acme-"):
        with make_client(tenant_server, key) as c, pytest.raises(openai.AuthenticationError) as err:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert err.value.status_code == 401
        assert err.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{tenant_server.api_url}/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]


@pytest.mark.parametrize("header", ["Basic sk-acme-1", "Bearer", "Bearer sk-acme-1 extra", "sk-acme-1", "bearer\tsk-acme-1"])
def test_malformed_authorization_is_401(tenant_server, header):
    r = httpx.get(f"{tenant_server.api_url}/models", headers={"Authorization": header})
    assert r.status_code == 401
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def _metrics(server, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.base_url}/metrics", headers=headers, timeout=10)


def test_health_stays_open_and_metrics_need_an_admin_key(tenant_server):
    assert httpx.get(f"{tenant_server.base_url}/health").status_code == 200
    # /metrics names tenants and their traffic: no key or a wrong one is a
    # 401, a tenant's key a 403, an admin's key gets the exposition.
    for key in (None, "sk-nope"):
        r = _metrics(tenant_server, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = _metrics(tenant_server, "sk-beta-1")
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text
    r = _metrics(tenant_server, "sk-root")
    assert r.status_code == 200 and "kvferry:num_requests_running" in r.text
    assert httpx.get(f"{tenant_server.api_url}/models").status_code == 401
    ok = httpx.get(f"{tenant_server.api_url}/models", headers={"Authorization": "Bearer sk-beta-1"})
    assert ok.status_code == 200


def test_sighup_reloads_the_key_file(tenant_server):
    def status(key: str) -> int:
        return httpx.get(f"{tenant_server.api_url}/models", headers={"Authorization": f"Bearer {key}"}).status_code

    assert status("sk-gamma-1") == 401
    new_keys = {k: v for k, v in KEYS.items() if k != "sk-acme-2"} | {"sk-gamma-1": {"tenant": "gamma"}}
    try:
        tenant_server.keys_path.write_text(json.dumps(new_keys))
        tenant_server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while status("sk-gamma-1") != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status("sk-gamma-1") == 200 and status("sk-acme-2") == 401 and status("sk-acme-1") == 200
        # A broken file is refused and the keys in force stay.
        tenant_server.keys_path.write_text("{not json")
        tenant_server.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert status("sk-gamma-1") == 200
        assert "kept the previous API keys" in tenant_server.log()
    finally:
        tenant_server.keys_path.write_text(json.dumps(KEYS))
        tenant_server.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
    assert status("sk-acme-2") == 200


def test_public_metrics_leave_tenant_series_to_admins(tmp_path):
    """--metrics-public opens /metrics to any scraper, but a sample with a
    tenant label (whose traffic, cache hits, acceptance) reaches admin keys only."""
    from tests.serve.server_process import start_server
    from tests.tiny_models import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "tiny", arch="llama", max_position_embeddings=4096)
    (tmp_path / "keys.json").write_text(json.dumps(KEYS))
    srv = start_server(tmp_path / "server.log", ["--model", str(tiny), "--api-keys", str(tmp_path / "keys.json"),
                                                 "--metrics-tenant-labels", "--metrics-public"])
    try:
        model = httpx.get(f"{srv.api_url}/models", headers={"Authorization": "Bearer sk-acme-1"},
                          timeout=10).json()["data"][0]["id"]
        with make_client(srv, "sk-acme-1") as acme:
            acme.completions.create(model=model, prompt="hello there", max_tokens=3, extra_body={"ignore_eos": True})
        admin = _metrics(srv, "sk-root")
        assert admin.status_code == 200 and 'tenant="acme"' in admin.text, admin.text
        for key in (None, "sk-beta-1", "sk-nope"):
            r = _metrics(srv, key)
            assert r.status_code == 200, r.text
            assert "tenant=" not in r.text and "acme" not in r.text, r.text
            # The series without a tenant label stay (engine state, speculation counters).
            assert "kvferry:num_requests_running" in r.text and "kvferry:spec_decode_num_drafts" in r.text
        assert srv.stop() == 0, srv.log()[-3000:]
    finally:
        srv.stop(signal.SIGKILL)


@pytest.mark.parametrize("content, message", [
    ('{"sk-x": {"tenant": ""}}', "tenant: must be a non-empty string"),
    ('{"sk-x": {"tenant": "a", "quota": {"device_blocks": -1}}}', "quota.device_blocks"),
    ("[]", "non-empty JSON object"),
])
def test_bad_key_file_fails_start_up_before_the_model_loads(tmp_path, content, message):
    import subprocess
    import sys

    path = tmp_path / "keys.json"
    path.write_text(content)
    r = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", "--api-keys", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_stored_responses_belong_to_their_tenant(tenant_server):
    acme, acme2, beta = (make_client(tenant_server, k) for k in ("sk-acme-1", "sk-acme-2", "sk-beta-1"))
    first = acme.responses.create(model="SmolLM2-135M-Instruct", input="Say hi.", max_output_tokens=4, store=True)
    # The same tenant under another key continues and reads it.
    follow = acme2.responses.create(model="SmolLM2-135M-Instruct", input="Again.", max_output_tokens=4,
                                    previous_response_id=first.id)
    assert acme2.responses.retrieve(first.id).id == first.id and follow.id != first.id
    # Another tenant cannot read, continue or delete it: the id reads as unknown.
    for attempt in (lambda: beta.responses.retrieve(first.id),
                    lambda: beta.responses.delete(first.id),
                    lambda: beta.responses.create(model="SmolLM2-135M-Instruct", input="x", max_output_tokens=2,
                                                  previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert acme.responses.retrieve(first.id).id == first.id  # beta's delete did nothing


def test_key_file_carries_the_kv_store_tier_quotas(tmp_path):
    from kvferry.kvstore.process import tenant_quotas_gb
    from kvferry.serve.tenants import ApiKeys

    path = tmp_path / "keys.json"
    path.write_text('{"sk-a": {"tenant": "a", "quota": {"device_blocks": 4, "dram_gb": 1.5, "disk_gb": 10}}}')
    assert ApiKeys(path).num_keys == 1
    assert tenant_quotas_gb(path, "dram_gb") == {"a": 1.5} and tenant_quotas_gb(path, "disk_gb") == {"a": 10.0}
    path.write_text('{"sk-a": {"tenant": "a", "quota": {"dram_gb": -1}}}')
    with pytest.raises(ValueError, match="quota.dram_gb"):
        ApiKeys(path)
