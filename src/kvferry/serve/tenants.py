"""Tenants: who a caller is (from an API key) and which cache namespace
that makes.

    ApiKeys.load(path)            the --api-keys file, validated
    keys.authenticate(key)        -> Tenant | None (constant time over all keys)
    CacheNamespaces(secret)       tenant -> namespace = HMAC(secret, tenant)

The key file is a JSON object mapping each key to its tenant::

    {"sk-acme-1": {"tenant": "acme", "publish": true, "admin": false,
                   "quota": {"device_blocks": 800}, "weight": 2}}

Namespaces are derived on the server from the tenant alone, so nothing a
client sends can name another tenant's cache. The secret makes them
unguessable (a namespace never leaves the server, but KV events and logs
carry it as the block owner).
"""
from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TENANT_NAME = "default"
MAX_TENANT_WEIGHT = 1e6
_TENANT_FIELDS = {"tenant", "publish", "admin", "quota", "weight"}
# dram_gb / disk_gb: the node KV store's per-tier quotas (read by ``kvferry kvstore``).
_QUOTA_FIELDS = {"device_blocks", "dram_gb", "disk_gb"}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    publish: bool = False  # may register public prefixes
    admin: bool = False
    quota_device_blocks: int | None = None  # None: no cap
    # Share of the engine in fair admission and preemption, relative to the
    # other tenants' (core/fairness.py); one value per tenant.
    weight: float = 1.0


# The tenant of the HTTP request being served, as the auth middleware
# authenticated it (the default tenant without a key file). Only the route
# modules read it, once per request; everything below them gets the Tenant
# (or the Caller) as an argument.
current_tenant: contextvars.ContextVar[Tenant] = contextvars.ContextVar(
    "kvferry_tenant", default=Tenant(DEFAULT_TENANT_NAME, publish=True))


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent one generation request: the tenant of its API key, and the
    cache salt its body asked for (narrows the tenant's namespace, never
    widens it). The cache policy turns it and the prompt into the request's
    CacheScope (serve/public_prefixes.py)."""

    tenant: Tenant
    cache_salt: str | None = None


class ApiKeys:
    """The key -> tenant table of a key file; ``reload()`` swaps it whole
    (SIGHUP), so a request sees either the old table or the new one.

    ``plain_keys`` (``--api-key KEY``, vLLM's flag) are keys of the one
    default tenant, as a server without keys has: they authenticate and
    nothing else (no admin, no quota), and a reload keeps them."""

    def __init__(self, path: str | Path | None, plain_keys: "list[str] | tuple[str, ...]" = ()) -> None:
        self.path = Path(path) if path is not None else None
        self._plain = [(_check_plain_key(k), Tenant(DEFAULT_TENANT_NAME, publish=True)) for k in plain_keys]
        self._table: list[tuple[bytes, Tenant]] = self._read()
        self._lock = threading.Lock()

    def _read(self) -> list[tuple[bytes, Tenant]]:
        return (parse_key_file(self.path) if self.path is not None else []) + self._plain

    @property
    def num_keys(self) -> int:
        return len(self._table)

    def reload(self) -> None:
        """Read the file again; on any error the old table stays and the
        error (a ValueError naming the field) propagates."""
        table = self._read()
        with self._lock:
            self._table = table

    def tenant_names(self) -> set[str]:
        return {tenant.name for _, tenant in self._table}

    def authenticate(self, key: str) -> Tenant | None:
        """The key's tenant, or None. Compares against every key with
        ``hmac.compare_digest`` and never stops early, so the time taken
        does not tell how close a guess came or which entry matched."""
        given = key.encode("utf-8", "surrogateescape")
        found = None
        for known, tenant in self._table:
            if hmac.compare_digest(given, known) and found is None:
                found = tenant
        return found


def parse_key_file(path: Path) -> list[tuple[bytes, Tenant]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"api_keys: cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"api_keys: {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError("api_keys: the file must hold a non-empty JSON object mapping key -> tenant")
    return [(key.encode("utf-8"), _parse_tenant(key, entry)) for key, entry in data.items()]


def _parse_tenant(key: str, entry: object) -> Tenant:
    where = f"api_keys[{_redact(key)}]"
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"{where}: a key must be non-empty and hold no whitespace")
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be an object with a 'tenant' field")
    unknown = set(entry) - _TENANT_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    name = entry.get("tenant")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.tenant: must be a non-empty string")
    for flag in ("publish", "admin"):
        if not isinstance(entry.get(flag, False), bool):
            raise ValueError(f"{where}.{flag}: must be true or false")
    quota = entry.get("quota", {})
    if not isinstance(quota, dict) or set(quota) - _QUOTA_FIELDS:
        raise ValueError(f"{where}.quota: must be an object with only {sorted(_QUOTA_FIELDS)}")
    blocks = quota.get("device_blocks")
    if blocks is not None and (not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0):
        raise ValueError(f"{where}.quota.device_blocks: must be an integer >= 0")
    for tier in ("dram_gb", "disk_gb"):
        gb = quota.get(tier)
        if gb is not None and (not isinstance(gb, (int, float)) or isinstance(gb, bool) or not gb >= 0):
            raise ValueError(f"{where}.quota.{tier}: must be a number >= 0")
    weight = entry.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_TENANT_WEIGHT:
        raise ValueError(f"{where}.weight: must be a number in (0, {MAX_TENANT_WEIGHT}]")
    return Tenant(name, entry.get("publish", False), entry.get("admin", False), blocks, float(weight))


def _check_plain_key(key: str) -> bytes:
    if not isinstance(key, str) or not key or any(c.isspace() for c in key):
        raise ValueError("api_key: a key must be non-empty and hold no whitespace")
    return key.encode("utf-8")


def _redact(key: str) -> str:
    """Enough of a key to find it in the file, not enough to use it."""
    return repr(key[:4] + "…") if len(key) > 8 else "'…'"


class CacheNamespaces:
    """Namespaces keyed by a server secret: HMAC-SHA256(secret, label).

    ``tenant(name)`` is private to that tenant; ``public`` is shared by all
    (only declared public prefixes are hashed in it); ``salt`` narrows a
    tenant's namespace (a client's cache_salt) and can never widen it."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        if len(self._secret) < 16:
            raise ValueError("cache_secret: must hold at least 16 bytes")
        self.public = self._derive(b"public")

    @classmethod
    def from_file(cls, path: str | Path | None) -> "CacheNamespaces":
        """The secret from a file (stable across restarts, shared by the
        servers of a fleet), or a fresh one per start when no file is given."""
        if path is None:
            return cls()
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"cache_secret_file: cannot read {path}: {exc.strerror or exc}") from None
        return cls(secret)

    def tenant(self, name: str, salt: str | None = None) -> str:
        ns = self._derive(b"tenant\0" + name.encode())
        if salt:
            ns = hashlib.sha256(b"salt\0" + ns.encode() + b"\0" + salt.encode()).hexdigest()
        return ns

    def split_stats(self, by_owner: dict[str, list[int]]) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """The core's per-owner prefix-cache counters (owners are tenant
        names, and the public namespace for the public pool) as named
        fields: (per tenant, public pool)."""
        tenants = {owner: dict(zip(TENANT_STAT_FIELDS, counts)) for owner, counts in by_owner.items()
                   if owner != self.public}
        public = dict(zip(TENANT_STAT_FIELDS, by_owner.get(self.public, ()))) or empty_tenant_stats()
        return tenants, public

    def _derive(self, label: bytes) -> str:
        return hmac.new(self._secret, label, hashlib.sha256).hexdigest()


# The columns of the core's per-owner stats (kv_manager.OWNER_STAT_FIELDS), named for the API.
TENANT_STAT_FIELDS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hits_public",
                      "quota_refused_blocks", "evicted_blocks", "cached_blocks")


def empty_tenant_stats() -> dict[str, int]:
    return dict.fromkeys(TENANT_STAT_FIELDS, 0)


def add_tier_hit_rates(by_tenant: dict[str, dict], tier_tenants: dict[str, dict[str, list[int]]],
                       store_up: bool = True) -> None:
    """Put each tenant's per-tier [hits, misses] of the KV store into its
    /v1/kv/stats entry as ``kv_tiers: {tier: {hits, misses, hit_rate}}``.
    None while the server's node store is not ok (restarting or down), as
    /metrics does: the cores' last report is then a dead store's counts,
    and a new store counts from 0."""
    if not store_up:
        return
    for tier, tenants in tier_tenants.items():
        for tenant, (hits, misses) in tenants.items():
            entry = by_tenant.setdefault(tenant, empty_tenant_stats())
            entry.setdefault("kv_tiers", {})[tier] = {
                "hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 0.0}
