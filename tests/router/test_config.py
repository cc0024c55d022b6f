"""RouterConfig validation, worker addresses, and stats merged across cores."""
from __future__ import annotations

import pytest

from kvferry.types.stats import SchedulerStats
from kvferry.engine.core_addresses import CoreAddresses, parse_cpus
from kvferry.router.config import RouterConfig, split_worker
from kvferry.router.stats import merge_stats


def test_one_address_names_both_sockets():
    assert CoreAddresses.from_address("tcp://10.0.0.5:7000") == CoreAddresses("tcp://10.0.0.5:7000",
                                                                             "tcp://10.0.0.5:7001")
    assert CoreAddresses.from_address("ipc:///tmp/core") == CoreAddresses("ipc:///tmp/core-input",
                                                                         "ipc:///tmp/core-output")
    for bad in ("http://x:1", "tcp://nohost", "tcp://h:99999", "ipc://"):
        with pytest.raises(ValueError, match="address"):
            CoreAddresses.from_address(bad)


def test_cpus_and_roles_are_checked():
    assert parse_cpus("0,2-3") == {0, 2, 3}
    with pytest.raises(ValueError, match="cpus"):
        parse_cpus("a-b")
    assert split_worker("tcp://h:1", "colocated") == ("engine", "tcp://h:1")
    assert split_worker("prefill=tcp://h:1", "disagg") == ("prefill", "tcp://h:1")
    with pytest.raises(ValueError, match="role"):
        split_worker("tcp://h:1", "disagg")  # disagg needs a role
    with pytest.raises(ValueError, match="role"):
        split_worker("chef=tcp://h:1", "disagg")


def test_router_config_validation_names_the_field():
    with pytest.raises(ValueError, match="mode"):
        RouterConfig(mode="mesh")
    with pytest.raises(ValueError, match="data_parallel_size"):
        RouterConfig(data_parallel_size=0)
    RouterConfig(data_parallel_size=0, worker_addresses=["tcp://h:1"])  # joined cores only
    with pytest.raises(ValueError, match="engine_cpus"):
        RouterConfig(data_parallel_size=3, engine_cpus=["0", "1"])
    with pytest.raises(ValueError, match="prefill"):
        RouterConfig(mode="disagg", num_prefill=0)
    with pytest.raises(ValueError, match="engine_restarts"):
        RouterConfig(engine_restarts=-1)
    with pytest.raises(ValueError, match="engine_restart_window_s"):
        RouterConfig(engine_restart_window_s=0)
    RouterConfig(engine_restarts=0)  # no restart: the first death ends the server
    specs = RouterConfig(mode="disagg", num_prefill=2, num_decode=1, prefill_cpus="0", decode_cpus="1").core_specs()
    assert specs == [("prefill-0", "prefill", "0"), ("prefill-1", "prefill", "0"), ("decode-0", "decode", "1")]
    assert RouterConfig(data_parallel_size=2, engine_cpus=["0", "1"]).core_specs() == [
        ("engine-0", "engine", "0"), ("engine-1", "engine", "1")]


def test_stats_of_several_cores_are_summed():
    a = SchedulerStats(num_running=2, kv_blocks_used=5, kv_blocks_total=10, prefix_hits=16,
                       prefix_by_owner={"t": [1, 2, 0, 0, 3]}, num_accepted_tokens_per_pos=[4],
                       num_steps=2, step_seconds=0.5)
    b = SchedulerStats(num_running=1, kv_blocks_used=1, kv_blocks_total=10, prefix_hits=0,
                       prefix_by_owner={"t": [1, 0, 0, 0, 1], "u": [5, 5, 0, 0, 0]},
                       num_accepted_tokens_per_pos=[1, 1], num_steps=3, step_seconds=0.25)
    total = merge_stats([a, b])
    assert (total.num_steps, total.step_seconds) == (5, 0.75)
    assert (total.num_running, total.kv_blocks_used, total.kv_blocks_total, total.prefix_hits) == (3, 6, 20, 16)
    assert total.prefix_by_owner == {"t": [2, 2, 0, 0, 4], "u": [5, 5, 0, 0, 0]}
    assert total.num_accepted_tokens_per_pos == [5, 1]
    assert merge_stats([a]) is a


def test_store_counters_shared_by_cores_are_taken_once():
    # The cores of a node share one KV store: each reports the same store totals.
    tiers = {"dram": {"hits": 3.0, "misses": 1.0}}
    tenants = {"dram": {"acme": [3, 1]}}
    a = SchedulerStats(kv_tiers=tiers, kv_tier_tenants=tenants, kv_store_hits=32)
    b = SchedulerStats(kv_tiers=tiers, kv_tier_tenants=tenants, kv_store_hits=16)
    total = merge_stats([a, b])
    assert total.kv_tiers == tiers and total.kv_tier_tenants == tenants
    assert total.kv_store_hits == 48  # the engines' own lookups are per core


def test_store_counters_of_different_stores_are_added():
    # On a Ray cluster each node has its own store: the cores of node 1 share
    # one, node 2's core another; each store is counted once, and the two added.
    node1 = dict(kv_tiers={"dram": {"hits": 3.0, "misses": 1.0}}, kv_tier_tenants={"dram": {"acme": [3, 1]}},
                 kv_store_id="ipc:///tmp/store-node-1")
    node2 = dict(kv_tiers={"dram": {"hits": 2.0, "misses": 5.0}, "disk": {"hits": 1.0, "misses": 0.0}},
                 kv_tier_tenants={"dram": {"acme": [2, 5], "beta": [0, 1]}}, kv_store_id="ipc:///tmp/store-node-2")
    total = merge_stats([SchedulerStats(**node1), SchedulerStats(**node1), SchedulerStats(**node2)])
    assert total.kv_tiers == {"dram": {"hits": 5.0, "misses": 6.0}, "disk": {"hits": 1.0, "misses": 0.0}}
    assert total.kv_tier_tenants == {"dram": {"acme": [5, 6], "beta": [0, 1]}}
