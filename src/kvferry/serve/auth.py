"""API-key authentication: ``Authorization: Bearer KEY`` -> the caller's Tenant.

An ASGI middleware in front of every route but the open ones (``/health``
and ``/version``: probes and deploy checks carry no key; ``/metrics``, which checks keys itself, see
``metrics_access``). A missing, malformed or unknown key is a 401 with an
OpenAI-style body; the request never reaches a handler. Without a key file
every caller is the one default tenant.

``/metrics`` with API keys is an admin key's (no key or a wrong one: 401;
a tenant's key: 403), unless ``--metrics-public`` opens it to any scraper;
either way only an admin key gets the series labelled by tenant (another
tenant's traffic, cache hits and evictions are not a tenant's to read).
"""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from kvferry.serve.errors import APIError, error_response
from kvferry.serve.tenants import ApiKeys, current_tenant

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys | None, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.keys is None or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        key, problem = bearer_key(scope["headers"])
        tenant = self.keys.authenticate(key) if key is not None else None
        if tenant is None:
            message = problem or "incorrect API key provided"
            await error_response(401, message, code="invalid_api_key")(scope, receive, send)
            return
        token = current_tenant.set(tenant)
        try:
            await self.app(scope, receive, send)
        finally:
            current_tenant.reset(token)


def metrics_access(keys: ApiKeys | None, headers: list[tuple[bytes, bytes]], public: bool) -> bool:
    """Whether this /metrics caller sees the per-tenant series. Without keys
    there is one tenant: everything. Raises APIError 401 (no or a wrong
    key) or 403 (not an admin's) unless ``public``, where such a caller gets
    the series without a tenant label."""
    if keys is None:
        return True
    key, problem = bearer_key(headers)
    tenant = keys.authenticate(key) if key is not None else None
    if tenant is not None and tenant.admin:
        return True
    if public:
        return False
    if tenant is None:
        raise APIError(401, problem or "incorrect API key provided", code="invalid_api_key")
    raise APIError(403, "this API key may not read /metrics (an admin key may; see --metrics-public)",
                   code="permission_denied")


def bearer_key(headers: list[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    """The key of the Authorization header, or None and why not."""
    values = [v for k, v in headers if k == b"authorization"]
    if not values:
        return None, "missing API key: send 'Authorization: Bearer KEY'"
    if len(values) > 1:
        return None, "malformed Authorization header: sent more than once"
    scheme, _, key = values[0].decode("latin-1").strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key or any(c.isspace() for c in key):
        return None, "malformed Authorization header: expected 'Bearer KEY'"
    return key, None
