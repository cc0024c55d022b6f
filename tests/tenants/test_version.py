"""GET /version, as vLLM's: the installed package's version, open like
/health on a server whose other routes need an API key."""
from __future__ import annotations

from importlib import metadata

import httpx


def test_version_is_the_package_version_and_needs_no_key(tenant_server):
    for headers in ({}, {"Authorization": "Bearer sk-nope"}, {"Authorization": "Bearer sk-beta-1"}):
        r = httpx.get(f"{tenant_server.base_url}/version", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json() == {"version": metadata.version("kvferry")}
    # The server does check keys: a neighbouring route without one is refused.
    assert httpx.get(f"{tenant_server.api_url}/models", timeout=10).status_code == 401
    assert httpx.post(f"{tenant_server.base_url}/version", timeout=10).status_code == 405
