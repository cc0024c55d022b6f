"""``StoreSupervisor`` against real store processes and a real client (no
server, no model): a killed store is reaped and restarted at its address,
the client finds the new one by itself, the budget ends in ``down``, and
``stop`` leaves no file behind. Also the stale-file sweep's rules
(``shm_segments``): a zombie's files are stale, a live owner's are not."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvferry.config import KVTierConfig
from kvferry.kvstore.launch import socket_path
from kvferry.kvstore.supervisor import StoreSupervisor, with_store_health
from kvferry.kvstore.tier import BlockOwner
from kvferry.shm_segments import pid_alive, unlink_dead_segments, unlink_dead_sockets
from tests.kvstore.store_helpers import BLOCK_NBYTES, arena_files, block_bytes, gb, key

A = BlockOwner("acme")


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0]
    except FileNotFoundError:
        return None


def _wait(what: str, predicate, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


@pytest.fixture
def supervisors(address):
    made = []

    def make(max_restarts: int = 3) -> StoreSupervisor:
        tiers = KVTierConfig(kv_store=address, kv_dram_gb=gb(16))
        made.append(StoreSupervisor(tiers, max_restarts=max_restarts, window_s=600.0, backoff_s=0.05))
        return made[-1]

    yield make
    for supervisor in made:
        supervisor.stop()


def _save(client, i: int) -> None:
    [slot] = client.reserve([key(i)], [A])
    client.arena()[slot] = block_bytes(i)
    client.commit([key(i)], [slot])


def test_a_killed_store_is_reaped_and_restarted_and_the_client_uses_the_new_one(supervisors, clients):
    supervisor = supervisors()
    client = clients(supervisor.address, block_nbytes=BLOCK_NBYTES)
    _save(client, 1)
    assert client.lookup([key(1)]) == 1
    first, generation = supervisor.pid, client.generation
    assert arena_files(first)

    os.kill(first, signal.SIGKILL)
    _wait("the dead store reaped", lambda: _state(first) is None)
    _wait("a new store", lambda: supervisor.pid != first and supervisor.health == "ok")
    assert not arena_files(first)
    assert supervisor.address == client.address
    # The client says Hello again, maps the new arena, and works on.
    assert client.lookup([key(1)]) == 0  # a new store: empty
    assert client.generation == generation + 1
    _save(client, 2)
    assert client.lookup([key(2)]) == 1
    assert arena_files(supervisor.pid)


def test_past_the_budget_the_store_is_down_and_stop_leaves_nothing(supervisors):
    supervisor = supervisors(max_restarts=1)
    pids = [supervisor.pid]
    os.kill(pids[-1], signal.SIGKILL)
    _wait("a new store", lambda: supervisor.pid != pids[0] and supervisor.health == "ok")
    pids.append(supervisor.pid)
    os.kill(pids[-1], signal.SIGKILL)
    _wait("down", lambda: supervisor.health == "down")
    time.sleep(0.3)
    assert supervisor.pid == pids[-1] and _state(pids[-1]) is None  # reaped, not restarted
    assert supervisor.stop() == -signal.SIGKILL
    assert not any(arena_files(pid) for pid in pids)
    assert not socket_path(supervisor.address).exists()


def test_a_clean_stop_removes_the_socket_and_the_arena(supervisors, clients):
    supervisor = supervisors()
    client = clients(supervisor.address, block_nbytes=BLOCK_NBYTES)
    _save(client, 1)
    pid = supervisor.pid
    assert supervisor.stop() == 0
    assert supervisor.health == "down"
    assert _state(pid) is None and not arena_files(pid)
    assert not socket_path(supervisor.address).exists()


def test_with_store_health():
    assert with_store_health({"status": "ok"}, "ok") == {"status": "ok", "kv_store": "ok"}
    assert with_store_health({"status": "ok"}, "restarting") == {"status": "degraded", "kv_store": "restarting"}
    assert with_store_health({"status": "degraded", "workers": {}}, "down") == {
        "status": "degraded", "workers": {}, "kv_store": "down"}
    # A server that cannot serve says so whatever its store does.
    assert with_store_health({"status": "restarting", "reason": "x"}, "ok")["status"] == "restarting"


def test_the_files_of_a_zombie_or_an_exited_process_are_stale_a_live_ones_are_not(tmp_path):
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exited, not reaped
    try:
        _wait("a zombie", lambda: _state(zombie.pid) == "Z")
        assert not pid_alive(zombie.pid) and not pid_alive(exited.pid) and pid_alive(os.getpid())
        for pid in (exited.pid, zombie.pid, os.getpid()):
            (tmp_path / f"seg-{pid}-x").write_bytes(b"x")
        assert sorted(unlink_dead_segments(tmp_path, "seg-")) == sorted([f"seg-{exited.pid}-x", f"seg-{zombie.pid}-x"])
        assert [p.name for p in tmp_path.iterdir()] == [f"seg-{os.getpid()}-x"]
    finally:
        zombie.wait()


def test_only_dead_owners_sockets_are_removed(tmp_path):
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    for pid in (exited.pid, os.getpid()):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(tmp_path / f"p-{pid}-a.sock"))
    (tmp_path / f"p-{exited.pid}-b.sock").write_bytes(b"not a socket")
    assert unlink_dead_sockets(tmp_path, "p-") == [f"p-{exited.pid}-a.sock"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"p-{os.getpid()}-a.sock",
                                                                 f"p-{exited.pid}-b.sock"])
    assert Path(tmp_path / f"p-{os.getpid()}-a.sock").is_socket()


def test_a_store_with_a_parent_leaves_sigint_to_it(address):
    """Ctrl-C reaches the whole process group: a store started by a server
    (``--parent-pid``) stops when the server stops it, not on its own."""
    from kvferry.kvstore.launch import start_store

    process, _ = start_store(KVTierConfig(kv_store=address, kv_dram_gb=gb(16)))
    try:
        time.sleep(0.5)  # its handlers are installed by the time it answers; a margin for a loaded machine
        process.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(1.0)
    finally:
        process.terminate()
    assert process.wait(10) == 0
