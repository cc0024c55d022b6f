"""The SSD tier on real files: round trips, corruption, restart, crash,
full disk, capacity and quotas, tenants."""
from __future__ import annotations

import array
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from kvferry.kvstore.crypto import TENANT_TAG_BYTES, TierCrypto, tenant_tag
from kvferry.kvstore.disk import HEADER_BYTES, DiskTier
from kvferry.kvstore.tenant_lru import PUBLIC_POOL, TierQuotas
from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.conftest import SECRET, block, key

ACME = BlockOwner("acme")
BETA = BlockOwner("beta")
PUBLIC = BlockOwner("acme", public=True)
MB = 1 << 20
SLOT = 8192  # a 6000-byte block with header, key and tenant fits one 8 KiB slot


def slab_files(path: Path) -> list[Path]:
    return sorted(path.glob("slab-*.dat"))


@pytest.mark.parametrize("sealed", [False, True])
def test_round_trip_is_bit_exact(tmp_path, sealed):
    tier = DiskTier(tmp_path, 64 * MB, crypto=TierCrypto(SECRET) if sealed else None)
    sizes = [1, 4095, 4096, 6000, 70_000]
    for i, n in enumerate(sizes):
        assert tier.put(key(i), block(i, n), ACME)
    assert tier.put(key(99), memoryview(block(99)), PUBLIC)
    got = tier.get_many([key(3), key(50), key(0), key(4), key(1), key(2), key(99)], ACME)
    assert got == [block(3, 6000), None, block(0, 1), block(4, 70_000), block(1, 4095), block(2, 4096), block(99)]
    assert tier.get(key(99), BETA) == block(99)  # public blocks serve every tenant
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.num_blocks) == (7, 1, 6)
    assert stats.bytes_read == sum(sizes) + 2 * 6000
    assert stats.per_tenant["acme"].num_blocks == 5 and stats.per_tenant[PUBLIC_POOL].num_blocks == 1
    tier.check_integrity()
    tier.close()


def test_a_typed_buffer_is_stored_as_its_bytes(tmp_path, crypto):
    """A block handed over as a float view (as an arena slot may be) is
    stored and accounted in bytes."""
    values = array.array("f", range(1000))
    tier = DiskTier(tmp_path, 64 * MB, crypto=crypto)
    assert tier.put(key(1), memoryview(values), ACME)
    assert tier.get(key(1), ACME) == values.tobytes()
    assert tier.stats().bytes_written == 4000


def test_private_blocks_are_encrypted_on_disk_and_public_ones_are_not(tmp_path):
    tier = DiskTier(tmp_path, 64 * MB, crypto=TierCrypto(SECRET))
    tier.put(key(1), block(1), ACME)
    tier.put(key(2), block(2), PUBLIC)
    tier.close()
    raw = b"".join(f.read_bytes() for f in slab_files(tmp_path))
    assert block(1)[:256] not in raw
    assert block(2)[:256] in raw


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("where", ["payload", "key", "header"])
def test_a_flipped_byte_is_a_miss_and_quarantined(tmp_path, where):
    tier = DiskTier(tmp_path, 64 * MB)
    for i in range(3):
        tier.put(key(i), block(i), ACME)
    offset = {"payload": SLOT + 3000, "key": SLOT + HEADER_BYTES + 5, "header": SLOT + 30}[where]
    flip_byte(slab_files(tmp_path)[0], offset)  # slot 1 holds key(1)
    assert tier.get_many([key(0), key(1), key(2)], ACME) == [block(0), None, block(2)]
    stats = tier.stats()
    assert stats.quarantined == 1 and stats.num_blocks == 2
    assert not tier.contains(key(1))
    assert tier.get(key(1), ACME) is None  # gone from the index: a plain miss now
    assert tier.stats().quarantined == 1
    tier.check_integrity()
    # The freed slot takes new writes.
    assert tier.put(key(7), block(7), ACME) and tier.get(key(7), ACME) == block(7)


def test_a_flipped_ciphertext_byte_is_never_decrypted(tmp_path):
    tier = DiskTier(tmp_path, 64 * MB, crypto=TierCrypto(SECRET))
    tier.put(key(1), block(1), ACME)
    flip_byte(slab_files(tmp_path)[0], 2000)
    assert tier.get(key(1), ACME) is None
    assert tier.stats().quarantined == 1


def test_a_truncated_slab_is_a_miss_and_quarantined_live_and_after_restart(tmp_path):
    tier = DiskTier(tmp_path, 64 * MB)
    for i in range(4):
        tier.put(key(i), block(i), ACME)
    slab = slab_files(tmp_path)[0]
    os.truncate(slab, 2 * SLOT + 1000)  # slot 2 torn, slot 3 gone
    assert tier.get_many([key(i) for i in range(4)], ACME) == [block(0), block(1), None, None]
    assert tier.stats().quarantined == 2
    tier.close()
    tier = DiskTier(tmp_path, 64 * MB)
    assert tier.get_many([key(i) for i in range(4)], ACME) == [block(0), block(1), None, None]
    tier.check_integrity()


def test_truncation_before_a_restart_is_found_by_the_scan(tmp_path):
    tier = DiskTier(tmp_path, 64 * MB)
    for i in range(3):
        tier.put(key(i), block(i), ACME)
    tier.close()
    os.truncate(slab_files(tmp_path)[0], 2 * SLOT + 3000)
    tier = DiskTier(tmp_path, 64 * MB)
    assert tier.stats().quarantined == 1 and not tier.contains(key(2))
    assert tier.get_many([key(0), key(1)], ACME) == [block(0), block(1)]


def test_restart_keeps_the_index_and_the_lru_order(tmp_path, crypto):
    tier = DiskTier(tmp_path, 4 * SLOT, crypto=crypto)
    for i in range(4):
        tier.put(key(i), block(i), ACME)
    tier.get(key(0), ACME)  # not persisted: LRU order after restart is write order
    tier.delete(key(3))
    tier.close()
    tier = DiskTier(tmp_path, 4 * SLOT, crypto=TierCrypto(SECRET))
    assert [tier.contains(key(i)) for i in range(4)] == [True, True, True, False]
    assert tier.get_many([key(0), key(1), key(2)], ACME) == [block(0), block(1), block(2)]
    tier.get(key(0), ACME)
    tier.put(key(4), block(4), ACME)  # fills the freed slot
    tier.put(key(5), block(5), ACME)  # evicts the least recently used: key(1)
    assert [tier.contains(key(i)) for i in range(6)] == [True, False, True, False, True, True]
    tier.check_integrity()


_WRITER = """
import sys
from kvferry.kvstore.disk import DiskTier
from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.conftest import block, key
tier = DiskTier(sys.argv[1], 1 << 30)
i = 0
while True:
    assert tier.put(key(i), block(i, 50_000), BlockOwner("acme"))
    print(i, flush=True)  # durable and indexed
    i += 1
"""


def test_sigkill_mid_writes_loses_nothing_acknowledged_and_serves_nothing_torn(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2])
    acked = []
    for line in proc.stdout:
        acked.append(int(line))
        if len(acked) == 40:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    # A torn record: a whole header with a payload that never landed.
    slab = slab_files(tmp_path)[0]
    slot_bytes = int(slab.stem.split("-")[1])
    end = -(-os.path.getsize(slab) // slot_bytes) * slot_bytes  # past any slot in flight
    data = slab.read_bytes()[:slot_bytes]
    with open(slab, "r+b") as f:
        f.seek(end)
        f.write(data[:HEADER_BYTES] + key(10_000) + data[HEADER_BYTES + 32:HEADER_BYTES + 100])
        f.write(bytes(slot_bytes - HEADER_BYTES - 100))
    tier = DiskTier(tmp_path, 1 << 30)
    got = tier.get_many([key(i) for i in acked], BlockOwner("acme"))
    assert got == [block(i, 50_000) for i in acked]
    assert tier.get(key(10_000), BlockOwner("acme")) is None
    assert tier.stats().quarantined == 1
    tier.check_integrity()


def test_capacity_evicts_least_recently_used(tmp_path):
    tier = DiskTier(tmp_path, 3 * SLOT)
    for i in range(3):
        tier.put(key(i), block(i), ACME)
    tier.get(key(0), ACME)
    tier.put(key(3), block(3), BETA)
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert tier.stats().num_bytes == 3 * SLOT
    assert not tier.put(key(9), block(9, 4 * SLOT), ACME)  # larger than the tier
    assert tier.stats().refused_writes == 1
    tier.check_integrity()


def test_quotas_evict_within_the_tenant_and_refuse_what_cannot_fit(tmp_path):
    quotas = TierQuotas({"acme": 2 * SLOT, "zero": 0}, default_tenant_bytes=None, public_bytes=SLOT)
    tier = DiskTier(tmp_path, 100 * SLOT, quotas=quotas)
    tier.put(key(0), block(0), BETA)
    for i in range(1, 4):
        assert tier.put(key(i), block(i), ACME)
    # acme holds its 2 newest blocks; beta's older block was not touched.
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert not tier.put(key(4), block(4), BlockOwner("zero"))
    assert tier.put(key(5), block(5), PUBLIC) and tier.put(key(6), block(6), PUBLIC)
    assert not tier.contains(key(5)) and tier.contains(key(6))
    assert not tier.put(key(7), block(7, 2 * SLOT), PUBLIC)  # larger than the public quota
    stats = tier.stats()
    assert stats.per_tenant["acme"].num_bytes == 2 * SLOT
    assert stats.per_tenant["zero"].refused_writes == 1 and stats.per_tenant[PUBLIC_POOL].refused_writes == 1
    assert stats.refused_writes == 2
    tier.check_integrity()


def test_quotas_from_gb_and_bad_values():
    quotas = TierQuotas.from_gb({"acme": 0.5}, public_gb=1)
    assert quotas.limit("acme") == 1 << 29 and quotas.limit(PUBLIC_POOL) == 1 << 30
    assert quotas.limit("other") is None
    with pytest.raises(ValueError, match="acme"):
        TierQuotas({"acme": -1})


def test_another_tenants_private_block_is_a_counted_miss(tmp_path, crypto):
    tier = DiskTier(tmp_path, 64 * MB, crypto=crypto)
    tier.put(key(1), block(1), ACME)
    assert tier.get(key(1), BETA) is None
    assert tier.get(key(1), BlockOwner("acme", public=True)) is None
    stats = tier.stats()
    assert stats.auth_failures == 2 and stats.quarantined == 0
    assert tier.get(key(1), ACME) == block(1)  # still there for its owner


def test_a_forged_tenant_field_fails_authentication_under_the_readers_key(tmp_path, crypto):
    """Rewrite acme's record to name beta (with a valid checksum, as an
    attacker with the disk could): beta's key cannot open it."""
    import xxhash
    tier = DiskTier(tmp_path, 64 * MB, crypto=crypto)
    tier.put(key(1), block(1), ACME)
    slab = slab_files(tmp_path)[0]
    raw = bytearray(slab.read_bytes())
    tenant_at = HEADER_BYTES + 32
    assert raw[tenant_at:tenant_at + TENANT_TAG_BYTES] == tenant_tag(crypto, "acme")
    raw[tenant_at:tenant_at + TENANT_TAG_BYTES] = tenant_tag(crypto, "beta")
    h = xxhash.xxh3_128()  # a sealed record's checksum leaves the payload to its GCM tag
    for part in (raw[:28], raw[HEADER_BYTES:HEADER_BYTES + 32 + TENANT_TAG_BYTES]):
        h.update(bytes(part))
    raw[28:HEADER_BYTES] = h.digest()
    slab.write_bytes(bytes(raw))
    assert tier.get(key(1), BETA) is None
    stats = tier.stats()
    assert stats.auth_failures == 1 and stats.quarantined == 1


def test_drop_tenant_survives_a_restart(tmp_path):
    tier = DiskTier(tmp_path, 64 * MB)
    for i in range(3):
        tier.put(key(i), block(i), ACME)
    tier.put(key(3), block(3), BETA)
    tier.put(key(4), block(4), PUBLIC)
    assert tier.drop_tenant("acme") == 3
    tier.close()
    tier = DiskTier(tmp_path, 64 * MB)
    assert [tier.contains(key(i)) for i in range(5)] == [False, False, False, True, True]


def test_concurrent_puts_and_gets_stay_consistent(tmp_path, crypto):
    tier = DiskTier(tmp_path, 40 * SLOT, crypto=crypto, quotas=TierQuotas({"t1": 10 * SLOT}))
    errors = []

    def worker(t: int) -> None:
        owner = BlockOwner(f"t{t}")
        try:
            for i in range(60):
                k = key(t * 1000 + i)
                tier.put(k, block(t * 1000 + i), owner)
                got = tier.get_many([k, key(t * 1000 + i // 2)], owner)
                assert got[0] in (None, block(t * 1000 + i))
                assert got[1] in (None, block(t * 1000 + i // 2))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = tier.stats()
    assert stats.num_bytes <= 40 * SLOT and stats.per_tenant["t1"].num_bytes <= 10 * SLOT
    assert stats.quarantined == 0
    tier.check_integrity()


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs made for the test (needs mount rights)."""
    where = tmp_path / f"full-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}): full-disk test needs root")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_refuses_writes_and_keeps_serving(tiny_fs):
    tier = DiskTier(tiny_fs, 64 * MB)  # capacity above the disk: the disk fills first
    stored = []
    for i in range(200):
        if tier.put(key(i), block(i, 60_000), ACME):
            stored.append(i)
    stats = tier.stats()
    assert 5 < len(stored) < 200 and stats.refused_writes == 200 - len(stored)
    assert tier.get_many([key(i) for i in stored], ACME) == [block(i, 60_000) for i in stored]
    tier.check_integrity()
    for i in stored[:4]:
        tier.delete(key(i))
    assert tier.put(key(500), block(500, 60_000), ACME)  # freed slots take writes again
    assert tier.get(key(500), ACME) == block(500, 60_000)
    tier.close()
    # A restart on the full disk finds every acknowledged block and serves
    # nothing from the writes that failed.
    kept = stored[4:] + [500]
    tier = DiskTier(tiny_fs, 64 * MB)
    assert tier.get_many([key(i) for i in kept], ACME) == [block(i, 60_000) for i in kept]
    assert all(not tier.contains(key(i)) for i in range(200) if i not in stored)
    tier.check_integrity()
    tier.close()


def test_a_full_disk_is_logged_once_per_interval_with_the_count(tiny_fs, caplog):
    caplog.set_level(logging.WARNING, logger="kvferry.kvstore.disk")
    tier = DiskTier(tiny_fs, 64 * MB)  # capacity above the disk: ENOSPC, not the tier's own limit
    for i in range(200):
        tier.put(key(i), block(i, 60_000), ACME)
    refused = tier.stats().refused_writes

    def full_warnings():
        return [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]

    # Many refusals inside one interval (60 s): one warning, naming the tier's path.
    assert refused > 100
    assert len(full_warnings()) == 1 and str(tiny_fs) in full_warnings()[0]
    assert "1 block write(s) refused" in full_warnings()[0]
    # The next warning, once the interval has passed, counts every refusal
    # since the last one (the silent ones and its own).
    tier.full_warning_interval_s = 0.2
    time.sleep(0.3)
    for i in range(200, 210):
        assert not tier.put(key(i), block(i, 60_000), ACME)
    assert len(full_warnings()) == 2
    assert f"{refused} block write(s) refused" in full_warnings()[1]
    tier.close()


def test_a_restart_under_another_secret_serves_no_private_block(tmp_path, crypto):
    tier = DiskTier(tmp_path, 64 * MB, crypto=crypto)
    tier.put(key(1), block(1), ACME)
    tier.put(key(2), block(2), PUBLIC)
    tier.close()
    tier = DiskTier(tmp_path, 64 * MB, crypto=TierCrypto(b"another secret of 32 bytes......"))
    assert tier.get_many([key(1), key(2)], ACME) == [None, block(2)]
    assert tier.stats().quarantined == 1  # unreadable under this secret: freed for new blocks
    tier.close()
    tier = DiskTier(tmp_path, 64 * MB)  # no crypto at all
    assert tier.get(key(2), ACME) == block(2)


def test_bad_arguments_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskTier(tmp_path, 0)
    with pytest.raises(ValueError, match="read_threads"):
        DiskTier(tmp_path, MB, read_threads=0)
    with pytest.raises(ValueError, match="key"):
        DiskTier(tmp_path, MB).put(b"", b"x", ACME)
