"""Who may talk to the store: its socket file is private to its user
whatever the umask, every request must carry the store's token (on ipc://
and tcp:// alike), and the socket file goes away with the store. Real
store processes, real sockets."""
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import zmq

from kvferry import peer_auth
from kvferry.config import KVTierConfig
from kvferry.kvstore import protocol as p
from kvferry.kvstore.launch import start_store
from kvferry.kvstore.launch import ipc_address
from kvferry.kvstore.tier import BlockOwner

from tests.kvstore.redis_server import free_port
from tests.kvstore.store_helpers import BLOCK_NBYTES, block_bytes, gb, key

A = BlockOwner("acme")


def socket_path(address: str) -> Path:
    return Path(address[len("ipc://"):])


def save(client, keys, owner):
    slots = client.reserve(keys, [owner] * len(keys))
    assert None not in slots
    arena = client.arena()
    for i, slot in enumerate(slots):
        arena[slot] = block_bytes(i)
    client.commit(keys, slots)


def raw_request(address: str, request: p._Req) -> p.Reply:
    """One request from a process that speaks the protocol but holds no
    client: what any local process could send."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(p.encode(request))
        assert sock.poll(5000), "the store did not answer"
        return p.decode(sock.recv(), p.Reply)
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.parametrize("default_address", [False, True])
def test_the_socket_file_is_private_under_umask_000_and_removed_at_shutdown(tmp_path, default_address):
    old = os.umask(0)  # the store inherits it: before the fix its socket was 0777
    try:
        at = "" if default_address else f"ipc://{tmp_path}/store.sock"
        proc, address = start_store(KVTierConfig(kv_store=at, kv_dram_gb=gb(4)), block_nbytes=BLOCK_NBYTES)
    finally:
        os.umask(old)
    try:
        path = socket_path(address)
        mode = path.stat().st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o600, oct(mode)
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    assert not path.exists()


def test_a_killed_parents_socket_file_is_removed_by_the_next_start(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = Path(tempfile.gettempdir()) / f"kvferry-kvstore-{int(dead.stdout)}-deadbeef.sock"
    left = socket.socket(socket.AF_UNIX)
    left.bind(str(stale))  # what a store killed with its parent leaves behind
    left.close()
    mine = Path(tempfile.gettempdir()) / f"kvferry-kvstore-{os.getpid()}-livebeef.sock"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(mine))
    try:
        ipc_address()
        assert not stale.exists()
        assert mine.exists()  # a live parent's store keeps its socket
    finally:
        live.close()
        mine.unlink()
        stale.unlink(missing_ok=True)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_peer_without_the_token_is_refused_and_nothing_runs(store_factory, clients, transport):
    at = f"tcp://127.0.0.1:{free_port()}" if transport == "tcp" else None
    _, address = store_factory(16, at=at)
    client = clients(address)
    keys = [key(i) for i in range(3)]
    save(client, keys, A)
    for token in (b"", b"\0" * peer_auth.TOKEN_BYTES, peer_auth.token(peer_auth.KV_TRANSFER)):
        reply = raw_request(address, p.DropTenant(client_id="intruder", tenant="acme", token=token))
        assert isinstance(reply, p.Refused) and reply.reason.startswith("not authenticated"), reply
        reply = raw_request(address, p.Hello(client_id="intruder", token=token))
        assert isinstance(reply, p.Refused) and reply.reason.startswith("not authenticated"), reply
    # A client built with another token is refused at Hello and acts as if
    # the store were down.
    stranger = clients(address, token=b"x" * peer_auth.TOKEN_BYTES)
    assert not stranger.connected
    assert stranger.drop_tenant("acme") == 0 and stranger.lookup(keys) == 0
    # Nothing ran: acme's blocks are all there, bit exact.
    assert client.lookup(keys) == 3
    stats = client.stats()
    assert stats.used_slots == 3 and stats.tiers["dram"].per_tenant["acme"].num_blocks == 3
    # The right token works.
    reply = raw_request(address, p.GetStats(client_id="ops", token=peer_auth.token(peer_auth.KVSTORE)))
    assert isinstance(reply, p.StoreStats) and reply.used_slots == 3
    assert client.drop_tenant("acme") == 3
    assert client.lookup(keys) == 0


def test_a_store_given_a_cache_secret_file_expects_the_token_derived_from_it(tmp_path):
    """Processes started apart agree through the cache secret file: a store
    started with one and a client in a process that read the same file."""
    secret = tmp_path / "secret"
    secret.write_text("a cache secret of at least sixteen bytes\n")
    address = f"ipc://{tmp_path}/apart.sock"
    env = {k: v for k, v in os.environ.items() if k != peer_auth.SECRET_ENV}  # nothing inherited
    store = subprocess.Popen([sys.executable, "-m", "kvferry.kvstore.service", "--address", address, "--kv-dram-gb",
                              str(gb(4)), "--block-nbytes", str(BLOCK_NBYTES), "--cache-secret-file", str(secret)],
                             env=env)
    client_code = f"""
import sys, time
from kvferry import peer_auth
from kvferry.kvstore.client import KVStoreClient
if sys.argv[1] == "file":
    peer_auth.use_cache_secret_file({str(secret)!r})
c = KVStoreClient({address!r}, timeout_s=0.5)
deadline = time.monotonic() + 30
while not c.connected and time.monotonic() < deadline and sys.argv[1] == "file":
    time.sleep(0.1)
print(c.connected)
c.close()
"""
    try:
        with_file = subprocess.run([sys.executable, "-c", client_code, "file"], env=env, capture_output=True,
                                   text=True, timeout=60)
        without = subprocess.run([sys.executable, "-c", client_code, "none"], env=env, capture_output=True,
                                 text=True, timeout=60)
        assert with_file.stdout.strip() == "True", with_file.stderr
        assert without.stdout.strip() == "False", without.stderr
    finally:
        store.send_signal(signal.SIGTERM)
        assert store.wait(10) == 0
    assert not socket_path(address).exists()
