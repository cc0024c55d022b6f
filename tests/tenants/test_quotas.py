"""Device-pool quotas and eviction per tenant: a tenant's salted namespaces
share its quota, the tenant most over its share loses blocks first, every
eviction is counted against its owner, and a purge drops only unused blocks."""
from __future__ import annotations

from kvferry.core.hashing import CacheScope
from kvferry.core.kv_manager import OWNER_STAT_FIELDS, KVCacheManager
from kvferry.core.request import Request
from kvferry.sampling import SamplingParams
from tests.tenants.test_scoped_hashing import run_prefill

EVICTED = OWNER_STAT_FIELDS.index("evicted_blocks")


def tenant_request(rid: str, tenant: str, first: int, ns: str | None = None, quota: int | None = None,
                   weight: float = 1.0, num_blocks: int = 4) -> Request:
    tokens = list(range(first, first + 4 * num_blocks)) + [7]  # num_blocks private blocks of 4
    scope = CacheScope(ns or f"ns-{tenant}", quota_blocks=quota, tenant=tenant, tenant_weight=weight)
    return Request(rid, tokens, SamplingParams(max_tokens=1), cache_scope=scope)


def test_a_tenants_salted_namespaces_share_its_quota():
    kv = KVCacheManager(64, 4)
    run_prefill(kv, tenant_request("a1", "acme", 100, ns="acme-salt-1", quota=6))
    run_prefill(kv, tenant_request("a2", "acme", 500, ns="acme-salt-2", quota=6))
    assert len(kv.owned["acme"]) == 6  # 4 + 2, not 4 + 4 (one quota for both namespaces)
    assert kv.owner_stats()["acme"][OWNER_STAT_FIELDS.index("refused_blocks")] == 2
    kv.check_integrity()


def test_the_tenant_most_over_its_share_is_evicted_first():
    kv = KVCacheManager(24, 4)
    run_prefill(kv, tenant_request("q1", "quiet", 100))  # 4 blocks of quiet, the oldest
    for i in range(4):  # the flood: 16 blocks
        run_prefill(kv, tenant_request(f"f{i}", "flood", 1000 + 100 * i))
    assert len(kv.owned["quiet"]) == 4
    # More of the flood: the pool must evict; LRU would take quiet's (oldest) blocks.
    for i in range(4, 8):
        run_prefill(kv, tenant_request(f"f{i}", "flood", 1000 + 100 * i))
    assert len(kv.owned["quiet"]) == 4
    assert run_prefill(kv, tenant_request("q2", "quiet", 100)) == 16  # quiet still hits all of it
    stats = kv.owner_stats()
    # Each flood request takes 5 blocks (4 full, 1 partial that goes back to
    # the head of the queue as a plain block): 4 plain blocks, then 1 + 4 + 4 + 4
    # evictions, every one of them the flood's.
    assert stats["flood"][EVICTED] == 13 and stats["quiet"][EVICTED] == 0
    kv.check_integrity()


def test_lru_alone_when_shares_are_even():
    # Two tenants each within their share: plain LRU (the oldest goes first).
    kv = KVCacheManager(14, 4)
    run_prefill(kv, tenant_request("a1", "a", 100))
    run_prefill(kv, tenant_request("b1", "b", 500))
    run_prefill(kv, tenant_request("a2", "a", 900, num_blocks=2))
    run_prefill(kv, tenant_request("b2", "b", 1300, num_blocks=2))
    run_prefill(kv, tenant_request("a3", "a", 1700, num_blocks=1))  # 13 cached, 1 plain block left
    run_prefill(kv, tenant_request("b3", "b", 1900, num_blocks=1))  # the pool now evicts (a: 7 of 13)
    stats = kv.owner_stats()
    assert stats["a"][EVICTED] >= 1 and stats["b"][EVICTED] == 0, stats  # the oldest blocks were a1's


def test_weights_set_the_share():
    def flood_light(heavy_weight: float) -> KVCacheManager:
        kv = KVCacheManager(30, 4)
        for i in range(3):
            run_prefill(kv, tenant_request(f"h{i}", "heavy", 100 * i, weight=heavy_weight))
        for i in range(9):
            run_prefill(kv, tenant_request(f"l{i}", "light", 1000 + 100 * i, num_blocks=2))
        kv.check_integrity()
        return kv

    # Weight 3: heavy's 12 blocks are within its three quarters; light pays.
    kv = flood_light(3.0)
    assert len(kv.owned["heavy"]) == 12 and kv.owner_stats()["heavy"][EVICTED] == 0
    assert kv.owner_stats()["light"][EVICTED] > 0
    # Weight 1/3: the same 12 blocks are over its quarter; heavy pays.
    assert flood_light(1 / 3).owner_stats()["heavy"][EVICTED] > 0


def test_purge_drops_only_unused_blocks_of_the_tenant():
    kv = KVCacheManager(64, 4)
    run_prefill(kv, tenant_request("a1", "acme", 100))
    run_prefill(kv, tenant_request("b1", "beta", 100))
    running = tenant_request("a2", "acme", 900)
    hit = kv.find_prefix_hit(running)
    kv.allocate_slots(running, running.num_tokens - hit.num_tokens, hit)
    running.num_computed_tokens = running.num_tokens
    kv.cache_computed_blocks(running)  # 4 more acme blocks, held by a running request
    assert len(kv.owned["acme"]) == 8
    assert kv.purge("acme") == 4  # a1's; a2's are in use
    assert len(kv.owned["acme"]) == 4 and len(kv.owned["beta"]) == 4
    assert run_prefill(kv, tenant_request("a3", "acme", 100)) == 0  # gone
    assert run_prefill(kv, tenant_request("b2", "beta", 100)) == 16  # beta untouched
    assert kv.purge("nobody") == 0
    kv.free(running)
    kv.check_integrity()
