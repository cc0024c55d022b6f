"""Messages between a KVStoreClient and the store service. No torch.

One request, one reply, over ZeroMQ (client REQ -> service ROUTER), each
direction one tagged union through one serializer (``encode`` /
``decode``: msgspec msgpack). Block bytes never cross this socket: they
live in the shared-memory arena, and messages carry slot numbers::

    client                                  service
    ------                                  -------
    Hello(client_id, block_nbytes) ------>  Welcome(arena_path, num_slots, ...)
    Lookup(keys)                   ------>  Count(n leading keys held)
    BeginLoad(ticket, keys, owners) ----->  Ok           (blocks come up in the background)
    PollLoads(tickets)             ------>  Loads([LoadResult(ticket, slots)])
    Release(tickets)               ------>  Ok           (unpins)
    Reserve(keys, owners)          ------>  Slots([slot | None])
    Commit(keys, slots)            ------>  Ok           (now indexed: readers see them)
    Abandon(slots)                 ------>  Ok
    Retain(keys, owner, seconds)   ------>  Count(blocks retained)
    DropTenant(tenant)             ------>  Count(blocks dropped)
    DropPublic(keys)               ------>  Count(blocks dropped)   (a deleted public prefix's own blocks)
    GetStats                       ------>  StoreStats
    Goodbye                        ------>  Ok           (frees the client's pins and reservations)
                                   <------  Refused(reason)   (any request the service cannot take)
                                   <------  Restarted         (the request was meant for an earlier service)

Every request carries the store's token (``kvferry.peer_auth``; refused
without it) and names its ``client_id`` so that tickets, pins and
reservations belong to one client, and a client that says Hello again
(it reconnected) or Goodbye gets its leftovers freed; so does one not heard
from for the client lease (``--client-lease-s``: it died without Goodbye).
"""
from __future__ import annotations

from typing import Union

import msgspec

# The project's one serializer (msgspec msgpack, a cached decoder per type).
from kvferry.messages import decode, encode  # noqa: F401 (re-exported)

from kvferry.kvstore.tier import BlockOwner, TierStats

__all__ = [
    "Abandon", "BeginLoad", "Commit", "Count", "DropTenant", "GetStats", "Goodbye", "Hello", "LoadResult",
    "Loads", "Lookup", "Ok", "PollLoads", "Refused", "Release", "Reply", "Request", "Reserve", "Restarted",
    "Retain", "Slots", "StoreStats", "Welcome", "decode", "encode",
]


class _Req(msgspec.Struct, kw_only=True, tag=True):
    client_id: str
    # The service this client said Hello to. A REQ socket reconnects to
    # whatever listens at the address, so a restarted service would
    # otherwise take requests (slots, tickets) meant for its predecessor:
    # it answers Restarted instead, and the client says Hello again.
    service_id: str = ""
    # peer_auth.token(KVSTORE): any local process can reach the socket, so
    # a request without the right token is refused before it runs.
    token: bytes = b""


class Hello(_Req):
    # The block size the client's engine uses; the service takes it from the
    # first Hello when it was started without --block-nbytes, and refuses a
    # client whose size differs from the arena's. None: ask, do not set.
    block_nbytes: int | None = None


class Lookup(_Req):
    keys: list[bytes]


class BeginLoad(_Req):
    ticket: int  # chosen by the client (unique per client_id)
    keys: list[bytes]
    owners: list[BlockOwner]


class PollLoads(_Req):
    # The tickets the client still waits for: one the service does not know
    # (it forgot the client: a lease ran out, a Hello again) comes back
    # finished and empty, so no engine waits on it forever.
    tickets: list[int] = []


class Release(_Req):
    tickets: list[int]


class Reserve(_Req):
    keys: list[bytes]
    owners: list[BlockOwner]


class Commit(_Req):
    keys: list[bytes]
    slots: list[int]


class Abandon(_Req):
    slots: list[int]


class Retain(_Req):
    keys: list[bytes]
    owner: BlockOwner
    seconds: float


class DropTenant(_Req):
    tenant: str


class DropPublic(_Req):
    """Public blocks by key (a deleted public prefix's own): a private
    block is never dropped this way, whatever key names it."""

    keys: list[bytes]


class GetStats(_Req):
    pass


class Goodbye(_Req):
    pass


Request = Union[Hello, Lookup, BeginLoad, PollLoads, Release, Reserve, Commit, Abandon, Retain, DropTenant,
                DropPublic, GetStats, Goodbye]


class Welcome(msgspec.Struct, kw_only=True, tag=True):
    # Changes on every service start: a client that sees a new one remaps.
    service_id: str
    arena_path: str
    num_slots: int
    block_nbytes: int


class Ok(msgspec.Struct, kw_only=True, tag=True):
    pass


class Count(msgspec.Struct, kw_only=True, tag=True):
    n: int


class Slots(msgspec.Struct, kw_only=True, tag=True):
    slots: list[int | None]


class LoadResult(msgspec.Struct, kw_only=True):
    """A finished load: ``slots[i]`` holds ``keys[i]`` for a leading run of
    the ticket's keys (shorter than the keys when a block was missing,
    corrupt or unreadable: the engine recomputes the rest). The slots stay
    pinned until ``release(ticket)``."""

    ticket: int
    slots: list[int]


class Loads(msgspec.Struct, kw_only=True, tag=True):
    results: list[LoadResult]


class StoreStats(msgspec.Struct, kw_only=True, tag=True):
    """Per tier ("dram", then the cold tiers by name): hits, misses, bytes,
    load latency, quarantined blocks, refused writes, per tenant hit rates
    (``TierStats.per_tenant``); plus the arena's occupancy."""

    tiers: dict[str, TierStats]
    num_slots: int = 0
    block_nbytes: int = 0
    used_slots: int = 0
    pinned_slots: int = 0
    retained_blocks: int = 0
    evictions: int = 0
    written_back: int = 0  # DRAM evictions written down to the cold tiers
    write_backs_dropped: int = 0  # evictions not written down: the write-back queue was full
    loads: int = 0  # begin_load tickets finished
    load_seconds: float = 0.0  # their total time from begin_load to result

    @property
    def load_latency_s(self) -> float:
        """Mean seconds from begin_load to its result."""
        return self.load_seconds / self.loads if self.loads else 0.0


class Refused(msgspec.Struct, kw_only=True, tag=True):
    reason: str


class Restarted(msgspec.Struct, kw_only=True, tag=True):
    """The request named another service_id: this is a new service."""

    service_id: str


Reply = Union[Welcome, Ok, Count, Slots, Loads, StoreStats, Refused, Restarted]

