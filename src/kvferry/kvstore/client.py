"""The engine's handle on the node's KV store service. No torch.

    client = KVStoreClient("ipc:///tmp/kvstore.sock", block_nbytes=nbytes)
    arena = client.arena()                      # uint8 [num_slots, block_nbytes], shared memory
    n = client.lookup(keys)                     # leading keys some tier holds
    t = client.begin_load(keys[:n], owners)     # non-blocking
    ... each step: for r in client.poll_loads(): copy arena[r.slots] to the device; client.release(r.ticket)
    slots = client.reserve(keys, owners)        # write arena[slot] for each slot that is not None
    client.commit(keys_written, slots_written)  # now readers see them

Every request carries the store's token (``kvferry.peer_auth``): a store
expecting another one refuses this client, which then acts as if it were
down. Every call is safe while the service is down or stalled (no answer within
``timeout_s``): lookups miss, reserves are refused, loads finish empty (a
ticket in flight then comes back from ``poll_loads`` with no slots, so
nothing waits forever), and nothing raises into the engine. A store that
died is noticed at once (its end of the connection closes, or a connect is
refused), not after ``timeout_s``. The client
reconnects by itself, with backoff (50 ms doubling to 2 s), on the next
call after the backoff. If the same service answers again, the loads given
up on are released there and reservations stay valid; if a new one
answers (every request names the service it is meant for), the client maps
the new arena and bumps ``generation``: an engine holding a view from
``arena()`` takes a fresh one when ``generation`` changed. Thread-safe (one
lock; one request in flight at a time).

``block_nbytes``: an arena is created by the first client that says Hello
with one when the service was started without ``--block-nbytes``; a
client with another block size is refused (and stays disconnected).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import msgspec
import numpy as np
import zmq

from kvferry import peer_auth
from kvferry.kvstore import protocol as p
from kvferry.kvstore.arena import Arena
from kvferry.kvstore.protocol import LoadResult, StoreStats
from kvferry.kvstore.tier import BlockOwner

__all__ = ["BlockOwner", "KVStoreClient", "LoadResult", "StoreStats"]

logger = logging.getLogger(__name__)

# How the store's refusal of a Hello before any arena exists begins (service.py).
NO_ARENA_YET = "no arena yet"
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0
# The socket events that say the store's end is gone: a connection closed
# under us (the process died or restarted), or a connect refused (nothing
# listens). A REQ socket never gets the reply to a request sent before
# either, so waiting out the timeout would only delay the miss.
_PEER_GONE_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


def _peer_gone(sock: zmq.Socket) -> bool:
    """Whether one of _PEER_GONE_EVENTS is queued on the socket's monitor."""
    return bool(sock.get_monitor_socket().poll(0, zmq.POLLIN))


def _close_socket(sock: zmq.Socket) -> None:
    monitor = sock.get_monitor_socket()
    sock.disable_monitor()
    monitor.close(0)
    sock.close(0)


class KVStoreClient:
    def __init__(self, address: str, *, timeout_s: float = 1.0, block_nbytes: int | None = None,
                 client_id: str | None = None, token: bytes | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.client_id = client_id or f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.block_nbytes: int = block_nbytes or 0
        self.num_slots: int = 0
        # Bumped each time a (new) service's arena is mapped.
        self.generation = 0
        self._want_block_nbytes = block_nbytes
        # What the store asks of every request (None: this process tree's,
        # which a store started by it, or given the same cache secret, expects).
        self._token = peer_auth.token(peer_auth.KVSTORE) if token is None else token
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._lock = threading.RLock()
        self._service_id: str | None = None
        self._arena: Arena | None = None
        self._next_ticket = 1
        self._last_service_id: str | None = None  # the service last connected to (kept while down)
        self._outstanding: set[int] = set()  # tickets the service is loading for us
        self._ready: list[LoadResult] = []  # results for the next poll_loads
        # Tickets reported empty while the service did not answer: if the
        # same service answers again, they are released there (it still pins them).
        self._abandoned: set[int] = set()
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._warned_down = False
        with self._lock:
            self._ensure_connected()

    # -- state -------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """Whether the service answers (tries to reconnect, within backoff)."""
        with self._lock:
            return self._ensure_connected()

    def arena(self) -> np.ndarray:
        """uint8 ``[num_slots, block_nbytes]`` in shared memory; empty before
        the first connect. Re-take it when ``generation`` changes."""
        with self._lock:
            self._ensure_connected()
            if self._arena is None:
                return np.empty((0, self.block_nbytes), dtype=np.uint8)
            return self._arena.view

    # -- the API -------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> int:
        """How many leading keys some tier holds (0 while the service is down)."""
        if not keys:
            return 0
        reply = self._call(p.Lookup(client_id=self.client_id, keys=list(keys)))
        return reply.n if isinstance(reply, p.Count) else 0

    def begin_load(self, keys: list[bytes], owners: list[BlockOwner]) -> int:
        """Start bringing ``keys`` into pinned arena slots; returns a ticket
        whose LoadResult ``poll_loads`` returns once (possibly empty)."""
        if len(owners) != len(keys):
            raise ValueError(f"owners: {len(owners)} for {len(keys)} keys")
        with self._lock:
            ticket = self._next_ticket
            self._next_ticket += 1
            if keys:
                reply = self._call(p.BeginLoad(client_id=self.client_id, ticket=ticket, keys=list(keys),
                                               owners=list(owners)))
                if isinstance(reply, p.Ok):
                    self._outstanding.add(ticket)
                    return ticket
                self._abandoned.add(ticket)  # the service may have taken it before going silent
            self._ready.append(LoadResult(ticket=ticket, slots=[]))
            return ticket

    def poll_loads(self) -> list[LoadResult]:
        """Loads finished since the last poll, each exactly once."""
        with self._lock:
            if self._outstanding:
                reply = self._call(p.PollLoads(client_id=self.client_id, tickets=sorted(self._outstanding)))
                if isinstance(reply, p.Loads):
                    for result in reply.results:
                        if result.ticket in self._outstanding:  # each exactly once
                            self._outstanding.discard(result.ticket)
                            self._ready.append(result)
                elif self._service_id is None:
                    # Down: nothing will come back, and the engine must not wait.
                    self._abandon(self._outstanding)
            results, self._ready = self._ready, []
            return results

    def release(self, ticket: int) -> None:
        """Unpin a load's slots (after copying them out)."""
        self._call(p.Release(client_id=self.client_id, tickets=[ticket]))

    def reserve(self, keys: list[bytes], owners: list[BlockOwner]) -> list[int | None]:
        """A slot to write each block into; None: refused (over quota, no
        evictable slot, service down) or already stored."""
        if len(owners) != len(keys):
            raise ValueError(f"owners: {len(owners)} for {len(keys)} keys")
        if not keys:
            return []
        reply = self._call(p.Reserve(client_id=self.client_id, keys=list(keys), owners=list(owners)))
        if isinstance(reply, p.Slots) and len(reply.slots) == len(keys):
            return reply.slots
        return [None] * len(keys)

    def commit(self, keys: list[bytes], slots: list[int]) -> None:
        """The blocks are written into their reserved slots: index them."""
        if len(slots) != len(keys):
            raise ValueError(f"slots: {len(slots)} for {len(keys)} keys")
        if keys:
            self._call(p.Commit(client_id=self.client_id, keys=list(keys), slots=list(slots)))

    def abandon(self, slots: list[int]) -> None:
        """Free reserved slots that will not be written."""
        if slots:
            self._call(p.Abandon(client_id=self.client_id, slots=list(slots)))

    def retain(self, keys: list[bytes], owner: BlockOwner, seconds: float) -> int:
        """Soft-pin the owner's blocks for ``seconds`` (0 lifts it); returns
        how many the tenant's bound let through (0 while down)."""
        if not seconds >= 0:
            raise ValueError(f"seconds: must be >= 0, got {seconds}")
        reply = self._call(p.Retain(client_id=self.client_id, keys=list(keys), owner=owner, seconds=float(seconds)))
        return reply.n if isinstance(reply, p.Count) else 0

    def drop_tenant(self, tenant: str) -> int:
        """Remove every private block of ``tenant`` from every tier."""
        reply = self._call(p.DropTenant(client_id=self.client_id, tenant=tenant))
        return reply.n if isinstance(reply, p.Count) else 0

    def drop_public(self, keys: list[bytes]) -> int:
        """Remove the public blocks of ``keys`` (a deleted public prefix's
        own) from every tier this node owns; private blocks stay."""
        reply = self._call(p.DropPublic(client_id=self.client_id, keys=list(keys)))
        return reply.n if isinstance(reply, p.Count) else 0

    def stats(self) -> StoreStats:
        """Per-tier counters; empty while the service is down."""
        reply = self._call(p.GetStats(client_id=self.client_id))
        return reply if isinstance(reply, StoreStats) else StoreStats(tiers={})

    def ping(self) -> bool:
        """Whether a service answers at the address now (ignores backoff;
        works before any arena exists)."""
        with self._lock:
            sock = self._new_socket()
            try:
                return self._roundtrip(sock, p.GetStats(client_id=self.client_id)) is not None
            finally:
                _close_socket(sock)

    def close(self) -> None:
        with self._lock:
            if self._service_id is not None and self._sock is not None:
                self._roundtrip(self._sock, p.Goodbye(client_id=self.client_id), timeout_s=min(self.timeout_s, 0.2))
            self._drop_socket()
            # Closed: a call from now on finds the store down (never a
            # socket on the terminated context).
            self._service_id, self._retry_at = None, float("inf")
            self._ctx.term()
            if self._arena is not None:
                self._arena.close()
                self._arena = None

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the connection -------------------------------------------------------------------------
    def _call(self, request: p.Request) -> p.Reply | None:
        """One round trip; None when the service is down (then the
        connection is dropped and retried after the backoff)."""
        with self._lock:
            for _ in range(2):  # a second time only after a restarted service said so
                if not self._ensure_connected():
                    return None
                request.service_id = self._service_id
                reply = self._roundtrip(self._sock, request)
                if reply is None:
                    self._connection_lost()
                    return None
                if not isinstance(reply, p.Restarted):
                    break
                logger.warning("kvstore at %s restarted: reconnecting", self.address)
                self._connection_lost(retry_now=True)
            else:
                return None
            if isinstance(reply, p.Refused):
                logger.debug("kvstore refused %s: %s", type(request).__name__, reply.reason)
            return reply

    def _ensure_connected(self) -> bool:
        if self._service_id is not None:
            if not _peer_gone(self._sock):
                return True
            # The store's end of the connection closed since the last call
            # (it died or restarted): say Hello again now. A restarted store
            # answers it; a dead one's refused connect fails it at once.
            self._connection_lost(retry_now=True)
        if time.monotonic() < self._retry_at:
            return False
        self._sock = self._new_socket()
        reply = self._roundtrip(self._sock, p.Hello(client_id=self.client_id, block_nbytes=self._want_block_nbytes))
        if not isinstance(reply, p.Welcome):
            if isinstance(reply, p.Refused):
                # A client with no block size (a probe, a stats reader) asking
                # before any engine made the arena is early, not refused:
                # every server start with a store does that once.
                early = self._want_block_nbytes is None and reply.reason.startswith(NO_ARENA_YET)
                logger.log(logging.DEBUG if early else logging.WARNING,
                           "kvstore at %s refused this client: %s", self.address, reply.reason)
            elif self._last_service_id is not None:
                self._warn_down()  # it was up before: it is gone, not starting
            self._drop_socket()
            self._backoff_s = min(max(self._backoff_s * 2, _BACKOFF_MIN_S), _BACKOFF_MAX_S)
            self._retry_at = time.monotonic() + self._backoff_s
            return False
        if self._arena is None or reply.arena_path != str(self._arena.path):
            try:
                arena = Arena.attach(reply.arena_path, reply.num_slots, reply.block_nbytes)
            except (OSError, ValueError) as exc:
                logger.warning("kvstore at %s: cannot map its arena: %s", self.address, exc)
                self._drop_socket()
                self._retry_at = time.monotonic() + _BACKOFF_MAX_S
                return False
            if self._arena is not None:
                self._arena.close()
            self._arena = arena
            self.generation += 1
        if reply.service_id != self._last_service_id:
            # A new service: nothing of the old one's survives.
            self._abandon(self._outstanding)
            self._abandoned.clear()
        self._service_id = self._last_service_id = reply.service_id
        self.num_slots, self.block_nbytes = reply.num_slots, reply.block_nbytes
        if self._abandoned:  # the same service is back: unpin what we gave up on
            tickets, self._abandoned = sorted(self._abandoned), set()
            self._roundtrip(self._sock, p.Release(client_id=self.client_id, service_id=reply.service_id,
                                                  tickets=tickets))
        self._backoff_s = 0.0
        if self._warned_down:
            logger.warning("kvstore at %s is back", self.address)
            self._warned_down = False
        return True

    def _connection_lost(self, retry_now: bool = False) -> None:
        if not retry_now:
            self._warn_down()
        self._drop_socket()
        self._service_id = None
        self._backoff_s = _BACKOFF_MIN_S
        self._retry_at = 0.0 if retry_now else time.monotonic() + self._backoff_s

    def _warn_down(self) -> None:
        if not self._warned_down:
            logger.warning("kvstore at %s does not answer: tiers below the device pool are off until it does",
                           self.address)
            self._warned_down = True

    def _abandon(self, tickets: set[int]) -> None:
        """Report ``tickets`` finished and empty (the engine recomputes)."""
        self._ready.extend(LoadResult(ticket=t, slots=[]) for t in sorted(tickets))
        self._abandoned |= tickets
        self._outstanding -= tickets

    def _new_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        # Watch the connection before connecting, so that a refused first
        # connect is seen too (see _peer_gone).
        sock.get_monitor_socket(_PEER_GONE_EVENTS).setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        return sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            _close_socket(self._sock)
            self._sock = None

    def _roundtrip(self, sock: zmq.Socket, request: p.Request, timeout_s: float | None = None) -> p.Reply | None:
        """Send and wait for the reply; None on timeout (the REQ socket is
        then unusable: the caller drops it)."""
        try:
            request.token = self._token
            sock.send(p.encode(request))
            # Wait for the reply or for the store's end to close, whichever
            # comes first: a killed store fails the call (and the loads it
            # polls for) within a step, not after the whole timeout.
            monitor = sock.get_monitor_socket()
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            deadline = time.monotonic() + (timeout_s or self.timeout_s)
            while True:
                ready = dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
                if sock in ready or (monitor in ready and sock.poll(0, zmq.POLLIN)):
                    return p.decode(sock.recv(), p.Reply)  # (a reply that raced the close still counts)
                if monitor in ready or time.monotonic() >= deadline:
                    return None
        except (zmq.ZMQError, msgspec.MsgspecError, ValueError) as exc:
            logger.debug("kvstore round trip failed: %s", exc)
            return None
