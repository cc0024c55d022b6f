"""The node's KV store service, "kvferry: kvstore": one per node, found by
address (ipc:// or tcp://), shared by every engine process on the node.

    engines (KVStoreClient, REQ) --protocol.Request--> ROUTER  main loop: DramIndex (policy.py), tickets
                                 <--protocol.Reply---         |
                                                              +-- load threads:  cold tiers -> arena slots
                                                              '-- write-back thread: evicted blocks -> cold tiers
    shared memory: the arena (arena.py), mapped by the service and every engine

Tiers and policy (see policy.py for DRAM):

* DRAM is write-through: engines write blocks into reserved slots and
  commit them.
* On DRAM eviction a block is written back to the disk tier (its bytes are
  copied out on the main loop before the slot is reused, then written by
  the write-back thread), and to the remote tier too once it served at
  least ``remote_min_hits`` loads.
* The cluster pool (``--kv-cluster``, Mooncake Store, shared by every
  node's store) is written through: a block goes up when it is committed
  (or once it served ``cluster_min_hits`` loads), on its own writer
  thread; a clean stop flushes what is still on its way.
* ``begin_load`` pins the blocks DRAM holds and brings the others up from
  the first cold tier that has them (disk, then remote), on a load thread;
  the ticket's result is the leading run that made it (a block missing,
  corrupt or refused ends the run).
* Hits and misses are counted per load, per tier and per tenant: a block
  served from DRAM is a DRAM hit; one brought up from disk is a DRAM miss
  and a disk hit; ``lookup`` counts nothing (schedulers ask it often).

Every request must carry the store's token (``kvferry.peer_auth``, derived
from the cache secret or the secret of the process tree that started the
store): without it the store answers Refused and runs nothing. An ipc://
socket file is made 0600 as soon as it is bound, and removed at shutdown.

The arena's block size comes from ``--block-nbytes``, or else from the
first client that says Hello with one: the arena is created then, and a
client with another block size is refused.

No torch is imported here: the process starts fast.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from kvferry import envs, peer_auth
from kvferry.kvstore import protocol as p
from kvferry.kvstore.arena import SHM_DIR, Arena
from kvferry.kvstore.chain import ColdChain
from kvferry.kvstore.client import NO_ARENA_YET  # the client tells an early probe from a refusal by it
from kvferry.kvstore.policy import DramIndex, Entry, PoolQuotas, State
from kvferry.kvstore.tier import ColdTier, TierStats

logger = logging.getLogger(__name__)

GIB = 2**30
_POLL_IDLE_MS = 100
_POLL_BUSY_MS = 1  # while loads are in flight: their completions arrive on a queue
# Requests carry keys and slots, never block bytes: a lookup of a
# million-token prompt is a few MB. Anything larger is dropped by the
# socket before it is read (an unauthenticated peer must not make the
# store allocate what it sends).
MAX_REQUEST_BYTES = 64 << 20


@dataclass(slots=True)
class StoreConfig:
    address: str
    dram_bytes: int
    block_nbytes: int | None = None
    # Tenant -> bytes of DRAM (from the key file's quota.dram_gb).
    tenant_dram_bytes: dict[str, int] = field(default_factory=dict)
    default_dram_bytes: int | None = None
    public_dram_bytes: int | None = None
    remote_min_hits: int = 2
    # Loads a block must serve before it is written to the cluster pool (0:
    # at its commit, so another node finds it while this one holds it).
    cluster_min_hits: int = 0
    io_threads: int = 4
    # A client not heard from for this long died without Goodbye: its pins
    # and reservations are freed. Engines poll while their loads are in
    # flight and commit right after reserving, so a live one never idles
    # this long holding anything.
    client_lease_s: float = 60.0
    # Check the DRAM index after every request (tests, debugging): a broken
    # invariant is logged and makes the process exit non-zero at shutdown.
    check_integrity: bool = False
    shm_dir: Path = SHM_DIR
    # What every request must carry (None: this process tree's
    # peer_auth.token(KVSTORE), which the clients it starts present).
    token: bytes | None = None

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise ValueError(f"kv_dram_gb: must be > 0, got {self.dram_bytes / GIB}")
        if self.block_nbytes is not None and self.block_nbytes <= 0:
            raise ValueError(f"block_nbytes: must be > 0, got {self.block_nbytes}")
        if self.block_nbytes is not None and self.block_nbytes > self.dram_bytes:
            raise ValueError("kv_dram_gb: the arena must hold at least one block")
        if self.remote_min_hits < 0:
            raise ValueError(f"remote_min_hits: must be >= 0, got {self.remote_min_hits}")
        if self.cluster_min_hits < 0:
            raise ValueError(f"cluster_min_hits: must be >= 0, got {self.cluster_min_hits}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads: must be >= 1, got {self.io_threads}")
        if not self.client_lease_s > 0:
            raise ValueError(f"client_lease_s: must be > 0, got {self.client_lease_s}")

    def quotas(self, block_nbytes: int) -> PoolQuotas:
        def blocks(nbytes: int | None) -> int | None:
            return None if nbytes is None else nbytes // block_nbytes

        return PoolQuotas({t: blocks(b) for t, b in self.tenant_dram_bytes.items()},
                          blocks(self.default_dram_bytes), blocks(self.public_dram_bytes))


@dataclass(slots=True, eq=False)
class _Ticket:
    client_id: str
    ticket: int
    entries: list[Entry]
    started: float
    done: bool = False


class KVStoreService:
    def __init__(self, config: StoreConfig, cold_tiers: list[ColdTier] | None = None) -> None:
        self.config = config
        self.cold = ColdChain(cold_tiers or [], io_threads=config.io_threads, remote_min_hits=config.remote_min_hits,
                              cluster_min_hits=config.cluster_min_hits)
        self.service_id = uuid.uuid4().hex
        self.arena: Arena | None = None
        self.index: DramIndex | None = None
        if config.block_nbytes is not None:
            self._make_arena(config.block_nbytes)
        self._ctx = zmq.Context()
        self._token = config.token if config.token is not None else peer_auth.token(peer_auth.KVSTORE)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._sock.bind(config.address)
        self._socket_file = _private_socket_file(config.address)
        self._stop = threading.Event()
        # client_id -> ticket -> _Ticket
        self._tickets: dict[str, dict[int, _Ticket]] = {}
        self._last_seen: dict[str, float] = {}  # client_id -> time.monotonic()
        self._next_lease_check = 0.0
        self._done_loads = 0
        self._load_seconds = 0.0
        self.integrity_failures = 0

    # -- the arena ---------------------------------------------------------------------
    def _make_arena(self, block_nbytes: int) -> None:
        num_slots = self.config.dram_bytes // block_nbytes
        if num_slots < 1:
            raise ValueError("kv_dram_gb: the arena must hold at least one block")
        if Arena.sweep_stale(self.config.shm_dir):
            logger.info("removed the arenas of store processes that died without cleaning up")
        self.arena = Arena.create(num_slots, block_nbytes, self.config.shm_dir)
        self.index = DramIndex(num_slots, block_nbytes, self.config.quotas(block_nbytes),
                               can_demote=bool(self.cold),
                               on_evict=lambda entry: self.cold.write_back(entry, self.arena))
        logger.info("arena %s: %d slots of %d bytes (%.2f GiB)", self.arena.path, num_slots, block_nbytes,
                    num_slots * block_nbytes / GIB)

    # -- the main loop -----------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                busy = self.cold.loads_in_flight > 0
                if poller.poll(_POLL_BUSY_MS if busy else _POLL_IDLE_MS):
                    while True:
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._answer(frames)
                self._apply_completions()
                self._expire_leases()
        finally:
            self.close()

    def request_stop(self) -> None:
        self._stop.set()

    def _answer(self, frames: list[bytes]) -> None:
        # ROUTER framing from a REQ peer: [identity, b"", body]
        if len(frames) != 3:
            return
        identity, _, body = frames
        try:
            request = p.decode(body, p.Request)
        except Exception as exc:  # a malformed message must not stop the store
            reply: p.Reply = p.Refused(reason=f"undecodable request: {exc}")
        else:
            if not peer_auth.check(request.token, self._token):
                # Nothing runs for a peer without the token (DropTenant,
                # Reserve, ...); not even its client id is remembered.
                self._sock.send_multipart([identity, b"", p.encode(p.Refused(reason=_NOT_AUTHENTICATED))])
                return
            try:
                self._apply_completions()
                reply = self.handle(request)
                if self.config.check_integrity:
                    self._check_integrity()
            except ValueError as exc:
                reply = p.Refused(reason=str(exc))
            except Exception as exc:
                logger.exception("request %s failed", type(request).__name__)
                reply = p.Refused(reason=f"internal error: {exc!r}")
        self._sock.send_multipart([identity, b"", p.encode(reply)])

    # -- requests ----------------------------------------------------------------------
    def handle(self, request: p.Request) -> p.Reply:
        self._last_seen[request.client_id] = time.monotonic()
        if isinstance(request, p.Hello):
            return self._hello(request)
        if request.service_id and request.service_id != self.service_id:
            return p.Restarted(service_id=self.service_id)
        if isinstance(request, p.GetStats):
            return self.stats()
        if self.index is None:
            if isinstance(request, p.PollLoads):
                return p.Loads(results=[])
            return p.Refused(reason=f"{NO_ARENA_YET}: no client has said Hello with block_nbytes")
        now = time.monotonic()
        match request:
            case p.Lookup(keys=keys):
                return p.Count(n=self._lookup(keys))
            case p.BeginLoad():
                self._begin_load(request, now)
                return p.Ok()
            case p.PollLoads(client_id=client_id, tickets=waiting):
                results = self._finished_loads(client_id, now)
                known = self._tickets.get(client_id, {})
                results += [p.LoadResult(ticket=t, slots=[]) for t in waiting if t not in known]
                return p.Loads(results=results)
            case p.Release(client_id=client_id, tickets=tickets):
                for ticket in tickets:
                    self._release(client_id, ticket)
                return p.Ok()
            case p.Reserve():
                return p.Slots(slots=self._reserve(request, now))
            case p.Commit():
                self._commit(request)
                return p.Ok()
            case p.Abandon(client_id=client_id, slots=slots):
                self._abandon(client_id, slots)
                return p.Ok()
            case p.Retain(keys=keys, owner=owner, seconds=seconds):
                if not seconds >= 0:
                    raise ValueError(f"seconds: must be >= 0, got {seconds}")
                self.cold.retain(keys, owner, seconds)  # the pool's soft pin, on its writer thread
                return p.Count(n=self.index.retain(keys, owner, now + seconds, now))
            case p.DropTenant(tenant=tenant):
                return p.Count(n=self._drop_tenant(tenant))
            case p.Goodbye(client_id=client_id):
                self._forget_client(client_id)
                self._last_seen.pop(client_id, None)
                return p.Ok()
        raise ValueError(f"unknown request {type(request).__name__}")

    def _hello(self, hello: p.Hello) -> p.Reply:
        if self.arena is None:
            if hello.block_nbytes is None:
                return p.Refused(reason=f"{NO_ARENA_YET}: say Hello with block_nbytes")
            if hello.block_nbytes <= 0:
                raise ValueError(f"block_nbytes: must be > 0, got {hello.block_nbytes}")
            self._make_arena(hello.block_nbytes)
        assert self.arena is not None
        if hello.block_nbytes is not None and hello.block_nbytes != self.arena.block_nbytes:
            return p.Refused(reason=f"block_nbytes: the store's arena holds blocks of {self.arena.block_nbytes} "
                                    f"bytes, this client's are {hello.block_nbytes}")
        # A client saying Hello again reconnected after a timeout: it may
        # still be writing its reserved slots, so they stay its own (until
        # Goodbye, its lease, or the reservation timeout); it releases the
        # loads it gave up on itself.
        return p.Welcome(service_id=self.service_id, arena_path=str(self.arena.path),
                         num_slots=self.arena.num_slots, block_nbytes=self.arena.block_nbytes)

    def _lookup(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and (self.index.holds(keys[n]) or self.cold.contains(keys[n])):
            n += 1
        return n

    def _begin_load(self, request: p.BeginLoad, now: float) -> None:
        if len(request.owners) != len(request.keys):
            raise ValueError(f"owners: {len(request.owners)} for {len(request.keys)} keys")
        tickets = self._tickets.setdefault(request.client_id, {})
        if request.ticket in tickets:
            raise ValueError(f"ticket: {request.ticket} is already in use")
        # Pin what DRAM holds first, so that bringing up the missing blocks
        # can never evict a later block of this same load.
        found = [self.index.readable(key, owner) for key, owner in zip(request.keys, request.owners)]
        for entry in found:
            if entry is not None:
                self.index.pin(entry)
        entries: list[Entry] = []
        to_load: list[Entry] = []
        try:
            for key, owner, entry in zip(request.keys, request.owners, found):
                # A key being written again (reserved) is a miss here, even if a
                # cold tier holds it: its slot is not ours to load into.
                if entry is None and key not in self.index.entries and self.cold and self.cold.contains(key):
                    entry = self.index.allocate(key, owner, State.LOADING, now)
                    if entry is not None:
                        self.index.pin(entry)
                        to_load.append(entry)
                if entry is None:
                    self.index.count_hit(owner, False)
                    break
                hit = entry.state is State.READY and entry not in to_load
                self.index.count_hit(owner, hit)
                entry.hits += hit
                if hit:
                    self.cold.write_through(entry, self.arena)
                entries.append(entry)
        except BaseException:
            # Whatever went wrong, no pin of a load that never started stays behind.
            for entry in [e for e in found if e is not None] + to_load:
                self.index.unpin(entry)
            for entry in to_load:
                self.index.remove(entry)
            raise
        for entry in found[len(entries):]:  # past the run: not this load's
            if entry is not None:
                self.index.unpin(entry)
        tickets[request.ticket] = _Ticket(request.client_id, request.ticket, entries, now)
        if to_load:
            self.cold.start_load(to_load, self.arena)

    def _finished_loads(self, client_id: str, now: float) -> list[p.LoadResult]:
        results = []
        for ticket in self._tickets.get(client_id, {}).values():
            if ticket.done:
                continue
            run = 0
            for entry in ticket.entries:
                if entry.state is not State.READY:
                    break
                run += 1
            if run < len(ticket.entries) and ticket.entries[run].state is State.LOADING:
                continue  # still coming up
            # The run ends here: unpin what lies past it now.
            for entry in ticket.entries[run:]:
                self.index.unpin(entry)
            del ticket.entries[run:]
            ticket.done = True
            self._done_loads += 1
            self._load_seconds += now - ticket.started
            results.append(p.LoadResult(ticket=ticket.ticket, slots=[e.slot for e in ticket.entries]))
        return results

    def _release(self, client_id: str, ticket_id: int) -> None:
        ticket = self._tickets.get(client_id, {}).pop(ticket_id, None)
        if ticket is None:
            return  # unknown or already released: releasing is idempotent
        for entry in ticket.entries:
            self.index.unpin(entry)

    def _reserve(self, request: p.Reserve, now: float) -> list[int | None]:
        if len(request.owners) != len(request.keys):
            raise ValueError(f"owners: {len(request.owners)} for {len(request.keys)} keys")
        slots: list[int | None] = []
        for key, owner in zip(request.keys, request.owners):
            if key in self.index.entries:
                slots.append(None)  # already stored (or being written)
                continue
            entry = self.index.allocate(key, owner, State.RESERVED, now, request.client_id)
            slots.append(None if entry is None else entry.slot)
        return slots

    def _commit(self, request: p.Commit) -> None:
        if len(request.slots) != len(request.keys):
            raise ValueError(f"slots: {len(request.slots)} for {len(request.keys)} keys")
        for key, slot in zip(request.keys, request.slots):
            entry = self.index.by_slot.get(slot)
            # Only the writer's own reservation of this key: a commit from a
            # client of a previous store (or for another slot) is ignored.
            if (entry is not None and entry.state is State.RESERVED and entry.key == key
                    and entry.client_id == request.client_id):
                self.index.make_ready(entry)
                self.cold.write_through(entry, self.arena)

    def _abandon(self, client_id: str, slots: list[int]) -> None:
        for slot in slots:
            entry = self.index.by_slot.get(slot)
            if entry is not None and entry.state is State.RESERVED and entry.client_id == client_id:
                self.index.remove(entry)

    def _drop_tenant(self, tenant: str) -> int:
        return self.index.drop_pool(tenant) + self.cold.drop_tenant(tenant)

    def _check_integrity(self) -> None:
        if self.index is None:
            return
        try:
            self.index.check_integrity()
        except AssertionError as exc:
            self.integrity_failures += 1
            logger.error("DRAM index integrity check failed: %s", exc)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        if now < self._next_lease_check:
            return
        self._next_lease_check = now + min(1.0, self.config.client_lease_s / 4)
        if self.index is not None:
            # A reservation whose Reserve reply never reached its client (a
            # timeout) would otherwise hold its slot forever.
            stale = [e for e in self.index.entries.values()
                     if e.state is State.RESERVED and now - e.since > self.config.client_lease_s]
            for entry in stale:
                self.index.remove(entry)
        for client_id, seen in list(self._last_seen.items()):
            if now - seen > self.config.client_lease_s:
                del self._last_seen[client_id]
                if self._holds_anything(client_id):
                    logger.warning("client %s silent for %.0f s: freeing its pins and reservations", client_id,
                                   now - seen)
                self._forget_client(client_id)

    def _holds_anything(self, client_id: str) -> bool:
        return bool(self._tickets.get(client_id)) or any(
            e.client_id == client_id for e in (self.index.entries.values() if self.index else ()))

    def _forget_client(self, client_id: str) -> None:
        """Free every pin and reservation of a client that left (or came back)."""
        if self.index is None:
            return
        for ticket_id in list(self._tickets.get(client_id, {})):
            self._release(client_id, ticket_id)
        self._tickets.pop(client_id, None)
        for entry in [e for e in self.index.entries.values()
                      if e.state is State.RESERVED and e.client_id == client_id]:
            self.index.remove(entry)

    def _apply_completions(self) -> None:
        for entry, ok in self.cold.completions():
            if entry.state is not State.LOADING:
                continue  # dropped meanwhile
            if ok:
                self.index.make_ready(entry)
            else:
                self.index.remove(entry)

    # -- stats, shutdown ---------------------------------------------------------------------
    def stats(self) -> p.StoreStats:
        tiers: dict[str, TierStats] = {}
        if self.index is not None:
            tiers["dram"] = self.index.snapshot()
        tiers.update(self.cold.stats())
        index = self.index
        now = time.monotonic()
        return p.StoreStats(
            tiers=tiers,
            num_slots=index.num_slots if index else 0,
            block_nbytes=index.block_nbytes if index else 0,
            used_slots=len(index.by_slot) if index else 0,
            pinned_slots=sum(1 for e in index.by_slot.values() if e.pins) if index else 0,
            retained_blocks=sum(1 for e in index.lru.values() if e.retain_until > now) if index else 0,
            evictions=index.evictions if index else 0,
            written_back=self.cold.written_back,
            write_backs_dropped=self.cold.write_backs_dropped,
            loads=self._done_loads,
            load_seconds=self._load_seconds,
        )

    def close(self) -> None:
        self.cold.close()
        self._sock.close(0)
        self._ctx.term()
        if self.arena is not None:
            self.arena.close()
        if self._socket_file is not None:
            self._socket_file.remove()


_NOT_AUTHENTICATED = ("not authenticated: the request lacks this store's token (start the store and its "
                      "engines from one process, or give each the same --cache-secret-file)")


@dataclass(slots=True)
class _SocketFile:
    """The file of an ipc:// socket this store bound, made private to its
    user at once (it is created with whatever mode the umask leaves, 0777
    under umask 000), and removed at shutdown if it is still ours."""

    path: Path
    inode: tuple[int, int]

    def remove(self) -> None:
        try:
            st = self.path.stat()
            if (st.st_dev, st.st_ino) == self.inode:  # not a successor's socket at the same path
                self.path.unlink()
        except OSError:
            pass


def _private_socket_file(address: str) -> _SocketFile | None:
    if not address.startswith("ipc://") or address.startswith("ipc://@"):  # tcp://, or an abstract socket
        return None
    path = Path(address[len("ipc://"):])
    os.chmod(path, 0o600)
    st = path.stat()
    return _SocketFile(path, (st.st_dev, st.st_ino))


# -- configuration from flags ------------------------------------------------------------
def add_kvstore_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", required=True, help="where to listen: ipc:///path or tcp://127.0.0.1:PORT")
    # The tier flags are spelled as kvferry serve's --kv-* flags (the same
    # options, one name each); the short spellings still parse, deprecated.
    parser.add_argument("--kv-dram-gb", "--dram-gb", dest="kv_dram_gb", type=float, required=True,
                        help="size of the shared-memory DRAM arena, GiB")
    parser.add_argument("--block-nbytes", type=int, default=None,
                        help="bytes per KV block; default: taken from the first engine that connects")
    parser.add_argument("--kv-disk", "--disk", dest="kv_disk", default=None, help="directory of the SSD tier")
    parser.add_argument("--kv-disk-gb", "--disk-gb", dest="kv_disk_gb", type=float, default=None,
                        help="size of the SSD tier, GiB")
    parser.add_argument("--kv-remote", "--remote", dest="kv_remote", default=None,
                        help="remote tier, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--remote-min-hits", type=int, default=2,
                        help="loads a block must serve before write-back sends it to the remote tier too")
    parser.add_argument("--kv-cluster", dest="kv_cluster", default=None,
                        help="cluster KV pool shared by every node's store, "
                             "mooncake://MASTER_HOST:PORT?metadata=URL (Mooncake Store)")
    parser.add_argument("--cluster-min-hits", type=int, default=0,
                        help="loads a block must serve before it is written to the cluster pool (0: at its commit)")
    parser.add_argument("--cache-secret-file", default=None, help="server secret: per-tenant keys at rest")
    parser.add_argument("--api-keys", default=None,
                        help="the server's key file: per-tenant quotas from quota.dram_gb / quota.disk_gb")
    parser.add_argument("--default-dram-gb", type=float, default=None,
                        help="DRAM quota of a tenant the key file gives none (default: no cap)")
    parser.add_argument("--public-dram-gb", type=float, default=None,
                        help="DRAM quota of the public pool (blocks of declared public prefixes)")
    parser.add_argument("--default-disk-gb", type=float, default=None,
                        help="disk quota of a tenant the key file gives none (default: no cap)")
    parser.add_argument("--public-disk-gb", type=float, default=None, help="disk quota of the public pool")
    parser.add_argument("--io-threads", type=int, default=4, help="threads loading blocks from cold tiers")
    parser.add_argument("--client-lease-s", type=float, default=60.0,
                        help="free the pins and reservations of a client silent this long (it died)")
    parser.add_argument("--check-integrity", action="store_true",
                        help="check the DRAM index after every request; exit non-zero if it ever broke")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit once this process is gone")
    parser.add_argument("--log-level", default="info")


def tenant_quotas_gb(path: str | Path | None, field_name: str) -> dict[str, float]:
    """Tenant -> quota.<field_name> (GiB) from the server's key file."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"api_keys: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("api_keys: the file must hold a JSON object mapping key -> tenant")
    quotas: dict[str, float] = {}
    for entry in data.values():
        if not isinstance(entry, dict) or not isinstance(entry.get("tenant"), str):
            raise ValueError("api_keys: every entry must be an object with a 'tenant' string")
        value = (entry.get("quota") or {}).get(field_name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"api_keys[{entry['tenant']!r}].quota.{field_name}: must be a number >= 0")
        quotas[entry["tenant"]] = float(value)
    return quotas


def config_from_args(args: argparse.Namespace) -> StoreConfig:
    def nbytes(gb: float | None) -> int | None:
        return None if gb is None else int(gb * GIB)

    return StoreConfig(
        address=args.address, dram_bytes=int(args.kv_dram_gb * GIB), block_nbytes=args.block_nbytes,
        tenant_dram_bytes={t: int(g * GIB) for t, g in tenant_quotas_gb(args.api_keys, "dram_gb").items()},
        default_dram_bytes=nbytes(args.default_dram_gb), public_dram_bytes=nbytes(args.public_dram_gb),
        remote_min_hits=args.remote_min_hits, cluster_min_hits=args.cluster_min_hits, io_threads=args.io_threads,
        client_lease_s=args.client_lease_s, check_integrity=args.check_integrity)


def cold_tiers_from_args(args: argparse.Namespace) -> list[ColdTier]:
    """The tiers below DRAM the flags ask for, in load order: disk, cluster,
    remote.
    Private blocks are sealed under per-tenant keys derived from the cache
    secret; without ``--cache-secret-file`` the one kept beside the tiers
    (``secret_file.py``, generated at the first start), so that a restarted
    store can still open what it wrote."""
    if (args.kv_disk is None) != (args.kv_disk_gb is None):
        raise ValueError("kv_disk / kv_disk_gb: give both or neither")
    if not (args.kv_disk or args.kv_remote or args.kv_cluster):
        return []
    from kvferry.kvstore.crypto import TierCrypto
    from kvferry.kvstore.tenant_lru import TierQuotas

    secret_file = args.cache_secret_file
    if secret_file is None:
        from kvferry.kvstore.secret_file import ensure_secret_file, tier_secret_path

        secret_file, created = ensure_secret_file(tier_secret_path(args.kv_disk, args.kv_remote or args.kv_cluster))
        logger.warning("no --cache-secret-file: %s the cache secret in %s, so the tiers survive a restart",
                       "generated" if created else "using", secret_file)
        if args.kv_cluster:
            logger.warning("no --cache-secret-file: this node shares no private blocks with the cluster pool's "
                           "other nodes (give every node's store and server the same secret file)")
    crypto = TierCrypto.from_file(secret_file)
    tiers: list[ColdTier] = []
    if args.kv_disk:
        from kvferry.kvstore.disk import DiskTier

        if args.kv_disk_gb <= 0:
            raise ValueError(f"kv_disk_gb: must be > 0, got {args.kv_disk_gb}")
        quotas = TierQuotas.from_gb(tenant_quotas_gb(args.api_keys, "disk_gb"), default_tenant_gb=args.default_disk_gb,
                                    public_gb=args.public_disk_gb)
        tiers.append(DiskTier(args.kv_disk, int(args.kv_disk_gb * GIB), crypto=crypto, quotas=quotas))
    if args.kv_cluster:
        from kvferry.kvstore.cluster import MooncakeTier

        tiers.append(MooncakeTier(args.kv_cluster, crypto=crypto))
    if args.kv_remote:
        from kvferry.kvstore.remote import RedisTier

        tiers.append(RedisTier(args.kv_remote, crypto=crypto))
    return tiers


def run(args: argparse.Namespace) -> int:
    """``kvferry kvstore``: serve until SIGTERM / SIGINT (or the parent is gone)."""
    import setproctitle

    setproctitle.setproctitle("kvferry: kvstore")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s [kvstore] %(name)s: %(message)s")
    try:
        if envs.socket_secret() is None and args.cache_secret_file is None:
            logger.warning("no --cache-secret-file: only engines started by this process could present this "
                           "store's token; give the store and its servers the same --cache-secret-file")
        # The secret the engines' tokens derive from: inherited from the
        # process that started this one, else from the cache secret file.
        peer_auth.socket_secret(args.cache_secret_file)
        service = KVStoreService(config_from_args(args), cold_tiers_from_args(args))
    except (ValueError, OSError, zmq.ZMQError) as exc:
        print(f"kvferry kvstore: {exc}", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, f: service.request_stop())
    if args.parent_pid is not None:
        _watch_parent(args.parent_pid, service)
    logger.info("kvstore serving at %s", args.address)
    service.serve_forever()
    code = 3 if service.integrity_failures else 0
    if args.kv_cluster:
        # Everything the store owns is closed by now (serve_forever). The
        # Mooncake client library's own teardown at exit retries through a
        # master that is gone for ten seconds and more: skip it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _watch_parent(parent_pid: int, service: KVStoreService) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        logger.warning("parent process %d is gone; kvstore exiting", parent_pid)
        service.request_stop()

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


# -- socket addresses (launch.py starts a store) -------------------------------------------
def ipc_address() -> str:
    """A fresh socket path named after this process (the store's parent),
    after removing those of parents that are gone: a store killed with
    SIGKILL never removes its own (its parent's death ends a live one)."""
    _remove_dead_sockets(Path(tempfile.gettempdir()))
    return f"ipc://{tempfile.gettempdir()}/{_SOCKET_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


_SOCKET_PREFIX = "kvferry-kvstore-"


def _remove_dead_sockets(directory: Path) -> None:
    from kvferry.shm_segments import pid_alive

    for path in directory.glob(f"{_SOCKET_PREFIX}*-*.sock"):
        try:
            pid = int(path.name[len(_SOCKET_PREFIX):].split("-")[0])
            if not pid_alive(pid) and path.is_socket() and path.lstat().st_uid == os.getuid():
                path.unlink()
        except (ValueError, OSError):
            continue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry kvstore", description="the node's KV store service")
    add_kvstore_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
