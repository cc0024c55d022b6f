"""Every store message survives its one serializer unchanged."""
import typing

import pytest

from kvferry.kvstore import protocol as p
from kvferry.kvstore.tier import BlockOwner, TenantTierStats, TierStats

K = b"\x01" * 32
REQUESTS = [
    p.Hello(client_id="c", block_nbytes=4096, service_id="s"), p.Hello(client_id="c"), p.Lookup(client_id="c", keys=[K, K]),
    p.BeginLoad(client_id="c", ticket=7, keys=[K], owners=[BlockOwner("acme", public=True)]),
    p.PollLoads(client_id="c"), p.PollLoads(client_id="c", tickets=[3]), p.Release(client_id="c", tickets=[1, 2]),
    p.Reserve(client_id="c", keys=[K], owners=[BlockOwner("acme")]), p.Commit(client_id="c", keys=[K], slots=[3]),
    p.Abandon(client_id="c", slots=[3]), p.Retain(client_id="c", keys=[K], owner=BlockOwner("b"), seconds=1.5),
    p.DropTenant(client_id="c", tenant="acme"), p.DropPublic(client_id="c", keys=[K]),
    p.GetStats(client_id="c"), p.Goodbye(client_id="c"),
]
REPLIES = [
    p.Welcome(service_id="s", arena_path="/dev/shm/x", num_slots=4, block_nbytes=8), p.Ok(), p.Count(n=3),
    p.Slots(slots=[1, None]), p.Loads(results=[p.LoadResult(ticket=1, slots=[0, 2])]), p.Refused(reason="no"), p.Restarted(service_id="s2"),
    p.StoreStats(tiers={"dram": TierStats(hits=1, load_seconds=0.5, per_tenant={"acme": TenantTierStats(misses=2)})},
                 num_slots=4, loads=2, load_seconds=1.0),
]


def test_every_message_type_is_covered():
    assert {type(m) for m in REQUESTS} == set(typing.get_args(p.Request))
    assert {type(m) for m in REPLIES} == set(typing.get_args(p.Reply))


@pytest.mark.parametrize("message", REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_round_trip(message):
    assert p.decode(p.encode(message), p.Request) == message


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: type(m).__name__)
def test_replies_round_trip(message):
    assert p.decode(p.encode(message), p.Reply) == message


def test_load_latency_is_the_mean_per_load():
    assert p.StoreStats(tiers={}, loads=4, load_seconds=2.0).load_latency_s == 0.5
    assert p.StoreStats(tiers={}).load_latency_s == 0.0
