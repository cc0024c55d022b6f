"""One cache secret for every node store of a server: two node stores
started as a ``kvferry serve --ray`` server starts them (``NodeStoreSpec``,
``start_node_store``), each with a cache folder of its own as on two hosts,
on one real mooncake_master on loopback, read each other's public and
private blocks; the secret is in neither's argv nor environment."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.store_helpers import BLOCK_NBYTES, block_bytes, gb, key, wait_loads

pytest.importorskip("ray", reason="node stores are a Ray server's (pip install kvferry[ray])")

ACME = BlockOwner("acme")
BETA = BlockOwner("beta")
PUBLIC_ACME = BlockOwner("acme", public=True)
PUBLIC_BETA = BlockOwner("beta", public=True)


def save(client, keys, owner, seeds):
    slots = client.reserve(keys, [owner] * len(keys))
    assert None not in slots, slots
    arena = client.arena()
    for slot, seed in zip(slots, seeds):
        arena[slot] = block_bytes(seed)
    client.commit(keys, slots)


def load_bytes(client, keys, owner):
    ticket = client.begin_load(keys, [owner] * len(keys))
    (result,) = wait_loads(client, timeout_s=30)
    assert result.ticket == ticket
    arena = client.arena()
    data = [arena[slot].copy() for slot in result.slots]
    client.release(ticket)
    return data


def wait_for(condition, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_node_stores_of_one_server_share_public_and_private_blocks(master, tmp_path, monkeypatch):
    from kvferry.config import KVTierConfig
    from kvferry.fleet.node_store import NodeStoreSpec, start_node_store
    from kvferry.kvstore.client import KVStoreClient
    from kvferry.kvstore.secret_file import server_cache_secret

    # What the server hands its node stores when the operator gave no
    # --cache-secret-file (--kv-cluster auto: nothing kept beside a tier).
    secret = server_cache_secret(None)
    spec = NodeStoreSpec(KVTierConfig(kv_dram_gb=gb(16), kv_cluster=master.url + "&namespace=oneserver"),
                         None, secret, {}, 0)
    procs, clients = [], []
    try:
        for node in ("a", "b"):
            # Each node's own cache folder: a store that made up its own
            # secret would keep it there, unlike the other node's.
            monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path / f"cache-{node}"))
            address = f"ipc://{tmp_path}/{node}.sock"
            procs.append(start_node_store(spec, address))
            clients.append(KVStoreClient(address, block_nbytes=BLOCK_NBYTES, timeout_s=5.0))
        a, b = clients
        private = [key(i, b"priv") for i in range(3)]
        public = [key(i, b"pub") for i in range(2)]
        save(a, private, ACME, [0, 1, 2])  # written through to the pool at commit
        save(a, public, PUBLIC_ACME, [10, 11])
        wait_for(lambda: b.lookup(private) == 3 and b.lookup(public) == 2,
                 "store B never saw store A's blocks in the pool")
        for got, seed in zip(load_bytes(b, private, ACME), [0, 1, 2]):
            np.testing.assert_array_equal(got, block_bytes(seed))
        # A public prefix is every tenant's.
        for got, seed in zip(load_bytes(b, public, PUBLIC_BETA), [10, 11]):
            np.testing.assert_array_equal(got, block_bytes(seed))
        # Another tenant's private blocks stay its own.
        assert load_bytes(b, private, BETA) == []
        # And the other way round: A reads what B wrote.
        more = [key(i, b"back") for i in range(2)]
        save(b, more, ACME, [20, 21])
        wait_for(lambda: a.lookup(more) == 2, "store A never saw store B's blocks in the pool")
        for got, seed in zip(load_bytes(a, more, ACME), [20, 21]):
            np.testing.assert_array_equal(got, block_bytes(seed))
        for client in (a, b):
            cluster = client.stats().tiers["cluster"]
            assert cluster.quarantined == 0, cluster  # nothing looked forged: one secret
        assert b.stats().tiers["cluster"].hits == 5 and a.stats().tiers["cluster"].hits == 2
        for proc in procs:
            # The secret reached the stores by pipe: not in argv (every user's
            # ps shows it), nor in the environment their children inherit.
            for what in ("cmdline", "environ"):
                assert secret not in open(f"/proc/{proc.pid}/{what}", "rb").read(), what
        # Neither made up a secret of its own beside its tier.
        for node in ("a", "b"):
            folder = tmp_path / f"cache-{node}"
            assert not folder.exists() or os.listdir(folder) == []
    finally:
        for client in clients:
            client.close()
        for proc in procs:
            proc.terminate()
            assert proc.wait(20) == 0, f"the store exited with {proc.returncode}"
