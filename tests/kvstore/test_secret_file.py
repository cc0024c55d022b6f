"""The cache secret kept beside a persistent tier when no
``--cache-secret-file`` is given: generated once (0600, never half
written, one winner when starts race), reused, and what lets a restarted
store open the private blocks it sealed. Real files and store processes."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvferry.kvstore.secret_file import ensure_secret_file, tier_secret_path
from kvferry.kvstore.tier import BlockOwner
from tests.kvstore.store_helpers import block_bytes, gb, key, wait_loads

A = BlockOwner("acme")  # a private owner: its blocks are sealed at rest


def test_generated_once_owner_only_and_reused(tmp_path):
    path = tier_secret_path(str(tmp_path / "ssd"), None)
    assert path == tmp_path / "ssd" / "cache-secret"
    got, created = ensure_secret_file(path)
    assert got == path and created
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = path.read_bytes()
    assert len(secret.strip()) >= 32
    assert ensure_secret_file(path) == (path, False)
    assert path.read_bytes() == secret
    assert sorted(p.name for p in path.parent.iterdir()) == ["cache-secret"]  # no temporary file left


def test_a_remote_only_tier_keeps_it_in_the_cache_dir_named_by_a_digest(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path))
    url = "redis://:password@10.0.0.1:6379/0"
    path = tier_secret_path(None, url)
    assert path.parent == tmp_path and "password" not in path.name
    assert path != tier_secret_path(None, "redis://10.0.0.2:6379/0")
    assert tier_secret_path(None, None) is None


def test_a_too_short_secret_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "cache-secret"
    path.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="cache-secret"):
        ensure_secret_file(path)


def test_racing_starts_agree_on_one_secret(tmp_path):
    path = tmp_path / "ssd" / "cache-secret"
    racer = textwrap.dedent(f"""
        from kvferry.kvstore.secret_file import ensure_secret_file
        path, created = ensure_secret_file({str(path)!r})
        print(int(created), path.read_bytes().decode().strip())
    """)
    procs = [subprocess.Popen([sys.executable, "-c", racer], stdout=subprocess.PIPE, text=True, env=os.environ)
             for _ in range(6)]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(int(created) for created, _ in outs) == 1  # one writer won; the others read its secret
    assert {secret for _, secret in outs} == {path.read_text().strip()}
    assert sorted(p.name for p in path.parent.iterdir()) == ["cache-secret"]


def test_a_store_without_a_secret_file_opens_its_disk_after_a_restart(store_factory, clients, tmp_path):
    disk = tmp_path / "ssd"
    proc, address = store_factory(2, kv_disk=str(disk), kv_disk_gb=gb(64))
    client = clients(address, timeout_s=0.3)
    for i in range(6):
        slots = client.reserve([key(i)], [A])
        client.arena()[slots[0]] = block_bytes(i)
        client.commit([key(i)], slots)
    deadline = time.monotonic() + 10
    while client.stats().written_back < 4:  # 0..3 evicted from the 2-slot DRAM to disk
        assert time.monotonic() < deadline, "write-back did not finish"
        time.sleep(0.01)
    proc.terminate()
    assert proc.wait(10) == 0
    assert stat.S_IMODE((disk / "cache-secret").stat().st_mode) == 0o600
    store_factory(2, kv_disk=str(disk), kv_disk_gb=gb(64))
    deadline = time.monotonic() + 5
    while not client.connected:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Sealed under the kept secret: readable again, bit-exact, none quarantined.
    ticket = client.begin_load([key(0), key(1)], [A, A])
    (result,) = wait_loads(client)
    assert result.ticket == ticket and len(result.slots) == 2
    for i, slot in enumerate(result.slots):
        np.testing.assert_array_equal(client.arena()[slot], block_bytes(i))
    assert client.stats().tiers["disk"].quarantined == 0
