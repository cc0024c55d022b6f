"""Router: which live worker a request goes to, from the membership, the
prefix index and the workers' load; and what it raises when none can."""
from __future__ import annotations

import random

import pytest
from msgspec.structs import replace

from kvferry.core.hashing import CacheScope, ChainKeys, extend_block_hashes
from kvferry.types.kv_events import BlockStored
from kvferry.router.admission import SloConfig
from kvferry.router.config import RouterConfig
from kvferry.router.errors import EngineDeadError, EngineRestartingError
from kvferry.router.membership import Membership
from kvferry.router.prefix_index import PrefixIndex
from kvferry.router.routing import Router
from tests.router.fakes import BLOCK_SIZE, READY, make_request, make_worker


def router_of(*workers, mode: str = "colocated", **config) -> Router:
    members = Membership(mode, READY)
    for worker in workers:
        members.add(worker)
    return Router(members, RouterConfig(mode=mode, **config), PrefixIndex(), random.Random(0))


def stored(hashes) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[0] * (BLOCK_SIZE * len(hashes)),
                       block_size=BLOCK_SIZE, owner="")


def test_block_hashes_are_the_cores_own_chain_of_the_requests_scope():
    router = router_of(make_worker("engine-0"))
    request = replace(make_request(), cache_scope=CacheScope(namespace="tenant-a"))
    expected: list[bytes] = []
    extend_block_hashes(expected, request.prompt_token_ids, BLOCK_SIZE,
                        ChainKeys.of(CacheScope(namespace="tenant-a"), "fp", "float32"))
    assert router.block_hashes(request) == expected and len(expected) == 4
    other = replace(request, cache_scope=CacheScope(namespace="tenant-b"))
    assert not set(router.block_hashes(other)) & set(expected)


def test_a_single_worker_takes_everything_uncached():
    only = make_worker("engine-0")
    router = router_of(only)
    router.index.apply("engine-0", [stored(router.block_hashes(make_request()))])
    # Nothing to weigh: the overlap is not even looked up.
    assert router.choose(make_request()) == (only, 16)


def test_the_worker_holding_the_prefix_wins_and_computes_less():
    cold, warm = make_worker("engine-0"), make_worker("engine-1")
    router = router_of(cold, warm)
    request = make_request()
    router.index.apply("engine-1", [stored(router.block_hashes(request)[:3])])
    worker, new_tokens = router.choose(request)
    assert worker is warm and new_tokens == 16 - 3 * BLOCK_SIZE
    assert warm.last_chosen == 1


def test_a_queue_outweighs_a_small_overlap():
    busy, idle = make_worker("engine-0"), make_worker("engine-1")
    router = router_of(busy, idle)
    request = make_request()
    router.index.apply("engine-0", [stored(router.block_hashes(request)[:1])])
    busy.queued_prefill["other"] = 100
    assert router.choose(request) == (idle, 16)


def test_equal_workers_take_turns():
    a, b = make_worker("engine-0"), make_worker("engine-1")
    router = router_of(a, b)
    chosen = [router.choose(make_request(f"r{i}"))[0].name for i in range(4)]
    assert chosen == ["engine-0", "engine-1", "engine-0", "engine-1"]


def test_with_slos_even_one_worker_is_weighed():
    only = make_worker("engine-0")
    router = router_of(only, slo=SloConfig(ttft_slo_ms=100))
    request = make_request()
    router.index.apply("engine-0", [stored(router.block_hashes(request)[:2])])
    assert router.choose(request) == (only, 16 - 2 * BLOCK_SIZE)


def test_only_live_accepting_workers_of_the_role_are_chosen():
    leaving = make_worker("engine-0", accepting=False)
    dead = make_worker("engine-1", alive=False)
    live = make_worker("engine-2")
    router = router_of(leaving, dead, live)
    assert {router.choose(make_request(f"r{i}"))[0].name for i in range(3)} == {"engine-2"}


def test_no_live_worker_raises_restarting_then_dead_then_the_fleets_error():
    dead = make_worker("engine-0", alive=False, restarting=True)
    router = router_of(dead)
    with pytest.raises(EngineRestartingError, match="engine-0 restarting"):
        router.choose(make_request())
    dead.restarting = False
    with pytest.raises(EngineDeadError, match="no engine core is accepting requests"):
        router.choose(make_request())
    router.members.dead_error = EngineDeadError("no engine restart left")
    with pytest.raises(EngineDeadError, match="no engine restart left"):
        router.choose(make_request())


def test_decode_goes_to_the_less_loaded_of_two():
    full = make_worker("decode-0", "decode")
    full.stats.kv_blocks_used = 60
    empty = make_worker("decode-1", "decode")
    router = router_of(make_worker("prefill-0", "prefill"), full, empty, mode="disagg")
    assert all(router.choose_decode() is empty for _ in range(5))
    empty.alive = full.alive = False
    with pytest.raises(EngineDeadError, match="no decode core is accepting requests"):
        router.choose_decode()
    full.restarting = True
    with pytest.raises(EngineRestartingError, match="decode-0 restarting"):
        router.choose_decode()
