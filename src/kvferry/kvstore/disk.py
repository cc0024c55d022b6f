"""The SSD tier: checksummed block records in slab files, one slab per
slot size, with an in-memory index rebuilt from the slabs on start.

Layout under ``path``::

    slab-<slot_bytes>.dat      slot i at offset i * slot_bytes (4 KiB multiple)

    slot = header | block key | tenant tag | payload | (padding to slot_bytes)
    header (44 bytes, little endian):
        magic "KVFB", version u8 (2), flags u8 (public, sealed),
        key_len u16, tenant_len u16, reserved u16,
        payload_len u64, seq u64 (write order, for LRU on restart),
        checksum 16 bytes = xxh3-128 over the header fields before it,
                            key, tenant tag and (clear blocks) payload;
                            a sealed payload is covered by its GCM tag
    tenant tag: ``crypto.tenant_tag`` (24 bytes) of a private block's
        tenant, never its name; empty for a public block

Pools (quotas, LRU, drops) are keyed by the tag too, so a restarted tier
knows whose blocks it holds without any name on disk; stats name the
tenants this process has seen, the others by their tag (hex).

Rules:

* **Durable before indexed.** ``put`` writes the record, ``fdatasync``s the
  slab, and only then enters the key in the index. A crash before the
  index sees it leaves a record that the restart scan finds whole (checksum
  verified at read) or torn (quarantined at read): never served.
* **Never serve a bad block.** Every read verifies the checksum and that the
  record names the key asked for; a failed check removes the block from
  the index (quarantined, counted, slot zeroed) and is a miss.
* **Private blocks are sealed** (``crypto``, AES-GCM under the tenant key,
  see ``kvferry.kvstore.crypto``); public blocks stay in the clear. A
  private block read by another tenant fails authentication: a miss,
  counted in ``auth_failures``, the block kept for its owner.
* **Full disk or capacity:** the write is refused (False, counted); the
  tier keeps serving. A full file system is also logged, at most once a
  minute, with the writes refused since the last warning. Capacity and
  quotas count whole slots; eviction is LRU per tenant within its quota,
  then LRU overall (``tenant_lru``).
* **Restart** scans each slot's header (one small read per slot) and
  rebuilds the index and LRU order from ``seq``; a deleted slot has a
  zeroed header.
* **Reads:** ``get_many`` sorts the slots by file offset, merges adjacent
  slots into large reads, and runs them on a few threads with O_DIRECT
  (no page-cache copy) into page-aligned buffers. Each block is copied
  once out of that buffer (or decrypted out of it).
"""
from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import re
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import xxhash

from kvferry.kvstore.crypto import SECRET_ID_BYTES, TierCrypto, tenant_tag
from kvferry.kvstore.tenant_lru import PUBLIC_POOL, TenantLRU, TierQuotas
from kvferry.kvstore.tier import BlockOwner, ColdTier, TierStats

log = logging.getLogger(__name__)

_MAGIC = b"KVFB"
# 2: the tenant field holds the tenant's tag. A version-1 slot (a name in
# the clear) is freed and its name zeroed by the restart scan.
_VERSION = 2
_HEADER = struct.Struct("<4sBBHHHQQ")  # everything before the checksum
_CHECKSUM_BYTES = 16
HEADER_BYTES = _HEADER.size + _CHECKSUM_BYTES  # 44
_FLAG_PUBLIC = 1
_FLAG_SEALED = 2
_ALIGN = 4096  # O_DIRECT offsets and lengths; also the slot granularity
_SLAB_NAME = re.compile(r"^slab-(\d+)\.dat$")
# Merged reads stop at this size: large enough for the disk, small enough
# that one thread decrypts a run while the others read the next ones.
_MAX_READ_BYTES = 4 << 20


def _round_up(n: int, align: int = _ALIGN) -> int:
    return (n + align - 1) // align * align


def _checksum(header_fields: bytes, key: bytes, tenant: bytes, payload_parts: list) -> bytes:
    h = xxhash.xxh3_128()
    h.update(header_fields)
    h.update(key)
    h.update(tenant)
    for part in payload_parts:
        h.update(part)
    return h.digest()


@dataclass(slots=True)
class _Slot:
    slab: _Slab
    index: int
    seq: int

    @property
    def offset(self) -> int:
        return self.index * self.slab.slot_bytes


class _Slab:
    """One slab file: fixed-size slots, a free list, a buffered write fd and
    an O_DIRECT read fd (buffered where the file system refuses O_DIRECT)."""

    def __init__(self, path: Path, slot_bytes: int) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.write_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self.read_fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            self.direct = hasattr(os, "O_DIRECT")
        except OSError:
            self.read_fd = os.open(path, os.O_RDONLY)
            self.direct = False
        self._reopen_lock = threading.Lock()
        self.num_slots = os.fstat(self.write_fd).st_size // slot_bytes
        self.free: list[int] = []

    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` (page-aligned) from ``offset``; bytes read. A file
        system that takes O_DIRECT at open but refuses it at read (EINVAL)
        gets a buffered fd from then on."""
        try:
            return os.preadv(self.read_fd, [view], offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
        with self._reopen_lock:
            if self.direct:
                fd, self.read_fd, self.direct = self.read_fd, os.open(self.path, os.O_RDONLY), False
                os.close(fd)
        return os.preadv(self.read_fd, [view], offset)

    def allocate(self) -> int:
        if self.free:
            return self.free.pop()
        self.num_slots += 1
        return self.num_slots - 1

    def close(self) -> None:
        for fd in (self.write_fd, self.read_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class DiskTier(ColdTier):
    name = "disk"
    # Full-disk warnings (_warn_full): at most one per interval.
    full_warning_interval_s = 60.0
    _full_refusals = 0  # since the last warning
    _full_warned_at = -math.inf

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, *, crypto: TierCrypto | None = None,
                 quotas: TierQuotas | None = None, read_threads: int = 4) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes: must be > 0")
        if read_threads < 1:
            raise ValueError("read_threads: must be >= 1")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.crypto = crypto
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}  # pool (tag hex) -> tenant name, for the tenants seen
        if quotas is not None:  # keyed by pool, as the LRU is
            quotas = replace(quotas, tenant_bytes={self._tenant_pool(t): b for t, b in quotas.tenant_bytes.items()})
        self._lru = TenantLRU(capacity_bytes, quotas)
        self._index: dict[bytes, _Slot] = {}
        self._slabs: dict[int, _Slab] = {}
        self._seq = 0
        self._stats = TierStats()
        self._pool = ThreadPoolExecutor(read_threads, thread_name_prefix="kvferry-disk-read")
        self._buffers = threading.local()
        self._load_index()

    # ---- tenants ------------------------------------------------------

    def _tenant_pool(self, tenant: str) -> str:
        pool = tenant_tag(self.crypto, tenant).hex()
        self._names.setdefault(pool, tenant)
        return pool

    def _pool_of(self, owner: BlockOwner) -> str:
        return PUBLIC_POOL if owner.public else self._tenant_pool(owner.tenant)

    # ---- writes -------------------------------------------------------

    def put(self, key: bytes, data: bytes | memoryview, owner: BlockOwner) -> bool:
        if not 0 < len(key) < 1 << 16:
            raise ValueError("key: must hold 1..65535 bytes")
        data = memoryview(data).cast("B")  # lengths in bytes, whatever the format
        pool = self._pool_of(owner)
        with self._lock:
            slot = self._index.get(key)
            if slot is not None and self._lru.pool_of_key(key) == pool:
                # Content-addressed: the same key under the same owner is the
                # same bytes; a rewrite would only cost I/O.
                self._lru.touch(key)
                return True
        sealed = self.crypto is not None and not owner.public
        tenant = b"" if owner.public else tenant_tag(self.crypto, owner.tenant)
        if sealed:
            nonce, body = self.crypto.seal(key, owner.tenant, data)
            payload = [nonce, body]
        else:
            payload = [data]
        payload_len = sum(len(p) for p in payload)
        slot_bytes = _round_up(HEADER_BYTES + len(key) + len(tenant) + payload_len)
        with self._lock:
            evicted, fits = self._lru.make_room(pool, slot_bytes)
            for old in evicted:
                self._free_slot(self._index.pop(old))
            try:
                slab = self._slab(slot_bytes) if fits else None
            except OSError as exc:  # no inode or fd left for a new slab file
                log.warning("disk tier: cannot open a slab in %s: %s", self.path, exc)
                slab = None
            if slab is None:
                self._refuse(pool)
                return False
            slot = _Slot(slab, slab.allocate(), self._next_seq())
            # Hold the bytes now, so that concurrent puts never overshoot
            # capacity; the key itself is indexed after the data is durable.
            self._lru.reserve(pool, slot_bytes)
        flags = (_FLAG_PUBLIC if owner.public else 0) | (_FLAG_SEALED if sealed else 0)
        fields = _HEADER.pack(_MAGIC, _VERSION, flags, len(key), len(tenant), 0, payload_len, slot.seq)
        # A sealed payload's checksum is its AES-GCM tag (a MAC over the
        # payload, the key and the tenant); xxh3 then covers the rest, and a
        # read makes one pass over the bytes instead of two.
        record = [fields, _checksum(fields, key, tenant, [] if sealed else payload), key, tenant, *payload]
        error = self._write(slab, record, slot.offset)
        with self._lock:
            self._lru.release(pool, slot_bytes)
            if error is not None:
                self._free_slot(slot)
                self._refuse(pool)
        if error is not None:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                self._warn_full(error)
            else:
                log.warning("disk tier: write to %s failed: %s", slab.path, error)
            return False
        with self._lock:
            old = self._index.get(key)
            if old is not None:
                self._lru.remove(key)
                self._free_slot(old)
            self._index[key] = slot
            self._lru.add(key, pool, slot_bytes)
            self._stats.bytes_written += len(data)
        return True

    @staticmethod
    def _write(slab: _Slab, record: list, offset: int) -> OSError | None:
        """Write and sync one record; the error (a full disk is ENOSPC,
        also for a short write) or None once it is durable."""
        try:
            written = os.pwritev(slab.write_fd, record, offset)
            if written != sum(len(part) for part in record):
                return OSError(errno.ENOSPC, "short write")
            os.fdatasync(slab.write_fd)
        except OSError as exc:
            return exc
        return None

    def _refuse(self, pool: str) -> None:
        self._stats.refused_writes += 1
        self._lru.stats_of(pool).refused_writes += 1

    def _warn_full(self, error: OSError) -> None:
        """A full file system refuses every write-back until space frees
        up, so it is logged at most once per ``full_warning_interval_s``,
        with the writes refused since the last warning: an operator learns
        of it without a line per evicted block."""
        with self._lock:
            self._full_refusals += 1
            now = time.monotonic()
            if now - self._full_warned_at < self.full_warning_interval_s:
                return
            count, self._full_refusals, self._full_warned_at = self._full_refusals, 0, now
        log.warning("disk tier: %s is full (%s): %d block write(s) refused since the last warning "
                    "(warned at most every %.0f s)", self.path, error.strerror or error, count,
                    self.full_warning_interval_s)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _slab(self, slot_bytes: int) -> _Slab:
        slab = self._slabs.get(slot_bytes)
        if slab is None:
            slab = self._slabs[slot_bytes] = _Slab(self.path / f"slab-{slot_bytes}.dat", slot_bytes)
        return slab

    def _free_slot(self, slot: _Slot, zero: bool = True, zero_bytes: int = HEADER_BYTES) -> None:
        """Return a slot to its slab (under the lock). Zeroing the header
        keeps a restart from bringing the block back; it needs no fsync
        because a block that does come back is still a whole, valid one."""
        if zero:
            try:
                os.pwrite(slot.slab.write_fd, bytes(zero_bytes), slot.offset)
            except OSError:
                pass
        slot.slab.free.append(slot.index)

    # ---- reads --------------------------------------------------------

    def get(self, key: bytes, owner: BlockOwner) -> bytes | None:
        return self.get_many([key], owner)[0]

    def get_many(self, keys: list[bytes], owner: BlockOwner) -> list[bytes | None]:
        start = time.perf_counter()
        with self._lock:
            found = [(i, self._index[k]) for i, k in enumerate(keys) if k in self._index]
        results: list[bytes | None] = [None] * len(keys)
        runs = _merge_runs(found)
        read = (lambda run: self._read_run(run, keys, owner))
        for run_results in (map(read, runs) if len(runs) == 1 else self._pool.map(read, runs)):
            for i, data in run_results:
                results[i] = data
        elapsed = time.perf_counter() - start
        with self._lock:
            pool = self._lru.stats_of(self._pool_of(owner))
            hits = 0
            for key, data in zip(keys, results):
                if data is None:
                    continue
                hits += 1
                self._lru.touch(key)
                self._stats.bytes_read += len(data)
            misses = len(keys) - hits
            self._stats.hits += hits
            self._stats.misses += misses
            pool.hits += hits
            pool.misses += misses
            if hits:
                self._stats.load_seconds += elapsed
        return results

    def _buffer(self, nbytes: int) -> mmap.mmap:
        """This thread's page-aligned read buffer, grown on demand."""
        buf = getattr(self._buffers, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._buffers.buf = mmap.mmap(-1, max(nbytes, 1 << 20))
        return buf

    def _read_run(self, run: list[tuple[int, _Slot]], keys: list[bytes],
                  owner: BlockOwner) -> list[tuple[int, bytes | None]]:
        slab = run[0][1].slab
        length = len(run) * slab.slot_bytes
        buf = self._buffer(length)
        view = memoryview(buf)[:length]
        try:
            got = slab.read_into(view, run[0][1].offset)
        except OSError as exc:
            # An I/O error says nothing about the blocks' bytes: a miss, and
            # the blocks stay indexed for the next try.
            log.warning("disk tier: read from %s failed: %s", slab.path, exc)
            return [(i, None) for i, _ in run]
        out = []
        for n, (i, slot) in enumerate(run):
            lo = n * slab.slot_bytes
            record = view[lo:min(lo + slab.slot_bytes, got)] if got > lo else view[:0]
            out.append((i, self._open_record(record, keys[i], slot, owner)))
        return out

    def _open_record(self, record: memoryview, key: bytes, slot: _Slot, owner: BlockOwner) -> bytes | None:
        parsed = _parse(record)
        if parsed is None or parsed.key != key or parsed.seq != slot.seq:
            self._quarantine(key, slot)
            return None
        if parsed.public:
            return bytes(parsed.payload)  # public blocks serve every tenant
        tag = tenant_tag(self.crypto, owner.tenant)
        if parsed.tenant != tag or owner.public:
            # Another tenant's private block: a miss, and the block stays for
            # its owner. (Were the tenant field forged to the reader's tag,
            # the reader's key would fail the GCM tag below.)
            with self._lock:
                self._stats.auth_failures += 1
            if self.crypto is not None and parsed.tenant[:SECRET_ID_BYTES] != tag[:SECRET_ID_BYTES]:
                # Sealed under another secret: no key here opens it, ever.
                self._quarantine(key, slot)
            return None
        if not parsed.sealed:
            return bytes(parsed.payload)
        if self.crypto is None:
            return None  # sealed on a previous start with crypto; no key now
        plain = self.crypto.open(key, owner.tenant, parsed.payload)
        if plain is None:
            # Checksum intact but the tag fails under the owner's own key:
            # tampered (checksum recomputed), never served.
            with self._lock:
                self._stats.auth_failures += 1
            self._quarantine(key, slot)
        return plain

    def _quarantine(self, key: bytes, slot: _Slot) -> None:
        with self._lock:
            if self._index.get(key) is not slot:
                return  # evicted or rewritten while we read: a plain miss
            del self._index[key]
            self._lru.remove(key)
            self._free_slot(slot)
            self._stats.quarantined += 1
        log.warning("disk tier: block %s in %s slot %d failed its checksum; quarantined",
                    key.hex()[:16], slot.slab.path.name, slot.index)

    # ---- index --------------------------------------------------------

    def _load_index(self) -> None:
        """Rebuild the index from the slot headers (oldest write first, so
        that LRU order survives the restart)."""
        entries: list[tuple[int, bytes, str, int, _Slot]] = []
        for file in sorted(self.path.iterdir()):
            match = _SLAB_NAME.match(file.name)
            if match is None:
                continue
            slab = self._slab(int(match.group(1)))
            size = os.fstat(slab.write_fd).st_size
            for index in range(slab.num_slots + (size % slab.slot_bytes > 0)):
                head = os.pread(slab.write_fd, min(slab.slot_bytes, _ALIGN), index * slab.slot_bytes)
                meta = _parse_head(head)
                if meta is None:
                    slab.free.append(index)
                    continue
                if meta == "old":
                    # Names a tenant in the clear: never indexed, and the
                    # name is zeroed now rather than whenever the slot is reused.
                    self._free_slot(_Slot(slab, index, 0), zero_bytes=min(slab.slot_bytes, _ALIGN))
                    continue
                key, tenant, public, record_len, seq = meta
                if index * slab.slot_bytes + record_len > size:
                    # Torn at the end of the file: counted now, never indexed.
                    self._stats.quarantined += 1
                    slab.free.append(index)
                    continue
                entries.append((seq, key, PUBLIC_POOL if public else tenant.hex(), index, _Slot(slab, index, seq)))
            slab.num_slots = max(slab.num_slots, (size + slab.slot_bytes - 1) // slab.slot_bytes)
            slab.free = [i for i in slab.free if i < slab.num_slots]
        entries.sort(key=lambda e: e[0])
        for seq, key, pool, _, slot in entries:
            old = self._index.get(key)
            if old is not None:
                self._lru.remove(key)
                self._free_slot(old)
            evicted, fits = self._lru.make_room(pool, slot.slab.slot_bytes)
            for gone in evicted:
                self._free_slot(self._index.pop(gone))
            if not fits:  # capacity or quota lowered since
                self._free_slot(slot)
                continue
            self._index[key] = slot
            self._lru.add(key, pool, slot.slab.slot_bytes)
            self._seq = max(self._seq, seq)
        if self._index:
            log.info("disk tier: %d blocks indexed from %s", len(self._index), self.path)

    # ---- the rest of the interface ------------------------------------

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def delete(self, key: bytes) -> None:
        with self._lock:
            slot = self._index.pop(key, None)
            if slot is not None:
                self._lru.remove(key)
                self._free_slot(slot)

    def drop_tenant(self, tenant: str) -> int:
        with self._lock:
            keys = self._lru.pool_keys(self._tenant_pool(tenant))
            for key in keys:
                self._lru.remove(key)
                self._free_slot(self._index.pop(key))
            # The zeroed headers must outlive a crash: a dropped tenant's
            # blocks do not come back on restart.
            for slab in self._slabs.values():
                os.fdatasync(slab.write_fd)
        return len(keys)

    def drop_public(self, keys: list[bytes]) -> int:
        with self._lock:
            doomed = [key for key in keys if self._lru.pool_of_key(key) == PUBLIC_POOL]
            for key in doomed:
                self._lru.remove(key)
                self._free_slot(self._index.pop(key))
            for slab in self._slabs.values():  # as drop_tenant: gone for good, restarts included
                os.fdatasync(slab.write_fd)
        return len(doomed)

    def stats(self) -> TierStats:
        with self._lock:
            stats = self._lru.snapshot(self._stats)
            stats.per_tenant = {self._names.get(pool, pool): s for pool, s in stats.per_tenant.items()}
            return stats

    def check_integrity(self) -> None:
        """Index, LRU and slabs agree (tests call it when idle)."""
        with self._lock:
            self._lru.check_integrity()
            assert len(self._lru) == len(self._index), "LRU and index disagree"
            assert self._lru.total_bytes == sum(s.slab.slot_bytes for s in self._index.values())
            used: set[tuple[int, int]] = set()
            for key, slot in self._index.items():
                assert key in self._lru
                where = (slot.slab.slot_bytes, slot.index)
                assert where not in used, "two keys share a slot"
                assert slot.index not in slot.slab.free, "an indexed slot is free"
                used.add(where)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for slab in self._slabs.values():
                slab.close()
            self._slabs.clear()


@dataclass(slots=True)
class _Record:
    key: bytes
    tenant: bytes  # the tenant's tag; empty for a public block
    public: bool
    sealed: bool
    seq: int
    payload: memoryview


def _parse_head(head: bytes) -> tuple[bytes, bytes, bool, int, int] | str | None:
    """(key, tenant tag, public, record_len, seq) from a slot's first bytes;
    "old" for a record of an earlier version (to be scrubbed), None for a
    free or unreadable slot."""
    if len(head) < HEADER_BYTES:
        return None
    magic, version, flags, key_len, tenant_len, _, payload_len, seq = _HEADER.unpack_from(head)
    if magic == _MAGIC and version < _VERSION:
        return "old"
    if magic != _MAGIC or version != _VERSION or HEADER_BYTES + key_len + tenant_len > len(head):
        return None
    key = bytes(head[HEADER_BYTES:HEADER_BYTES + key_len])
    tenant = bytes(head[HEADER_BYTES + key_len:HEADER_BYTES + key_len + tenant_len])
    return key, tenant, bool(flags & _FLAG_PUBLIC), HEADER_BYTES + key_len + tenant_len + payload_len, seq


def _parse(record: memoryview) -> _Record | None:
    """The record in ``record`` if it is whole and its checksum holds."""
    if len(record) < HEADER_BYTES:
        return None
    magic, version, flags, key_len, tenant_len, _, payload_len, seq = _HEADER.unpack_from(record)
    body = HEADER_BYTES + key_len + tenant_len
    if magic != _MAGIC or version != _VERSION or body + payload_len > len(record):
        return None
    key = record[HEADER_BYTES:HEADER_BYTES + key_len]
    tenant = record[HEADER_BYTES + key_len:body]
    payload = record[body:body + payload_len]
    checksum = _checksum(record[:_HEADER.size], key, tenant, [] if flags & _FLAG_SEALED else [payload])
    if checksum != record[_HEADER.size:HEADER_BYTES]:
        return None
    return _Record(bytes(key), bytes(tenant), bool(flags & _FLAG_PUBLIC), bool(flags & _FLAG_SEALED), seq, payload)


def _merge_runs(found: list[tuple[int, _Slot]]) -> list[list[tuple[int, _Slot]]]:
    """Group slots into runs of adjacent slots in one slab (one read each),
    in file order; a run stops at ``_MAX_READ_BYTES``."""
    ordered = sorted(found, key=lambda e: (e[1].slab.slot_bytes, e[1].index))
    runs: list[list[tuple[int, _Slot]]] = []
    for entry in ordered:
        slot = entry[1]
        last = runs[-1][-1][1] if runs else None
        if (last is not None and last.slab is slot.slab and last.index + 1 == slot.index
                and (len(runs[-1]) + 1) * slot.slab.slot_bytes <= _MAX_READ_BYTES):
            runs[-1].append(entry)
        else:
            runs.append([entry])
    return runs
