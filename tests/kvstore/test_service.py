"""The store service as a real process, reached through real sockets and
real shared memory by clients in this and other processes."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import zmq

from kvferry import peer_auth
from kvferry.kvstore.tier import BlockOwner

from tests.kvstore.store_helpers import BLOCK_NBYTES, arena_files, block_bytes, gb, key, wait_loads

A = BlockOwner("acme")
B = BlockOwner("bolt")


def save(client, keys, owner, seeds):
    slots = client.reserve(keys, [owner] * len(keys))
    arena = client.arena()
    written = [(k, s) for k, s in zip(keys, slots) if s is not None]
    for (k, slot), seed in zip(zip(keys, slots), seeds):
        if slot is not None:
            arena[slot] = block_bytes(seed)
    client.commit([k for k, _ in written], [s for _, s in written])
    return slots


def load(client, keys, owner):
    ticket = client.begin_load(keys, [owner] * len(keys))
    (result,) = wait_loads(client)
    assert result.ticket == ticket
    return result


def test_blocks_round_trip_bit_exact_between_two_processes(store_factory, clients):
    _, address = store_factory(64)
    writer = textwrap.dedent(f"""
        import numpy as np
        from kvferry.kvstore.client import KVStoreClient
        from kvferry.kvstore.tier import BlockOwner
        c = KVStoreClient({address!r}, block_nbytes={BLOCK_NBYTES})
        keys = [b"k" + i.to_bytes(8, "little") + bytes(23) for i in range(40)]
        slots = c.reserve(keys, [BlockOwner("acme")] * 40)
        assert None not in slots, slots
        arena = c.arena()
        for i, s in enumerate(slots):
            arena[s] = np.random.default_rng(i).integers(0, 256, {BLOCK_NBYTES}, dtype=np.uint8)
        c.commit(keys, slots)
        c.close()
    """)
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=60, env=os.environ)
    reader = clients(address, block_nbytes=BLOCK_NBYTES)
    keys = [key(i) for i in range(40)]
    assert reader.lookup(keys + [key(99)]) == 40
    result = load(reader, keys, A)
    assert len(result.slots) == 40
    arena = reader.arena()
    for i, slot in enumerate(result.slots):
        np.testing.assert_array_equal(arena[slot], block_bytes(i))
    stats = reader.stats()
    assert stats.tiers["dram"].hits == 40 and stats.tiers["dram"].bytes_read == 40 * BLOCK_NBYTES
    assert stats.tiers["dram"].per_tenant["acme"].hits == 40
    assert stats.pinned_slots == 40
    reader.release(result.ticket)
    assert reader.stats().pinned_slots == 0


def test_a_load_stops_at_the_first_missing_block_and_never_serves_another_tenants(store_factory, clients):
    _, address = store_factory(16)
    client = clients(address)
    save(client, [key(0), key(1), key(3)], A, [0, 1, 3])
    result = load(client, [key(0), key(1), key(2), key(3)], A)
    assert len(result.slots) == 2  # key(2) is missing: the run ends there, key(3) is not pinned
    assert client.stats().pinned_slots == 2
    assert load(client, [key(0)], B).slots == []  # acme's block, asked for by bolt
    stats = client.stats().tiers["dram"]
    assert stats.per_tenant["acme"].misses == 1 and stats.per_tenant["bolt"].misses == 1


def test_reserve_refuses_what_is_stored_and_commit_makes_it_visible(store_factory, clients):
    _, address = store_factory(16)
    c1, c2 = clients(address), clients(address)
    (slot,) = c1.reserve([key(0)], [A])
    assert c2.reserve([key(0)], [A]) == [None]  # being written by c1
    assert c2.lookup([key(0)]) == 0  # not readable before the commit
    c2.commit([key(0)], [slot])  # not c2's reservation: ignored
    assert c1.lookup([key(0)]) == 0
    c1.commit([key(0)], [slot])
    assert c2.lookup([key(0)]) == 1
    (other,) = c1.reserve([key(1)], [A])
    c1.abandon([other])
    assert c1.lookup([key(1)]) == 0 and c1.stats().used_slots == 1


def test_tenant_quota_from_key_file_keeps_its_own_lru_and_refuses_when_pinned(store_factory, clients, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"sk-a": {"tenant": "acme", "quota": {"dram_gb": gb(2)}},
                                     "sk-b": {"tenant": "bolt"}}))
    _, address = store_factory(16, api_keys=str(keys_file))
    client = clients(address)
    save(client, [key(9, b"b")], B, [9])
    # One reserve of 3 blocks over a quota of 2: the third has nothing of
    # acme's to evict yet (the first two are being written), so it is refused.
    assert save(client, [key(i) for i in range(3)], A, range(3))[2] is None
    save(client, [key(3)], A, [3])  # now acme's least recently used block makes room
    assert client.lookup([key(0)]) == 0 and client.lookup([key(1)]) == 1
    save(client, [key(2)], A, [2])
    assert client.lookup([key(2), key(3)]) == 2
    assert client.lookup([key(9, b"b")]) == 1  # bolt's block was never acme's to evict
    result = load(client, [key(2), key(3)], A)
    assert client.reserve([key(5)], [A]) == [None]  # both of acme's blocks are pinned
    stats = client.stats().tiers["dram"]
    assert stats.refused_writes == 2 and stats.per_tenant["acme"].refused_writes == 2
    client.release(result.ticket)
    assert client.reserve([key(5)], [A]) != [None]


def test_pinned_blocks_survive_pressure_bit_exact(store_factory, clients):
    _, address = store_factory(4)
    client = clients(address)
    save(client, [key(0), key(1)], A, [0, 1])
    result = load(client, [key(0), key(1)], A)
    for i in range(2, 12):
        save(client, [key(i)], A, [i])
    assert client.lookup([key(0), key(1)]) == 2
    arena = client.arena()
    for i, slot in enumerate(result.slots):
        np.testing.assert_array_equal(arena[slot], block_bytes(i))
    assert client.stats().evictions == 8


def test_retained_blocks_survive_pressure_until_they_expire(store_factory, clients):
    _, address = store_factory(4)
    client = clients(address)
    save(client, [key(0), key(1)], A, [0, 1])
    assert client.retain([key(0), key(1)], A, 0.6) == 2
    assert client.stats().retained_blocks == 2
    for i in range(2, 8):
        save(client, [key(i)], A, [i])
    assert client.lookup([key(0), key(1)]) == 2
    time.sleep(0.7)
    for i in range(8, 12):
        save(client, [key(i)], A, [i])
    assert client.lookup([key(0)]) == 0 and client.lookup([key(1)]) == 0
    assert client.stats().retained_blocks == 0


def test_drop_tenant_removes_only_that_tenants_blocks(store_factory, clients):
    _, address = store_factory(16)
    client = clients(address)
    save(client, [key(i) for i in range(3)], A, range(3))
    save(client, [key(i, b"b") for i in range(2)], B, range(2))
    save(client, [key(0, b"p")], BlockOwner("acme", public=True), [7])
    assert client.drop_tenant("acme") == 3
    assert client.lookup([key(0)]) == 0
    assert client.lookup([key(0, b"b"), key(1, b"b")]) == 2
    assert client.lookup([key(0, b"p")]) == 1  # public blocks belong to no tenant
    assert client.stats().used_slots == 3


def test_drop_public_removes_those_public_blocks_from_dram_and_disk_and_nothing_else(store_factory, clients,
                                                                                    tmp_path):
    # 4 DRAM slots under 8 public blocks and 2 more: the 6 evicted ones are
    # written down to the disk tier, so both tiers hold the deleted prefix's.
    _, address = store_factory(4, kv_disk=str(tmp_path / "disk"), kv_disk_gb=gb(64))
    client = clients(address)
    public = BlockOwner(public=True)
    doomed, kept, private = [key(i, b"p") for i in range(8)], key(0, b"q"), key(0, b"a")
    for k in doomed:
        save(client, [k], public, [1])
    save(client, [kept], public, [2])
    save(client, [private], A, [3])
    deadline = time.monotonic() + 30
    while client.stats().tiers["disk"].num_blocks < 6:  # the write-backs are asynchronous
        assert time.monotonic() < deadline, client.stats()
        time.sleep(0.05)
    assert client.lookup(doomed) == 8
    # A private block named among the keys stays: DropPublic drops public blocks only.
    assert client.drop_public(doomed + [private]) == 8
    assert all(client.lookup([k]) == 0 for k in doomed)
    assert client.lookup([kept]) == 1 and client.lookup([private]) == 1
    stats = client.stats()
    assert stats.tiers["disk"].num_blocks == 0 and stats.used_slots == 2
    assert client.drop_public(doomed) == 0


def test_a_killed_store_gives_misses_then_the_client_reconnects_to_a_new_one(store_factory, clients, address):
    proc, _ = store_factory(16)
    client = clients(address, timeout_s=0.3)
    save(client, [key(0)], A, [0])
    ticket = client.begin_load([key(0)], [A])  # answered by the service, not yet polled
    first_arena = client.arena()
    generation = client.generation
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    t0 = time.monotonic()
    assert client.poll_loads()[0].ticket == ticket  # the lost ticket comes back, empty
    assert client.lookup([key(0)]) == 0
    assert client.reserve([key(1)], [A]) == [None]
    assert client.retain([key(0)], A, 5) == 0 and client.drop_tenant("acme") == 0
    assert client.stats().tiers == {}
    t2 = client.begin_load([key(0)], [A])
    assert [(r.ticket, r.slots) for r in client.poll_loads()] == [(t2, [])]
    assert not client.connected
    assert time.monotonic() - t0 < 3.0  # each failure costs one timeout at most, then backoff answers at once
    assert first_arena.shape == (16, BLOCK_NBYTES)  # a view taken before still reads (its memory stays mapped)

    store_factory(8)  # a new store at the same address
    deadline = time.monotonic() + 5
    while not client.connected:
        assert time.monotonic() < deadline, "the client did not reconnect"
        time.sleep(0.05)
    assert client.generation == generation + 1 and client.num_slots == 8
    assert client.lookup([key(0)]) == 0  # a fresh store (DRAM only) starts empty
    save(client, [key(1)], A, [1])
    result = load(client, [key(1)], A)
    np.testing.assert_array_equal(client.arena()[result.slots[0]], block_bytes(1))


def test_block_size_comes_from_the_first_client_and_others_are_refused(store_factory, clients):
    _, address = store_factory(16, block_nbytes=None)
    assert clients(address).connected is False  # no block size: no arena to offer
    first = clients(address, block_nbytes=2 * BLOCK_NBYTES)
    assert first.connected and first.block_nbytes == 2 * BLOCK_NBYTES and first.num_slots == 8
    assert first.arena().shape == (8, 2 * BLOCK_NBYTES)
    other = clients(address, block_nbytes=BLOCK_NBYTES)
    assert not other.connected and other.lookup([key(0)]) == 0
    assert clients(address).connected  # a client that states no size takes the arena's


def test_malformed_requests_are_refused_and_the_store_keeps_serving(store_factory, clients):
    from kvferry.kvstore import protocol as p

    _, address = store_factory(16)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.connect(address)
    try:
        token = peer_auth.token(peer_auth.KVSTORE)
        for body in (b"\x00garbage", p.encode(p.Reserve(client_id="x", keys=[key(0)], owners=[], token=token))):
            sock.send(body)
            assert sock.poll(5000)
            reply = p.decode(sock.recv(), p.Reply)
            assert isinstance(reply, p.Refused)
        assert "owners" in reply.reason
    finally:
        sock.close(0)
        ctx.term()
    client = clients(address)
    with pytest.raises(ValueError, match="owners"):
        client.reserve([key(0)], [])
    with pytest.raises(ValueError, match="seconds"):
        client.retain([key(0)], A, -1)
    assert client.reserve([key(0)], [A]) == [0]


def test_the_store_process_imports_no_torch_starts_fast_and_cleans_up_on_sigterm(store_factory):
    t0 = time.monotonic()
    proc, _ = store_factory(16)
    started = time.monotonic() - t0
    with open(f"/proc/{proc.pid}/maps") as f:
        assert "torch" not in f.read()
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
        assert f.read().startswith(b"kvferry: kvstore")
    assert started < 10.0, started  # a cold python with numpy and zmq; torch alone takes longer
    assert len(arena_files(proc.pid)) == 1
    proc.terminate()
    assert proc.wait(10) == 0
    assert arena_files(proc.pid) == []


def test_the_store_exits_when_the_process_that_started_it_dies(tmp_path):
    address = f"ipc://{tmp_path}/orphan.sock"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from kvferry.config import KVTierConfig
        from kvferry.kvstore.launch import start_store
        proc, _ = start_store(KVTierConfig(kv_store={address!r}, kv_dram_gb={gb(4)}), block_nbytes={BLOCK_NBYTES})
        print(proc.pid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        store_pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{store_pid}") and open(f"/proc/{store_pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, "the store outlived its parent"
        time.sleep(0.05)
    assert arena_files(store_pid) == []


def test_a_store_restarted_at_the_same_address_is_noticed_on_the_next_call(store_factory, clients):
    proc, address = store_factory(16)
    client = clients(address)
    save(client, [key(0)], A, [0])
    ticket = client.begin_load([key(0)], [A])
    generation = client.generation
    proc.terminate()
    assert proc.wait(10) == 0
    store_factory(8)
    # The REQ socket reconnects by itself; the new store must not take
    # requests meant for the old one (its slots and tickets mean nothing here).
    assert client.lookup([key(0)]) == 0
    assert client.generation == generation + 1 and client.num_slots == 8
    assert [(r.ticket, r.slots) for r in client.poll_loads()] == [(ticket, [])]
    save(client, [key(1)], A, [1])
    result = load(client, [key(1)], A)
    np.testing.assert_array_equal(client.arena()[result.slots[0]], block_bytes(1))


def test_a_client_that_dies_without_goodbye_loses_its_pins_after_its_lease(store_factory, clients):
    _, address = store_factory(4, extra_args=["--client-lease-s", "0.5"])
    dead = textwrap.dedent(f"""
        import os
        from kvferry.kvstore.client import KVStoreClient
        from kvferry.kvstore.tier import BlockOwner
        c = KVStoreClient({address!r})
        slots = c.reserve([b"r" * 32], [BlockOwner("acme")])  # reserved, never committed
        c.begin_load([b"k" + (0).to_bytes(8, "little") + bytes(23)], [BlockOwner("acme")])
        os._exit(0)  # no Goodbye
    """)
    client = clients(address)
    save(client, [key(0)], A, [0])
    subprocess.run([sys.executable, "-c", dead], check=True, timeout=60, env=os.environ)
    stats = client.stats()
    assert stats.pinned_slots == 1 and stats.used_slots == 2
    deadline = time.monotonic() + 10
    while client.stats().pinned_slots or client.stats().used_slots != 1:
        assert time.monotonic() < deadline, "the dead client's pin and reservation were never freed"
        time.sleep(0.1)


def test_polling_a_ticket_the_store_forgot_returns_it_empty(store_factory, clients):
    _, address = store_factory(16, extra_args=["--client-lease-s", "0.3"])
    client = clients(address)
    save(client, [key(0)], A, [0])
    ticket = client.begin_load([key(0)], [A])
    time.sleep(1.5)  # silent past its lease: the store frees its pins and forgets the ticket
    assert [(r.ticket, r.slots) for r in client.poll_loads()] == [(ticket, [])]
    assert client.stats().pinned_slots == 0


def test_a_store_that_stalls_past_the_timeout_loses_nothing_and_leaks_nothing(store_factory, clients):
    proc, address = store_factory(16)
    client = clients(address, timeout_s=0.3)
    save(client, [key(0)], A, [0])
    (reserved,) = client.reserve([key(1)], [A])
    ticket = client.begin_load([key(0)], [A])
    os.kill(proc.pid, signal.SIGSTOP)  # a stalled store: alive, silent
    try:
        assert [(r.ticket, r.slots) for r in client.poll_loads()] == [(ticket, [])]  # the engine recomputes
        assert client.lookup([key(0)]) == 0 and not client.connected
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5
    while not client.connected:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # The same store is back: the load given up on is unpinned there, the
    # reservation made before the stall is still the client's to commit.
    assert client.stats().pinned_slots == 0
    client.arena()[reserved] = block_bytes(1)
    client.commit([key(1)], [reserved])
    result = load(client, [key(0), key(1)], A)
    for i, slot in enumerate(result.slots):
        np.testing.assert_array_equal(client.arena()[slot], block_bytes(i))
    assert client.poll_loads() == []  # nothing reported twice
