"""Several engine processes hammer one store under pressure (a small arena
over a disk tier): every block any of them loads must hold exactly the
bytes written under its key, and the store's index must stay intact."""
import os
import subprocess
import sys
import textwrap

from tests.kvstore.conftest import SECRET
from tests.kvstore.store_helpers import BLOCK_NBYTES, gb

WORKER = textwrap.dedent("""
    import hashlib, random, sys, time
    import numpy as np
    from kvferry.kvstore.client import KVStoreClient
    from kvferry.kvstore.tier import BlockOwner

    address, seed, ops = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    nbytes = {nbytes}
    rng = random.Random(seed)
    client = KVStoreClient(address, block_nbytes=nbytes)
    tenants = [BlockOwner("acme"), BlockOwner("bolt"), BlockOwner("acme", public=True)]

    def key(i, owner):
        return hashlib.sha256(f"{{owner.tenant}}/{{owner.public}}/{{i}}".encode()).digest()

    def content(k):
        return np.frombuffer((k * (nbytes // len(k) + 1))[:nbytes], dtype=np.uint8)

    loads = saves = 0
    for _ in range(ops):
        owner = rng.choice(tenants)
        run = [key(i, owner) for i in range(rng.randrange(24), rng.randrange(24) + 1 + rng.randrange(6))]
        op = rng.random()
        if op < 0.45:
            slots = client.reserve(run, [owner] * len(run))
            arena = client.arena()
            done = [(k, s) for k, s in zip(run, slots) if s is not None]
            for k, s in done:
                arena[s] = content(k)
            if rng.random() < 0.1 and done:
                client.abandon([s for _, s in done])
            else:
                client.commit([k for k, _ in done], [s for _, s in done])
                saves += len(done)
        elif op < 0.9:
            ticket = client.begin_load(run, [owner] * len(run))
            deadline = time.monotonic() + 10
            results = []
            while not results:
                assert time.monotonic() < deadline, "a load never finished"
                results = client.poll_loads()
            (result,) = results
            assert result.ticket == ticket
            arena = client.arena()
            for k, s in zip(run, result.slots):
                if not np.array_equal(arena[s], content(k)):
                    print("CORRUPT", s, flush=True)
                    sys.exit(1)
            loads += len(result.slots)
            client.release(ticket)
        elif op < 0.95:
            client.retain(run, owner, rng.random() * 0.2)
        else:
            client.lookup(run)
    client.close()
    print("ok", saves, loads, flush=True)
""").format(nbytes=BLOCK_NBYTES)


def test_concurrent_clients_under_pressure_only_ever_read_what_was_written(store_factory, clients, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    keys = tmp_path / "keys.json"
    keys.write_text('{"a": {"tenant": "acme", "quota": {"dram_gb": %r}}}' % gb(10))
    _, address = store_factory(16, kv_disk=str(tmp_path / "ssd"), kv_disk_gb=gb(40), cache_secret_file=str(secret),
                               api_keys=str(keys), extra_args=["--public-dram-gb", repr(gb(4))])
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, address, str(seed), "200"], stdout=subprocess.PIPE,
                                text=True, env=os.environ) for seed in range(3)]
    outputs = [w.communicate(timeout=300)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0, 0], outputs
    loaded = sum(int(out.split()[2]) for out in outputs)
    assert loaded > 100, outputs  # the loads did find blocks to check
    stats = clients(address).stats()
    assert stats.pinned_slots == 0 and stats.evictions > 0 and stats.tiers["disk"].hits > 0
    assert stats.tiers["dram"].refused_writes > 0  # the quotas bit
