"""What the network tiers (Redis, ``remote.py``; the Mooncake pool,
``cluster.py``) share: one outage breaker, one set of rules for the values
they read, quarantine and read counting.

**Trust.** Whoever reaches a shared server can list, read and write its
values; only the cluster secret tells ours from theirs. A tier with a
secret (``crypto``) serves a value only when (``block_value.py``)

* it authenticates under the secret, bound to its block key (a private
  block sealed with AES-GCM, a public one with a MAC), and
* its label admits the reader: a public block is every tenant's, a
  private one only its tenant's (``block_value.owner_label``).

A value that fails the first rule is quarantined: deleted from the server,
counted (``quarantined`` and ``auth_failures``) and logged (at most one
warning per ``LOG_EVERY_S``, with the count since). One that fails the
second is counted in ``auth_failures`` and left alone: under a key shared
by every owner (Redis) it is another owner's block. Neither is ever data.

A tier without a secret is refused (ValueError) unless built with
``insecure=True`` (``--insecure-shared-tier``): it then checks an unkeyed
checksum, which catches torn values but not forged ones, and logs so
loudly at start.

**Outages.** ``OutageBreaker``: a failed call takes the tier down (one
warning per outage); while down every call is a miss or a refused write
without touching the network; once the backoff has run out one caller
retries, and its failure doubles the backoff (up to ``retry_max_s``) while
its success brings the tier back (logged at INFO).
"""
from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod

from kvferry.kvstore.block_value import owner_label, parse_value
from kvferry.kvstore.crypto import SEAL_OVERHEAD, TierCrypto
from kvferry.kvstore.tier import BlockOwner, ColdTier, TenantTierStats, TierStats

log = logging.getLogger(__name__)

# At most one quarantine warning per tier this often (a forger must not
# flood the log).
LOG_EVERY_S = 10.0

INSECURE_FLAG = "--insecure-shared-tier"


def require_secret(what: str, crypto: TierCrypto | None, insecure: bool, logger: logging.Logger = log) -> None:
    """Refuse a shared tier without the cluster secret unless the operator
    said ``insecure``; then warn loudly, once per tier."""
    if crypto is not None:
        return
    if not insecure:
        raise ValueError(f"{what}: a shared tier needs the cluster secret to authenticate what it reads "
                         f"(--cache-secret-file FILE, the same file on every node); without one, whoever reaches "
                         f"the server can serve forged KV to every tenant. {INSECURE_FLAG} runs it without")
    logger.warning("%s: %s: INSECURE: no cluster secret; values are checked by an unkeyed checksum only and private "
                "blocks rest unsealed: whoever reaches the server can read every tenant's KV and serve forged KV",
                what, INSECURE_FLAG)


class OutageBreaker:
    """Whether a tier's server is worth calling now (module docstring)."""

    def __init__(self, what: str, retry_initial_s: float, retry_max_s: float, *, down: bool = False,
                 logger: logging.Logger = log, gone: str = "down") -> None:
        if retry_initial_s <= 0 or retry_max_s < retry_initial_s:
            raise ValueError("retry_initial_s, retry_max_s: must be > 0 and max >= initial")
        self.what = what
        self._gone = gone  # "down", "unreachable": what an outage is called in the log
        self._log = logger  # the tier's module's: its operators filter by it
        self._lock = threading.Lock()
        self._initial_s = retry_initial_s
        self._max_s = retry_max_s
        self._backoff_s = retry_initial_s
        # time.monotonic() before which calls skip the network; a tier that
        # starts down (a client still connecting) waits for ``up()``.
        self._down_until = float("inf") if down else 0.0
        self._retrying = False
        self.down = down
        self.outages = 0

    def may_call(self) -> bool:
        """True while up; while down, True for the one caller that retries
        once the backoff has run out (the others wait for its answer: the
        next retry is a backoff later)."""
        if not self.down:
            return True
        with self._lock:
            now = time.monotonic()
            if not self.down:
                return True
            if now < self._down_until:
                return False
            self._down_until = now + self._backoff_s
            self._retrying = True
            return True

    def fail(self, reason: object) -> None:
        """A call failed: the tier goes down (one warning per outage); a
        failed retry doubles the backoff."""
        with self._lock:
            if not self.down:
                self.down = True
                self.outages += 1
                self._log.warning("%s is %s (%s); every block a miss, retrying with backoff", self.what, self._gone,
                                  reason)
            elif self._retrying:
                self._backoff_s = min(2 * self._backoff_s, self._max_s)
            self._retrying = False
            self._down_until = time.monotonic() + self._backoff_s

    def succeed(self) -> None:
        """A call succeeded: a tier that was down is back."""
        if self.down:
            with self._lock:
                if self.down:
                    self.up()
                    self._log.info("%s is back", self.what)

    def up(self) -> None:
        """Up, silently (a client connected for the first time)."""
        self.down = False
        self._retrying = False
        self._backoff_s = self._initial_s


class SharedTier(ColdTier):
    """A ``ColdTier`` on a server other nodes (and strangers) reach.
    Subclasses set ``crypto``, ``_lock``, ``_stats`` and ``_breaker`` and
    implement ``_pool_stats`` and ``_remove_object``."""

    crypto: TierCrypto | None
    _lock: threading.Lock
    _stats: TierStats
    _breaker: OutageBreaker
    _log: logging.Logger = log  # the subclass's module's logger
    _last_warning = 0.0
    _unlogged = 0

    @property
    def down(self) -> bool:
        return self._breaker.down

    @property
    def outages(self) -> int:
        return self._breaker.outages

    @abstractmethod
    def _pool_stats(self, pool: str) -> TenantTierStats:
        """The per-owner stats of ``pool`` (``tenant_lru.pool_of``); called under ``_lock``."""

    @abstractmethod
    def _remove_object(self, key: bytes, owner: BlockOwner) -> None:
        """Delete ``owner``'s value of ``key`` from the server (never raises)."""

    def _forget(self, key: bytes) -> None:
        """This node's own record of ``key`` is gone; called under ``_lock``."""

    def _note_read(self, key: bytes, found: bool) -> None:
        """A read of ``key`` hit or missed; called under ``_lock``."""

    # ---- reads ----------------------------------------------------------

    def _decode(self, key: bytes, value: bytes | memoryview, owner: BlockOwner,
                out: memoryview | None = None) -> bytes | memoryview | None:
        """``owner``'s block ``key`` from ``value`` (module docstring's
        rules): a copy (``value`` may be a transfer slot), or ``out``
        written whole (a block of another length is a miss); None for a
        miss."""
        parsed = parse_value(self.crypto, key, value)
        if parsed is None:
            return self._quarantine(key, owner, "failed authentication")
        # A public block is every tenant's; a private one only its tenant's.
        if not parsed.public and (owner.public or parsed.label != owner_label(self.crypto, key, owner)):
            with self._lock:
                self._stats.auth_failures += 1  # another owner's: never served
            return None
        payload = parsed.payload
        if not parsed.sealed:
            if out is None:
                return bytes(payload)
            if len(payload) != len(out):
                return None
            out[:] = payload
            return out
        assert self.crypto is not None  # parse_value: only a secret's holder sees sealed values
        if out is not None and len(payload) - SEAL_OVERHEAD != len(out):
            return None
        plain: bytes | memoryview | None
        if out is None:
            plain = self.crypto.open(key, owner.tenant, payload)
        else:
            plain = out if self.crypto.open_into(key, owner.tenant, payload, out) else None
        if plain is None:
            # Its MAC holds but its GCM tag fails under the owner's key:
            # forged, or moved here from another block key.
            return self._quarantine(key, owner, "failed its AES-GCM tag")
        return plain

    def _quarantine(self, key: bytes, owner: BlockOwner, why: str) -> None:  # returns the miss it is
        now = time.monotonic()
        with self._lock:
            self._stats.quarantined += 1
            if self.crypto is not None:  # without a secret a bad value is torn, not unauthenticated
                self._stats.auth_failures += 1
            self._forget(key)
            self._unlogged += 1
            report = now - self._last_warning >= LOG_EVERY_S
            if report:
                self._last_warning, unlogged, self._unlogged = now, self._unlogged, 0
        if report:
            self._log.warning("%s KV tier: block %s %s; deleted (%d value(s) quarantined since the last warning)",
                        self.name, key.hex()[:16], why, unlogged)
        self._remove_object(key, owner)
        return None

    def _count_reads(self, keys: list[bytes], results: list, pool: str, elapsed: float) -> None:
        hits = sum(r is not None for r in results)
        with self._lock:
            for key, data in zip(keys, results):
                self._note_read(key, data is not None)
                if data is not None:
                    self._stats.bytes_read += len(data)
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
            stats = self._pool_stats(pool)
            stats.hits += hits
            stats.misses += len(keys) - hits
            if hits:
                self._stats.load_seconds += elapsed
