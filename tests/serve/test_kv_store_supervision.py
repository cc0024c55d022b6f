"""The node KV store under its server's supervision, through a real
``kvferry serve --kv-dram-gb`` (which starts "kvferry: kvstore"), real
signals, real shared memory and the real ``openai`` client:

* stale arenas and sockets of dead owners (exited, or zombies) are removed
  when a server starts;
* a SIGKILLed store is reaped at once (no ``<defunct>`` child), its arena is
  removed, a new one comes up at the same address, the cores use it (a
  prompt's KV written to it is read back from it), ``/health`` reports it
  and ``/metrics`` stop showing the dead store's counters;
* past its restart budget the store is ``down``: ``/health`` says
  ``degraded`` (200: the server still serves, from the device pool), and
  its tier counters are gone from ``/metrics`` and its per-tenant counts
  from ``/v1/kv/stats``;
* a clean SIGTERM, or SIGINT, leaves no arena and no socket behind, even
  after the store was killed; a store whose server is SIGKILLed exits and
  removes its own.

The store is found as the existing tier tests find it: the server's child
titled "kvferry: kvstore".
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve.server_process import MODEL_NAME, ServerProcess, start_server

BLOCK = 16
SHM = Path("/dev/shm")
TMP = Path(tempfile.gettempdir())
PREFIX = "kvferry-kvstore-"
# The budget this module's server gets: two restarts, the third death is final.
RESTARTS = 2
# A device pool of 24 blocks: one flush (~20 blocks) evicts a prompt's blocks,
# so that the next request for it can only find them in the store.
SERVER_ARGS = ["--kv-dram-gb", "0.05", "--num-kv-blocks", "24", "--block-size", str(BLOCK),
               "--engine-restarts", str(RESTARTS), "--log-level", "info"]
# ~100 tokens (6 blocks) each.
PROMPT = "The lighthouse keeper wrote in his log every night about ships, storms and gulls. " * 6
SECOND_PROMPT = "An orchard in the autumn: ladders, baskets, wasps and the smell of cider. " * 6
FLUSH = "A market street in the morning: bread, apples, cheese, fish and flowers for sale. " * 18


def _complete(client: openai.OpenAI, prompt: str, max_tokens: int = 4):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)


def _cached(response) -> int:
    details = response.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


def _state(pid: int) -> str | None:
    """The process state letter ("Z": a zombie), None once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _stores(server_pid: int) -> list[int]:
    """The live "kvferry: kvstore" children of the server (zombies left out)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "--ppid", str(server_pid)], capture_output=True,
                         text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if "kvferry: kvstore" in line and not line.split()[1].startswith("Z")]


def _zombies(server_pid: int) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "--ppid", str(server_pid)], capture_output=True,
                         text=True).stdout
    return [line for line in out.splitlines() if line.split()[1].startswith("Z")]


def _health(srv: ServerProcess) -> tuple[int, dict]:
    r = httpx.get(f"{srv.base_url}/health", timeout=10)
    return r.status_code, r.json()


def _tenant_tiers(srv: ServerProcess) -> dict[str, dict]:
    """/v1/kv/stats' per-tenant ``kv_tiers`` (tenant -> tier -> counts), tenants that have any."""
    r = httpx.get(f"{srv.base_url}/v1/kv/stats", timeout=10)
    assert r.status_code == 200, r.text
    return {name: entry["kv_tiers"] for name, entry in r.json()["tenants"].items() if entry.get("kv_tiers")}


def _assert_health(srv: ServerProcess, code: int, status: str, kv_store: str) -> None:
    got_code, body = _health(srv)
    assert (got_code, body.get("status"), body.get("kv_store")) == (code, status, kv_store), body


def _wait_for(what: str, predicate, timeout_s: float = 60.0, srv: ServerProcess | None = None):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f"\n{srv.log()[-5000:]}" if srv else ""))
        time.sleep(0.1)


def _kill_store(srv: ServerProcess) -> int:
    """SIGKILL the server's store; its pid, once the server reaped it."""
    [pid] = _stores(srv.proc.pid)
    os.kill(pid, signal.SIGKILL)
    # Reaped by the server: gone from the process table, not a <defunct> child.
    _wait_for(f"the killed store {pid} to be reaped (state now {_state(pid)!r})", lambda: _state(pid) is None,
              timeout_s=15, srv=srv)
    return pid


def _arenas_of(pid: int) -> list[Path]:
    return list(SHM.glob(f"{PREFIX}{pid}-*"))


def _leftovers(server_pid: int, store_pids: list[int]) -> list[Path]:
    """This server's socket files and its stores' arenas still on disk."""
    return list(TMP.glob(f"{PREFIX}{server_pid}-*.sock")) + [p for pid in store_pids for p in _arenas_of(pid)]


def _stale_files(pid: int) -> list[Path]:
    """An arena and a socket file as a store of ``pid`` killed outright leaves them."""
    arena = SHM / f"{PREFIX}{pid}-0123456789ab"
    arena.write_bytes(b"\0" * 4096)
    sock_path = TMP / f"{PREFIX}{pid}-0badc0de.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock_path))  # the file stays after close, as a killed store's does
    return [arena, sock_path]


@pytest.fixture(scope="module")
def stale(tmp_path_factory):
    """Files of a process that exited (reaped) and of one that is a zombie
    (exited, not reaped: it maps nothing and never cleans up)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    _wait_for("a zombie", lambda: _state(zombie.pid) == "Z")
    files = {"exited": _stale_files(gone.pid), "zombie": _stale_files(zombie.pid)}
    yield files
    zombie.wait()
    for paths in files.values():
        for path in paths:
            path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def server(stale, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("store-supervision") / "server.log", SERVER_ARGS)
    srv.store_pids = _stores(srv.proc.pid)  # every store this server ran, for the leftover checks
    yield srv
    srv.stop(signal.SIGKILL)


def test_a_start_removes_the_arenas_and_sockets_of_dead_owners(server, stale):
    for owner, paths in stale.items():
        for path in paths:
            assert not path.exists(), f"{owner}'s {path} survived a server start"


def test_a_killed_store_is_reaped_replaced_and_used_again(server):
    srv = server
    client = openai.OpenAI(base_url=srv.api_url, api_key="x", max_retries=0)
    _assert_health(srv, 200, "ok", "ok")
    expected = _complete(client, PROMPT).choices[0].text
    _complete(client, "0 " + FLUSH, max_tokens=1)
    loaded = _complete(client, PROMPT)
    assert _cached(loaded) >= 5 * BLOCK and loaded.choices[0].text == expected
    hits = srv.wait_for_metric("kvferry:kv_tier_hits_total", lambda v: v > 0, tier="dram")
    assert hits > 0

    dead = _kill_store(srv)
    assert not _zombies(srv.proc.pid)
    # A new store at the same address, and the dead one's 50 MB arena gone.
    new = _wait_for("a new store", lambda: [p for p in _stores(srv.proc.pid) if p != dead], srv=srv)
    srv.store_pids += new
    assert not _arenas_of(dead)
    _wait_for("/health to report the store ok", lambda: _health(srv)[1].get("kv_store") == "ok", srv=srv)
    _assert_health(srv, 200, "ok", "ok")
    # The dead store's counts are gone: the new one's start from zero (the
    # cores report them once they are connected to it).
    assert srv.wait_for_metric("kvferry:kv_tier_hits_total", lambda v: v < hits, tier="dram") < hits

    # The tiers work again: a prompt's KV is written to the new store,
    # evicted from the device, and read back from the store.
    expected = _complete(client, SECOND_PROMPT).choices[0].text
    _complete(client, "1 " + FLUSH, max_tokens=1)
    loaded = _complete(client, SECOND_PROMPT)
    assert _cached(loaded) >= 5 * BLOCK, srv.log()[-5000:]
    assert loaded.choices[0].text == expected
    assert srv.wait_for_metric("kvferry:kv_tier_hits_total", lambda v: v > 0, tier="dram") > 0


def test_past_its_restart_budget_the_store_is_down_and_the_server_serves_on(server):
    srv = server
    client = openai.OpenAI(base_url=srv.api_url, api_key="x", max_retries=0)
    for _ in range(RESTARTS - 1):  # the first test used one restart
        dead = _kill_store(srv)
        srv.store_pids += _wait_for("a new store", lambda: [p for p in _stores(srv.proc.pid) if p != dead], srv=srv)
        _wait_for("the store ok", lambda: _health(srv)[1].get("kv_store") == "ok", srv=srv)
    # The last store's per-tenant counts, as /v1/kv/stats shows them while it lives.
    expected = _complete(client, "3 " + PROMPT).choices[0].text
    _complete(client, "4 " + FLUSH, max_tokens=1)
    assert _complete(client, "3 " + PROMPT).choices[0].text == expected
    _wait_for("/v1/kv/stats to show the store's per-tenant hits",
              lambda: any(t.get("dram", {}).get("hits") for t in _tenant_tiers(srv).values()), srv=srv)
    dead = _kill_store(srv)
    _wait_for("/health to report the store down", lambda: _health(srv)[1].get("kv_store") == "down", srv=srv)
    _assert_health(srv, 200, "degraded", "down")
    time.sleep(1.0)  # no restart comes
    assert _stores(srv.proc.pid) == [] and not _zombies(srv.proc.pid)
    assert not _arenas_of(dead)
    # No tier series of a store that is gone, in /metrics nor in /v1/kv/stats
    # (the cores' last report still holds the dead store's counts).
    assert not [key for key in srv.metrics() if key[0].startswith("kvferry:kv_tier_")]
    assert _tenant_tiers(srv) == {}
    # Serving goes on, from the device pool alone.
    assert _complete(client, "2 " + PROMPT).choices[0].finish_reason == "length"


def test_a_clean_sigterm_after_a_store_death_leaves_no_arena_or_socket(server):
    srv = server
    assert srv.stop(signal.SIGTERM) == 0, srv.log()[-5000:]
    assert _leftovers(srv.proc.pid, srv.store_pids) == []


def test_sigint_after_a_store_death_leaves_no_arena_or_socket(tmp_path):
    # Budget 0: the killed store stays down, and its files must still go.
    srv = start_server(tmp_path / "server.log", ["--kv-dram-gb", "0.05", "--engine-restarts", "0"])
    try:
        stores = _stores(srv.proc.pid)
        _kill_store(srv)
        _wait_for("the store down", lambda: _health(srv)[1].get("kv_store") == "down", srv=srv)
    finally:
        code = srv.stop(signal.SIGINT)
    assert code == 0, srv.log()[-5000:]
    assert _leftovers(srv.proc.pid, stores) == []


def test_a_killed_servers_store_exits_and_removes_its_files(tmp_path):
    srv = start_server(tmp_path / "server.log", ["--kv-dram-gb", "0.05"])
    try:
        stores = _stores(srv.proc.pid)
        assert len(stores) == 1 and _arenas_of(stores[0])
    finally:
        code = srv.stop(signal.SIGKILL)
    assert code == -signal.SIGKILL
    # Orphaned, it sees its parent gone and stops cleanly (init reaps it,
    # or leaves it a zombie where the container's init does not reap).
    _wait_for("the orphaned store to exit", lambda: _state(stores[0]) in (None, "Z"), timeout_s=30)
    # The engine core exits too; whatever either left is this server's.
    _wait_for("no files left", lambda: _leftovers(srv.proc.pid, stores) == [], timeout_s=10)
