"""The remote KV tier on a Redis server, shared by every node that points
at it (``--kv-remote redis://host:port/db``).

Keys and values, with the cluster secret (``crypto``)::

    key       = prefix || name                     name = ``TierCrypto.object_name(b"", block key)``:
                                                   32 hex digits, a keyed hash
    value     = purge tag || block_value.py's value (header | label | MAC | payload)
    purge tag = MAC(domain, owner, name)           owner: the tenant's tag (``crypto.tenant_tag``)
                                                   for a private block, "pub" for a public one

Every value is authenticated under the cluster secret (private blocks
sealed with the tenant's key, ``kvferry.kvstore.crypto``; public ones with
a MAC), and read by ``shared_tier.py``'s rules: a value that fails is
deleted (quarantined, counted, logged) and is a miss; another tenant's
private block is a miss counted in ``auth_failures``. Without a secret the
tier is refused unless ``insecure`` (``--insecure-shared-tier``).

**What a listing shows.** Whoever reaches the server can list the keys
(``KEYS``, ``SCAN``) and read every value. With the secret they learn how
many blocks there are, their sizes and which are public (a value's
flags), and nothing else: a key names no block hash and no tenant, and
both per-value MACs (the value's label, the purge tag) differ per block,
so nothing tells the tenants, how many there are, or which blocks belong
together. No key groups a tenant's blocks: there is no index.

**Purges.** ``drop_tenant`` scans the keys and reads each value's purge
tag (16 bytes, ``GETRANGE``): a tag that the tenant's MAC reproduces for
that name is the tenant's block, whichever node wrote it and however long
ago (a node's restart, or another node with the same secret, agrees on
the MAC). A purge costs one pass over the server's keys, pipelined: an
operator's act, not a request's. Anyone with write access can still
delete or rewrite a tag (as they can delete the value itself); none can
make a purge delete another tenant's block (a tag is bound to its name).

Without a secret (``insecure``) keys are ``prefix || block key``, values
carry no purge tag, and ``prefix || "tenant:" || hex(tenant tag)`` is a
set of the tenant's keys for ``drop_tenant``: tenants, their blocks and
the block hashes are readable, as is everything else. A purge with the
secret removes such a set (and its members) too: what nodes wrote before
keys were opaque.

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

from kvferry.kvstore.block_value import encode_value, is_public
from kvferry.kvstore.crypto import MAC_BYTES, TierCrypto, tenant_tag
from kvferry.kvstore.shared_tier import OutageBreaker, SharedTier, require_secret
from kvferry.kvstore.tenant_lru import TenantLRU, TierQuotas, pool_of
from kvferry.kvstore.tier import BlockOwner, TenantTierStats, TierStats

log = logging.getLogger(__name__)

_PURGE_DOMAIN = b"kvferry redis purge tag v1\0"
_PUBLIC_OWNER = b"pub"
_NAME_CHARS = 32  # hex digits of TierCrypto.object_name
# Keys per SCAN step and per pipelined batch of a purge.
_SCAN_BATCH = 1000


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
                pipe.delete(*(self.redis_key(k) for k in evicted))
            if fits:
                pipe.set(self.redis_key(key), value, px=self.ttl_ms)
                if not owner.public and self.crypto is None:
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
        """What Redis stores for ``owner``'s block ``key`` (module docstring)."""
        if self.crypto is None:
            return encode_value(None, key, data, owner)
        whose = _PUBLIC_OWNER if owner.public else self.crypto.tenant_tag(owner.tenant)
        return encode_value(self.crypto, key, data, owner, head=self._purge_tag(self._name(key), whose))

    def _name(self, key: bytes) -> bytes:
        assert self.crypto is not None
        return self.crypto.object_name(b"", key).encode()

    def redis_key(self, key: bytes) -> bytes:
        """Where block ``key``'s value lives: an opaque name with a secret."""
        return self.prefix + (key if self.crypto is None else self._name(key))

    def _purge_tag(self, name: bytes, owner: bytes) -> bytes:
        assert self.crypto is not None
        return self.crypto.mac(_PURGE_DOMAIN, bytes([len(owner)]), owner, name)

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
                values = self._redis.mget([self.redis_key(k) for k in keys])
            except redis.RedisError as exc:
                self._breaker.fail(exc)
            else:
                self._breaker.succeed()
        results = [None if v is None else self._read(k, v, owner) for k, v in zip(keys, values)]
        self._count_reads(keys, results, pool_of(owner), time.perf_counter() - start)
        return results

    def _read(self, key: bytes, value: bytes, owner: BlockOwner) -> bytes | None:
        if self.crypto is None:
            return self._decode(key, value, owner)
        view = memoryview(value)
        data = self._decode(key, view[MAC_BYTES:], owner)
        if data is None:
            return None
        # A public block is every tenant's (and authenticated by now).
        whose = _PUBLIC_OWNER if is_public(view[MAC_BYTES:]) else self.crypto.tenant_tag(owner.tenant)
        if bytes(view[:MAC_BYTES]) != self._purge_tag(self._name(key), whose):
            # Ours, but a purge would not find it: rewritten, so it goes.
            return self._quarantine(key, owner, "has a purge tag not its owner's")
        return data

    # shared_tier.SharedTier's hooks
    def _pool_stats(self, pool: str) -> TenantTierStats:
        return self._lru.stats_of(pool)

    def _remove_object(self, key: bytes, owner: BlockOwner) -> None:
        try:
            self._redis.delete(self.redis_key(key))
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
            found = bool(self._redis.exists(self.redis_key(key)))
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
                self._redis.delete(self.redis_key(key))
            except redis.RedisError as exc:
                self._breaker.fail(exc)

    def drop_tenant(self, tenant: str) -> int:
        """Every private block of ``tenant`` on the server, whichever node
        wrote it (module docstring: a pass over the keys with a secret);
        0 while the server is down."""
        with self._lock:
            for key in self._lru.pool_keys(tenant):
                self._lru.remove(key)
        if not self._breaker.may_call():
            return 0
        try:
            removed = self._drop_tenant_set(tenant)
            if self.crypto is not None:
                removed += self._drop_tagged(self.crypto.tenant_tag(tenant))
        except redis.RedisError as exc:
            self._breaker.fail(exc)
            return 0
        self._breaker.succeed()
        return removed

    def _drop_tenant_set(self, tenant: str) -> int:
        """The tenant's keys from its set (written without a secret, or
        before keys were opaque), and the set."""
        members = list(self._redis.smembers(self._tenant_set(tenant)))
        removed = self._redis.delete(*(self.prefix + k for k in members)) if members else 0
        self._redis.delete(self._tenant_set(tenant))
        return removed

    def _drop_tagged(self, owner: bytes) -> int:
        """Delete the values whose purge tag is ``owner``'s: one SCAN over
        the prefix, each batch's tags read in one pipeline."""
        pattern = _glob_escape(self.prefix) + b"*"
        removed = 0
        batch: list[bytes] = []
        for name in self._redis.scan_iter(match=pattern, count=_SCAN_BATCH):
            if len(name) == len(self.prefix) + _NAME_CHARS:  # a value's (not a tenant set)
                batch.append(name)
            if len(batch) >= _SCAN_BATCH:
                removed += self._drop_batch(batch, owner)
                batch = []
        return removed + (self._drop_batch(batch, owner) if batch else 0)

    def _drop_batch(self, names: list[bytes], owner: bytes) -> int:
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.getrange(name, 0, MAC_BYTES - 1)
        # raise_on_error=False: a key of another type under the prefix
        # answers an error, which is no tag of ours.
        tags = pipe.execute(raise_on_error=False)
        mine = [name for name, tag in zip(names, tags)
                if isinstance(tag, bytes) and tag == self._purge_tag(name[len(self.prefix):], owner)]
        return self._redis.delete(*mine) if mine else 0

    def stats(self) -> TierStats:
        with self._lock:
            return self._lru.snapshot(self._stats)

    def check_integrity(self) -> None:
        """This node's view of what it holds is self-consistent (tests)."""
        with self._lock:
            self._lru.check_integrity()

    def close(self) -> None:
        self._redis.close()


def _glob_escape(text: bytes) -> bytes:
    """``text`` matched literally by a Redis glob pattern."""
    for special in (b"\\", b"*", b"?", b"[", b"]"):
        text = text.replace(special, b"\\" + special)
    return text
