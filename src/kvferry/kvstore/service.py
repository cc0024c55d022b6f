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

The process around the service (flags, signals, the parent watchdog) is
``process.py``; ``launch.py`` starts one as a child process, and
``supervisor.py`` keeps a server's store running.

No torch is imported here: the process starts fast.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from kvferry import peer_auth
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
            case p.DropPublic(keys=keys):
                return p.Count(n=self.index.drop_public(keys) + self.cold.drop_public(keys))
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


if __name__ == "__main__":  # ``python -m kvferry.kvstore.service``, as before the process wiring moved
    from kvferry.kvstore.process import main

    sys.exit(main())
