"""The remote KV tier on a Redis server, shared by every node that points
at it (``--kv-remote redis://host:port/db``).

Values::

    key   = prefix || block key                     (binary-safe)
    value = block_value.py's: header | tenant tag | MAC | payload
    tenant tag = ``crypto.tenant_tag`` of a private block's tenant (24
                 bytes; empty for a public block): no tenant name is ever
                 stored in Redis, in a key or in a value

Every value is authenticated under the cluster secret (private blocks
sealed with the tenant's key, ``kvferry.kvstore.crypto``; public ones with
a MAC), and read by ``shared_tier.py``'s rules: a value that fails is
deleted (quarantined, counted, logged) and is a miss; another tenant's
private block is a miss counted in ``auth_failures``. Without a secret the
tier is refused unless ``insecure`` (``--insecure-shared-tier``).
``prefix || "tenant:" || hex(tenant tag)`` is a set of that tenant's keys,
so that ``drop_tenant`` reaches blocks other nodes wrote (nodes with the
same secret agree on the tag).

Capacity and quotas are this node's view: what it wrote, in LRU order of
its own reads (``tenant_lru``); over them it deletes its own least recently
used blocks. The server's ``maxmemory`` policy bounds the shared whole; a
block it evicted is a plain miss here.

**Faults.** Any Redis error (refused connection, timeout, a server gone
mid-call) disables the tier (``shared_tier.OutageBreaker``): one warning
per outage, every call a miss or a refused write without touching the
network, and a retry after a backoff that doubles up to ``retry_max_s``.
The first call that succeeds logs (at INFO) that the tier is back. Nothing
raises out of ``put``/``get``.

**Other remote stores** (Mooncake Store, Valkey, S3) plug in at the same
seam: a ``ColdTier`` subclass (``kvferry.kvstore.tier``) with ``put``,
``get``/``get_many``, ``contains``, ``delete``, ``drop_tenant`` and
``stats``. Valkey speaks this protocol unchanged (a ``redis://`` URL to
it); Mooncake Store and S3 need only the five calls mapped to their
clients, keeping ``block_value.py``'s format and ``shared_tier.py``'s rules so
that every rule in ``tier.py`` holds the same way.
"""
from __future__ import annotations

import logging
import sys
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvferry.kvstore.block_value import encode_value
from kvferry.kvstore.crypto import TierCrypto, tenant_tag
from kvferry.kvstore.shared_tier import OutageBreaker, SharedTier, require_secret
from kvferry.kvstore.tenant_lru import TenantLRU, TierQuotas, pool_of
from kvferry.kvstore.tier import BlockOwner, TenantTierStats, TierStats

log = logging.getLogger(__name__)


class RedisTier(SharedTier):
    name = "remote"
    _log = log

    def __init__(self, url: str, *, crypto: TierCrypto | None = None, quotas: TierQuotas | None = None,
                 capacity_bytes: int | None = None, ttl_s: float | None = None, prefix: bytes = b"kvferry:kv:",
                 timeout_s: float = 1.0, retry_initial_s: float = 1.0, retry_max_s: float = 60.0,
                 insecure: bool = False) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url: must be redis://, rediss:// or unix://, got {url!r}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError("ttl_s: must be > 0 or None")
        if timeout_s <= 0 or retry_initial_s <= 0 or retry_max_s < retry_initial_s:
            raise ValueError("timeout_s, retry_initial_s, retry_max_s: must be > 0 and max >= initial")
        require_secret("kv_remote", crypto, insecure, log)  # not the URL: it may hold a password
        self.url = url
        self.crypto = crypto
        self.prefix = prefix
        self.ttl_ms = None if ttl_s is None else int(ttl_s * 1000)
        # No client-side retries: a failure is reported at once and the
        # tier's own backoff decides when to try again.
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0))
        self._lock = threading.Lock()
        self._lru = TenantLRU(sys.maxsize if capacity_bytes is None else capacity_bytes, quotas)
        self._stats = TierStats()
        self._breaker = OutageBreaker(f"remote KV tier {url}", retry_initial_s, retry_max_s, logger=log)

    # ---- writes -------------------------------------------------------

    def put(self, key: bytes, data: bytes | memoryview, owner: BlockOwner) -> bool:
        data = memoryview(data).cast("B")  # lengths in bytes, whatever the format
        pool = pool_of(owner)
        if not self._breaker.may_call():  # down: no sealing, no network
            with self._lock:
                self._refuse(pool)
            return False
        value = self._encode(key, data, owner)
        with self._lock:
            evicted, fits = self._lru.make_room(pool, len(value))
            if not fits:
                self._refuse(pool)
        if not fits and not evicted:
            return False
        try:
            pipe = self._redis.pipeline(transaction=False)
            if evicted:
                pipe.delete(*(self.prefix + k for k in evicted))
            if fits:
                pipe.set(self.prefix + key, value, px=self.ttl_ms)
                if not owner.public:
                    pipe.sadd(self._tenant_set(owner.tenant), key)
            pipe.execute()
        except redis.RedisError as exc:
            self._breaker.fail(exc)
            if fits:
                with self._lock:
                    self._refuse(pool)
            return False
        self._breaker.succeed()
        if fits:
            with self._lock:
                self._lru.add(key, pool, len(value))
                self._stats.bytes_written += len(data)
        return fits

    def _encode(self, key: bytes, data: bytes | memoryview, owner: BlockOwner) -> bytes:
        return encode_value(self.crypto, key, data, owner)

    def _refuse(self, pool: str) -> None:
        self._stats.refused_writes += 1
        self._lru.stats_of(pool).refused_writes += 1

    def _tenant_set(self, tenant: str) -> bytes:
        return self.prefix + b"tenant:" + tenant_tag(self.crypto, tenant).hex().encode()

    # ---- reads --------------------------------------------------------

    def get(self, key: bytes, owner: BlockOwner) -> bytes | None:
        return self.get_many([key], owner)[0]

    def get_many(self, keys: list[bytes], owner: BlockOwner) -> list[bytes | None]:
        start = time.perf_counter()
        values: list[bytes | None] = [None] * len(keys)
        if keys and self._breaker.may_call():
            try:
                values = self._redis.mget([self.prefix + k for k in keys])
            except redis.RedisError as exc:
                self._breaker.fail(exc)
            else:
                self._breaker.succeed()
        results = [None if v is None else self._decode(k, v, owner) for k, v in zip(keys, values)]
        self._count_reads(keys, results, pool_of(owner), time.perf_counter() - start)
        return results

    # shared_tier.SharedTier's hooks
    def _pool_stats(self, pool: str) -> TenantTierStats:
        return self._lru.stats_of(pool)

    def _remove_object(self, key: bytes, owner: BlockOwner) -> None:
        try:
            self._redis.delete(self.prefix + key)
        except redis.RedisError as exc:
            self._breaker.fail(exc)

    def _forget(self, key: bytes) -> None:
        self._lru.remove(key)

    def _note_read(self, key: bytes, found: bool) -> None:
        if found:
            self._lru.touch(key)
        else:
            self._lru.remove(key)  # gone from the server (evicted, expired, restarted)

    # ---- the rest of the interface ------------------------------------

    def contains(self, key: bytes) -> bool:
        if not self._breaker.may_call():
            return False
        try:
            found = bool(self._redis.exists(self.prefix + key))
        except redis.RedisError as exc:
            self._breaker.fail(exc)
            return False
        self._breaker.succeed()
        return found

    def delete(self, key: bytes) -> None:
        with self._lock:
            self._lru.remove(key)
        if self._breaker.may_call():
            try:
                self._redis.delete(self.prefix + key)
            except redis.RedisError as exc:
                self._breaker.fail(exc)

    def drop_tenant(self, tenant: str) -> int:
        """Every private block of ``tenant`` on the server, whichever node
        wrote it; 0 while the server is down."""
        with self._lock:
            for key in self._lru.pool_keys(tenant):
                self._lru.remove(key)
        if not self._breaker.may_call():
            return 0
        try:
            members = list(self._redis.smembers(self._tenant_set(tenant)))
            removed = self._redis.delete(*(self.prefix + k for k in members)) if members else 0
            self._redis.delete(self._tenant_set(tenant))
        except redis.RedisError as exc:
            self._breaker.fail(exc)
            return 0
        self._breaker.succeed()
        return removed

    def stats(self) -> TierStats:
        with self._lock:
            return self._lru.snapshot(self._stats)

    def check_integrity(self) -> None:
        """This node's view of what it holds is self-consistent (tests)."""
        with self._lock:
            self._lru.check_integrity()

    def close(self) -> None:
        self._redis.close()

