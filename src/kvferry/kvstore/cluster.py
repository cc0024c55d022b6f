"""The cluster KV pool on Mooncake Store: a tier below each node store's
DRAM, shared by every node whose store points at the same Mooncake master
(``--kv-cluster mooncake://MASTER_HOST:PORT?metadata=URL``).

    node store A --+                                +-- segment of A's DRAM (mounted by A's client)
                   +-- Mooncake master (metadata) --+
    node store B --+                                +-- segment of B's DRAM
    (put/get move block bytes between the clients' buffers and the segments)

Each node's store process runs one Mooncake client. It contributes
``segment_gb`` of its memory to the pool (Mooncake places and evicts
objects across all segments) and moves blocks through a local transfer
buffer of ``buffer_mb``. A block written by one node is a hit for every
other node whose engines compute the same block hash: the same model, KV
dtype and cache namespace, so the same ``--cache-secret-file`` on every
node for private blocks.

Objects (string keys, ``ns`` the URL's namespace, default ``kvferry``)::

    {ns}/{name(owner, block hash)}  the value, block_value.py's format:
                                    header, tenant tag, MAC, payload; a
                                    private payload is sealed with the
                                    tenant's AES-GCM key (crypto.py)
    {ns}/{name("k", block hash)}    a one-byte marker: some owner's block
                                    with this hash is in the pool

``name`` is ``TierCrypto.object_name``, a keyed hash under the cluster
secret; ``owner`` is ``pub`` for a public block, else the tenant's tag
(``crypto.tenant_tag``: no tenant name is ever stored). Whoever lists the
pool (the master's HTTP ``/get_all_keys`` needs no credentials) sees
unrelated names: neither the tenants, nor how many there are, nor which
blocks (or which value and marker) belong together. A reader fetches the
object under its own owner's name, so another tenant's private block is
never even transferred, and serves it only by ``shared_tier.py``'s rules
(authenticated under the secret, bound to its key and owner); anything
else is removed, counted and logged. ``contains`` (asked without an owner)
reads the marker.

``drop_tenant`` removes the tenant's blocks this node wrote since it
started, by name (the node keeps that index: one entry per private block
it wrote, the last ``MAX_INDEXED_BLOCKS``); a purge reaches every node
store, so each removes its own. A block written by a store that has
stopped since (or indexed too long ago) stays, sealed, until the master
evicts it. Markers may outlive their block (a purge, an eviction): such a
block is found by ``contains``, comes back a miss from ``get`` (the load
is short, the engine recomputes) and is written again, marker and all, by
the next write-through.

Without a secret (``insecure``, ``--insecure-shared-tier``) names are
readable, ``{ns}/{pub or tenant tag hex}/{block hash hex}`` and
``{ns}/k/{block hash hex}``, values carry an unkeyed checksum, and
``drop_tenant`` removes ``{ns}/{tag}/*`` by pattern.

**The data plane.** Mooncake moves values between the clients' registered
buffers over its own TCP (or RDMA) transport, with no authentication:
whoever reaches a node's transfer port can read and write its segment. The
client advertises this node's pool address only (``host``, default the
address it reaches the master from: loopback for a master on this
machine), and its listening ports are tied to that address's interface
(``mooncake_lib.confine_listeners``). Keep the pool on a private network;
whatever a stranger writes there fails authentication when read.

**Batches.** The store's pool writer hands blocks over in batches
(``put_many``): one ``batch_is_exist`` of their values and markers, then
what is missing in one ``batch_put_from``, each value encoded and sealed
in place in a registered transfer buffer (``cluster_buffers.py``). Loads
(``get_into``, the store's DRAM slots; ``get_many`` for bytes) use one
``batch_get_into`` per batch and no lookup: an absent value is a cheap
per-key miss. Values are checked and opened in their transfer slot.

**Soft pin.** ``retain`` (a paused conversation's blocks,
``kv_retention_s``) writes the blocks the pool holds again, in place, with
Mooncake's soft pin and that TTL: the master evicts them only after every
unpinned object, until the pin lapses.

A store that stops unmounts its segment: the blocks placed in it leave the
pool (``segment_gb=0``: a node that lends nothing, whose blocks all live
in the other nodes' segments). Capacity is Mooncake's: the master evicts
objects when the segments fill (its ``--eviction_high_watermark_ratio``);
an evicted block is a plain miss here, and a put the pool cannot place is
a refused write.

**Faults.** A master that stops answering (a call failing with an RPC
error) disables the tier (``shared_tier.OutageBreaker``): one warning per outage, every call a miss or a
refused write without touching the network, and a key lookup after a
backoff that doubles up to ``retry_max_s``. The client library reconnects
by itself (and mounts this node's segment again on a restarted master);
when the master answers, the tier logs (INFO) that it is back. A master
absent at start is waited for on a thread (its port probed before each
``setup``, which holds the GIL while it retries): the store serves at
once, the pool missing until then. Nothing
raises out of ``put``/``get``. Mooncake's own log lines (glog, on stderr)
are kept to errors unless ``MC_LOG_LEVEL`` is set (its failed RPCs while
a master is down are among them).

``stats()``: hits, misses and bytes of this node's reads and writes
(the attribute ``pinned``: blocks this node soft-pinned);
``num_blocks``/``num_bytes`` stay 0, the pool's contents being the
master's to count (its metrics port).

``mooncake`` is imported lazily: only a store started with
``--kv-cluster`` needs it (``pip install 'kvferry[cluster]'``, and the
Debian libraries ``libibverbs1`` and ``librdmacm1``). ``check_available``
names what is missing.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvferry.kvstore.block_value import encode_value_into, value_nbytes
from kvferry.kvstore.cluster_buffers import BufferPool
from kvferry.kvstore.crypto import TierCrypto, tenant_tag
from kvferry.kvstore.mooncake_lib import advertise_only, confine_listeners, listening_sockets, load_store_module
# Re-exported for code that imported them from here before they moved
# (other packages import pool_address and mooncake_lib).
from kvferry.kvstore.mooncake_lib import check_available, master_binary, metadata_server_argv  # noqa: F401
from kvferry.kvstore.pool_address import PoolAddress, auto_url, is_auto  # noqa: F401
from kvferry.kvstore.shared_tier import OutageBreaker, SharedTier, require_secret
from kvferry.kvstore.tenant_lru import pool_of
from kvferry.kvstore.tier import BlockOwner, TenantTierStats, TierStats

log = logging.getLogger(__name__)

_MARKER = b"\x01"
# batch_get_into's per-key codes besides a length: the value is absent, or
# larger than the slot given.
_NOT_FOUND = -704
_TOO_SMALL = -600
# Any call's code when its RPC to the master failed (the master is gone).
_RPC_FAIL = -900
_PUBLIC_PART = "pub"
_MARKER_PART = "k"
# Names removed per remove_by_regex call (a purge by this node's index).
_REMOVE_CHUNK = 512
# Private blocks a node indexes for purges (about 150 bytes each).
MAX_INDEXED_BLOCKS = 1 << 20


# -- the tier ---------------------------------------------------------------------------------
class MooncakeTier(SharedTier):
    name = "cluster"
    _log = log

    def __init__(self, address: str | PoolAddress, *, crypto: TierCrypto | None = None,
                 retry_initial_s: float = 1.0, retry_max_s: float = 30.0, connect_wait_s: float = 5.0,
                 insecure: bool = False) -> None:
        self.address = address if isinstance(address, PoolAddress) else PoolAddress.parse(address)
        require_secret("kv_cluster", crypto, insecure, log)
        # Down until the first setup succeeds.
        self._breaker = OutageBreaker(f"cluster KV tier: the Mooncake master {self.address.master}", retry_initial_s,
                                      retry_max_s, down=True, logger=log, gone="unreachable")
        self._module = load_store_module()
        self.crypto = crypto
        self.ns = self.address.namespace
        self._host = self.address.local_host()
        self._lock = threading.Lock()  # stats, the index, the client handle
        self._stats = TierStats()
        self._per_pool: dict[str, TenantTierStats] = {}
        # With a secret, object names are opaque (``object_key``): the names
        # of the private blocks this node wrote -> their tenant, so that
        # ``drop_tenant`` can name them; oldest first, at most
        # ``MAX_INDEXED_BLOCKS`` (older ones the pool has most likely evicted).
        self._written: OrderedDict[str, str] = OrderedDict()
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self.pinned = 0  # blocks soft-pinned by retain()
        self.exposed: list[tuple[str, int]] = []  # listening sockets left open to every interface (none, we hope)
        self._store: Any = None
        self._buffers: BufferPool  # set with _store: its registered transfer buffers
        self._value_nbytes = 0  # the largest value seen (read slots are sized to it)
        self._closed = threading.Event()
        self._put_config = self._module.ReplicateConfig()
        self._put_config.replica_num = 1
        # The client is set up on a thread of its own: the store serves at
        # once, every pool call a miss until the client is up. A master
        # that is up is waited for (a second), so that a fresh store starts
        # with its pool.
        self._first_try = threading.Event()
        self._connector = threading.Thread(target=self._connect_loop, name="kvstore-pool-connect", daemon=True)
        self._connector.start()
        self._first_try.wait(connect_wait_s)
        if self.down:
            log.warning("cluster KV tier: no Mooncake master at %s yet; every block a miss until it answers",
                        self.address.master)

    # ---- the client -----------------------------------------------------

    def _connect_loop(self) -> None:
        """Set a client up, retrying with backoff until it is (or the tier
        closes). Once set up, the client library itself reconnects to a
        master that restarts (and mounts this node's segment again)."""
        backoff = self._retry_initial_s
        while not self._closed.is_set():
            if not self.address.reachable():
                # setup() holds the GIL while it retries an absent master
                # (about 90 s): the whole store would stall. A refused
                # connection is the common case, told apart here at once.
                self._first_try.set()
                self._closed.wait(backoff)
                backoff = min(2 * backoff, self._retry_max_s)
                continue
            store = self._module.MooncakeDistributedStore()
            # Mooncake's data plane has no authentication: advertise this
            # node's pool address only, and tie the ports the client opens
            # to its interface (mooncake_lib.confine_listeners).
            advertise_only(self._host)
            before = set(listening_sockets())
            rc = store.setup({
                "local_hostname": self._host, "metadata_server": self.address.metadata,
                "global_segment_size": self.address.segment_bytes, "local_buffer_size": self.address.buffer_bytes,
                "protocol": self.address.protocol, "rdma_devices": self.address.device,
                "master_server_addr": self.address.master,
            })
            if rc == 0:
                self.exposed = confine_listeners(self._host, before)
                if self.exposed:
                    log.error("cluster KV tier: Mooncake's transfer ports %s listen on every interface (no interface "
                              "holds %s); keep this node on a private network", self.exposed, self._host)
                name = store.get_hostname()
                with self._lock:
                    if not self._closed.is_set():
                        self._buffers = BufferPool(store)
                        self._store, store = store, None
                        self._breaker.up()
                if store is None:
                    log.info("cluster KV tier: connected to the Mooncake master %s as %s", self.address.master, name)
                    self._first_try.set()
                    return
            self._first_try.set()
            _close_quietly(store)
            self._closed.wait(backoff)
            backoff = min(2 * backoff, self._retry_max_s)

    def _client(self) -> Any:
        """The client to call now, or None while the tier is down and its
        backoff has not run out. When it has, one caller asks the master
        (a key lookup: the client library reconnects by itself) and the
        tier comes back if it answers."""
        with self._lock:
            store = None if self._closed.is_set() else self._store
        if store is None or not self._breaker.may_call():
            return None
        if not self.down:
            return store
        if _answers(store, f"{self.ns}/probe"):
            self._breaker.succeed()
            return store
        self._breaker.fail("no answer")
        return None

    def _master_lost(self, store: Any, what: str, rpc_failed: bool = False) -> bool:
        """After a failed call: is the master gone (then the tier goes down:
        one warning per outage), or was it this call alone (a full pool)?
        ``rpc_failed``: the call said its RPC failed, no need to ask (asking
        a dead master takes seconds while the client retries)."""
        if not rpc_failed and _answers(store, f"{self.ns}/probe"):
            return False
        self._breaker.fail(what)
        return True

    # ---- keys -----------------------------------------------------------

    def _owner_part(self, owner: BlockOwner) -> bytes:
        return _PUBLIC_PART.encode() if owner.public else tenant_tag(self.crypto, owner.tenant)

    def object_key(self, key: bytes, owner: BlockOwner) -> str:
        """The pool key of ``owner``'s block ``key`` (tests read it raw):
        opaque with a secret (``TierCrypto.object_name``), so that a
        listing of the pool tells neither tenants nor which blocks belong
        together; readable without one (``--insecure-shared-tier``)."""
        if self.crypto is not None:
            return f"{self.ns}/{self.crypto.object_name(self._owner_part(owner), key)}"
        part = _PUBLIC_PART if owner.public else tenant_tag(None, owner.tenant).hex()
        return f"{self.ns}/{part}/{key.hex()}"

    def _marker_key(self, key: bytes) -> str:
        if self.crypto is not None:
            return f"{self.ns}/{self.crypto.object_name(_MARKER_PART.encode(), key)}"
        return f"{self.ns}/{_MARKER_PART}/{key.hex()}"

    # ---- writes ---------------------------------------------------------

    def put(self, key: bytes, data: bytes | memoryview, owner: BlockOwner) -> bool:
        return self.put_many([(key, data, owner)])[0]

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview, BlockOwner]]) -> list[bool]:
        """Write blocks (the store's write-through hands them over in
        batches); True for each one the pool holds on return. Each block
        crosses the network once: one lookup of every value and marker
        first (another node, or this one before, may have written it), then
        what is missing in one ``batch_put_from`` per buffer of values, each
        encoded and sealed in place. A block whose marker is gone (evicted)
        gets its marker back."""
        if not items:
            return []
        store = self._client()
        if store is None:
            for _, _, owner in items:
                self._refuse(pool_of(owner))
            return [False] * len(items)
        datas = [memoryview(data).cast("B") for _, data, _ in items]  # lengths in bytes, whatever the format
        names = [self.object_key(key, owner) for key, _, owner in items]
        markers = [self._marker_key(key) for key, _, _ in items]
        ok = [False] * len(items)
        wrote = [False] * len(items)
        present: list[int] = []
        try:
            present = store.batch_is_exist(names + markers)
            if len(present) != 2 * len(items) or any(p < 0 for p in present):
                raise _CallFailed(f"batch_is_exist returned {min(present, default=-1)}", _RPC_FAIL in present)
            todo = []
            for i in range(len(items)):
                if present[i] == 1 and present[len(items) + i] == 1:
                    ok[i] = True  # already in the pool: nothing crosses the network
                else:
                    todo.append(i)
            if todo:
                self._put_missing(store, items, datas, names, markers, present, todo, wrote)
        except _CallFailed as exc:
            self._master_lost(store, f"put failed: {exc}", exc.rpc_failed)
        except Exception as exc:
            log.warning("cluster KV tier: put raised %r", exc)
            self._master_lost(store, f"put failed: {exc}")
        with self._lock:
            # The values put (a block whose marker alone was missing sent one byte).
            self._stats.bytes_written += sum(len(d) for i, d in enumerate(datas) if wrote[i] and present[i] != 1)
            if self.crypto is not None:
                for i, (_, _, owner) in enumerate(items):
                    if (ok[i] or wrote[i]) and not owner.public:
                        self._written[names[i]] = owner.tenant
                        self._written.move_to_end(names[i])
                while len(self._written) > MAX_INDEXED_BLOCKS:
                    self._written.popitem(last=False)
        for i in range(len(items)):
            if not (ok[i] or wrote[i]):
                self._refuse(pool_of(items[i][2]))
        return [a or b for a, b in zip(ok, wrote)]

    def _put_missing(self, store: Any, items: Sequence[tuple[bytes, bytes | memoryview, BlockOwner]],
                     datas: list[memoryview], names: list[str], markers: list[str], present: list[int],
                     todo: list[int], wrote: list[bool]) -> None:
        """Put the values and markers of ``todo`` the lookup did not find;
        ``wrote[i]`` for each block the pool took whole."""
        n = len(items)
        value_sizes = [value_nbytes(self.crypto, len(datas[i]), items[i][2]) for i in todo]
        self._learn_size(max(value_sizes))
        calls = refused_calls = 0
        rpc_failed = False
        with self._buffers.write_lock:
            buf = self._buffers.writer(max(value_sizes))
            for at in range(0, len(todo), buf.slots):
                chunk = todo[at:at + buf.slots]
                keys, ptrs, lens, whose = [], [], [], []
                for slot, i in enumerate(chunk):
                    if present[i] != 1:
                        key, _, owner = items[i]
                        lens.append(encode_value_into(self.crypto, key, datas[i], owner, buf.slot(slot)))
                        keys.append(names[i])
                        ptrs.append(buf.slot_ptr(slot))
                        whose.append(i)
                    if present[n + i] != 1:
                        keys.append(markers[i])
                        ptrs.append(buf.marker_ptr)
                        lens.append(len(_MARKER))
                        whose.append(i)
                rcs = store.batch_put_from(keys, ptrs, lens, self._put_config)
                refused = {i for i, rc in zip(whose, rcs) if rc != 0} | set(whose[len(rcs):])
                rpc_failed = rpc_failed or _RPC_FAIL in rcs
                calls += 1
                refused_calls += len(refused) == len(chunk)
                for i in chunk:
                    wrote[i] = i not in refused
        if refused_calls and refused_calls == calls:
            self._master_lost(store, "put refused", rpc_failed)

    def _learn_size(self, value_nbytes: int) -> None:
        """The largest value seen: the read buffers' slot size."""
        if value_nbytes > self._value_nbytes:
            self._value_nbytes = value_nbytes

    def _refuse(self, pool: str) -> None:
        with self._lock:
            self._stats.refused_writes += 1
            self._pool_stats(pool).refused_writes += 1

    def _pool_stats(self, pool: str) -> TenantTierStats:
        stats = self._per_pool.get(pool)
        if stats is None:
            stats = self._per_pool[pool] = TenantTierStats()
        return stats

    # ---- reads ----------------------------------------------------------

    def get(self, key: bytes, owner: BlockOwner) -> bytes | None:
        return self.get_many([key], owner)[0]

    def get_many(self, keys: list[bytes], owner: BlockOwner) -> list[bytes | None]:
        return self._get(keys, owner, None)  # type: ignore[return-value]

    def get_into(self, keys: list[bytes], owner: BlockOwner, outs: list[memoryview]) -> list[bool]:
        """The store's loads: each block checked and opened (decrypted)
        straight from its transfer slot into its DRAM slot."""
        return [r is not None for r in self._get(keys, owner, [out.cast("B") for out in outs])]

    def _get(self, keys: list[bytes], owner: BlockOwner,
             outs: list[memoryview] | None) -> list[bytes | memoryview | None]:
        start = time.perf_counter()
        results: list[bytes | memoryview | None] = [None] * len(keys)
        store = self._client() if keys else None
        if store is not None:
            try:
                self._read(store, keys, owner, outs, results)
            except Exception as exc:
                results = [None] * len(keys)
                self._master_lost(store, f"get failed: {exc}")
        self._count_reads(keys, results, pool_of(owner), time.perf_counter() - start)
        return results

    def _read(self, store: Any, keys: list[bytes], owner: BlockOwner, outs: list[memoryview] | None,
              results: list[bytes | memoryview | None]) -> None:
        """Fetch, check and open ``keys`` into ``results`` (into ``outs``
        when given). No lookup first: ``batch_get_into`` tells an absent
        value (a cheap miss) from a failed call per key. Each value lands in
        a slot of a registered buffer and is checked and opened there;
        values larger than the slots (or every buffer busy) go through the
        client's ``get_batch``."""
        names = [self.object_key(k, owner) for k in keys]
        buf = self._buffers.take_reader(self._value_nbytes) if self._value_nbytes else None
        rest = list(range(len(keys)))
        failed = rpc_failed = False
        if buf is not None:
            rest = []
            try:
                for at in range(0, len(keys), buf.slots):
                    chunk = range(at, min(at + buf.slots, len(keys)))
                    rcs = store.batch_get_into([names[i] for i in chunk], [buf.slot_ptr(j) for j in range(len(chunk))],
                                               [buf.slot_nbytes] * len(chunk))
                    for j, (i, rc) in enumerate(zip(chunk, rcs)):
                        if rc > 0:
                            results[i] = self._decode(keys[i], buf.slot(j)[:rc], owner, outs and outs[i])
                        elif rc == _TOO_SMALL:
                            rest.append(i)
                        elif rc != _NOT_FOUND:
                            failed = True
                            rpc_failed = rpc_failed or rc == _RPC_FAIL
            finally:
                self._buffers.give_back(buf)
        if rest:
            # The client's own copy: for a first read (the value size not
            # known yet) or a value larger than the slots.
            values = store.get_batch([names[i] for i in rest])
            for i, value in zip(rest, values):
                if value:
                    self._learn_size(len(value))
                    results[i] = self._decode(keys[i], value, owner, outs and outs[i])
            # get_batch answers an absent value and a master that is gone
            # alike (empty bytes): a full miss asks the master.
            failed = failed or (len(rest) == len(keys) and not any(values))
        if failed:
            self._master_lost(store, "get failed", rpc_failed)

    def _remove_object(self, key: bytes, owner: BlockOwner) -> None:
        store = self._client()
        if store is not None:
            try:
                store.remove(self.object_key(key, owner), True)
            except Exception:
                pass

    # ---- soft pin ---------------------------------------------------------

    def retain(self, keys: list[bytes], owner: BlockOwner, seconds: float) -> int:
        """Soft-pin ``owner``'s blocks ``keys`` (and their markers) for
        ``seconds``: a paused conversation's (``kv_retention_s``). The master
        evicts soft-pinned objects only after every unpinned one, until the
        pin's TTL runs out (capped by its ``--max_kv_soft_pin_ttl``, one day
        by default). A pin is set by writing the object with it, so each
        block the pool holds is read back and upserted in place (within the
        pool: the node's DRAM is not asked). Returns how many were pinned;
        blocks the pool does not hold are skipped. ``seconds`` <= 0 does
        nothing: pins lapse by their TTL."""
        if seconds <= 0 or not keys:
            return 0
        store = self._client()
        if store is None:
            return 0
        names = [self.object_key(k, owner) for k in keys]
        config = self._module.ReplicateConfig()
        config.replica_num = 1
        config.soft_pin_action = self._module.SoftPinAction.ENABLE
        config.soft_pin_ttl_ms = max(1, int(seconds * 1000))
        pinned = 0
        try:
            with self._buffers.write_lock:
                if not self._value_nbytes:  # nothing put or got yet: learn the size from one value
                    first = store.get_batch(names[:1])
                    self._learn_size(len(first[0]) if first and first[0] else 0)
                if not self._value_nbytes:
                    return 0
                buf = self._buffers.writer(self._value_nbytes)
                for at in range(0, len(keys), buf.slots):
                    chunk = range(at, min(at + buf.slots, len(keys)))
                    rcs = store.batch_get_into([names[i] for i in chunk], [buf.slot_ptr(j) for j in range(len(chunk))],
                                               [buf.slot_nbytes] * len(chunk))
                    found = [(i, j, rc) for j, (i, rc) in enumerate(zip(chunk, rcs)) if rc > 0]
                    if not found:
                        continue
                    up = store.batch_upsert_from(
                        [names[i] for i, _, _ in found] + [self._marker_key(keys[i]) for i, _, _ in found],
                        [buf.slot_ptr(j) for _, j, _ in found] + [buf.marker_ptr] * len(found),
                        [rc for _, _, rc in found] + [len(_MARKER)] * len(found), config)
                    pinned += sum(1 for rc in up[:len(found)] if rc == 0)
        except Exception as exc:
            log.warning("cluster KV tier: soft pin raised %r", exc)
            self._master_lost(store, f"soft pin failed: {exc}")
        with self._lock:
            self.pinned += pinned
        return pinned

    # ---- the rest of the interface ----------------------------------------

    def contains(self, key: bytes) -> bool:
        store = self._client()
        if store is None:
            return False
        try:
            found = store.is_exist(self._marker_key(key))
        except Exception:
            found = -1
        if found < 0:
            self._master_lost(store, f"is_exist returned {found}", found == _RPC_FAIL)
        return found == 1

    def delete(self, key: bytes) -> None:
        """The public object of ``key``, this node's private ones and the
        marker (every owner's object, one pattern, without a secret)."""
        if self.crypto is None:
            self._remove_matching(rf"^{re.escape(self.ns)}/[0-9a-z]+/{key.hex()}$")
            return
        with self._lock:
            tenants = set(self._written.values())  # rare (a purge raced a write): a scan will do
        names = [self.object_key(key, BlockOwner(public=True)), self._marker_key(key)]
        private = [self.object_key(key, BlockOwner(tenant)) for tenant in tenants]
        with self._lock:
            for name in private:
                if self._written.pop(name, None) is not None:
                    names.append(name)
        self._remove_names(names)

    def drop_tenant(self, tenant: str) -> int:
        """Every private block of ``tenant`` that this node wrote since it
        started (every node store gets the purge: each removes its own);
        without a secret, whichever node wrote them (by the tag in their
        names). 0 while the master is down."""
        with self._lock:
            self._per_pool.pop(tenant, None)
            names = [name for name, whose in self._written.items() if whose == tenant]
            for name in names:
                del self._written[name]
        if self.crypto is None:
            return self._remove_matching(rf"^{re.escape(self.ns)}/{tenant_tag(None, tenant).hex()}/.*$")
        return self._remove_names(names)

    def _remove_names(self, names: list[str]) -> int:
        """Remove the objects ``names`` (opaque: hex), a regex of alternatives per chunk."""
        removed = 0
        for at in range(0, len(names), _REMOVE_CHUNK):
            chunk = names[at:at + _REMOVE_CHUNK]
            removed += self._remove_matching("^(" + "|".join(re.escape(name) for name in chunk) + ")$")
        return removed

    def _remove_matching(self, pattern: str) -> int:
        store = self._client()
        if store is None:
            return 0
        try:
            # force: a block read a moment ago still holds a lease; a purge
            # must not wait for it.
            removed = store.remove_by_regex(pattern, True)
        except Exception as exc:
            removed = -1
            log.warning("cluster KV tier: remove raised %r", exc)
        if removed < 0:
            self._master_lost(store, f"remove returned {removed}")
            return 0
        return removed

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats
            return TierStats(hits=s.hits, misses=s.misses, bytes_read=s.bytes_read, bytes_written=s.bytes_written,
                             quarantined=s.quarantined, auth_failures=s.auth_failures,
                             refused_writes=s.refused_writes, num_blocks=s.num_blocks, num_bytes=s.num_bytes,
                             load_seconds=s.load_seconds,
                             per_tenant={p: TenantTierStats(t.hits, t.misses, t.num_blocks, t.num_bytes,
                                                            t.refused_writes)
                                         for p, t in self._per_pool.items()})

    def close(self) -> None:
        """Unmount this node's segment (the blocks in it leave the pool) and
        drop the client. With the master gone, the client is left as it is:
        its close retries the unmount for ten seconds and more, and the
        master forgets a silent client's segment by itself (its
        ``--client_ttl``). A process that leaves it so should end with
        ``os._exit``: the library's teardown at exit retries the same way."""
        with self._lock:
            self._closed.set()
            store, self._store = self._store, None
        if store is None:
            return
        if not self.address.reachable():
            log.warning("cluster KV tier: the Mooncake master %s is unreachable; leaving without unmounting",
                        self.address.master)
            _ABANDONED.append((store, self._buffers))  # never destroyed: its destructor would retry too
            return
        self._buffers.close()  # unregistered before the client goes
        _close_quietly(store)


class _CallFailed(OSError):
    def __init__(self, what: str, rpc_failed: bool) -> None:
        super().__init__(what)
        self.rpc_failed = rpc_failed


# Clients left open by close() with their master gone.
_ABANDONED: list[Any] = []


def _answers(store: Any, probe_key: str) -> bool:
    """Whether the master answers a key lookup (0 or 1; an RPC failure is
    negative). Not ``health_check``: it reports a master that just died as
    healthy for a while."""
    try:
        return store.is_exist(probe_key) >= 0
    except Exception:
        return False


def _close_quietly(store: Any) -> None:
    if store is not None:
        try:
            store.close()
        except Exception:
            log.exception("cluster KV tier: closing the Mooncake client failed")

