"""Starting the node's KV store ("kvferry: kvstore") as a child process.

One function, from the ``KVTierConfig`` the engine is configured with, for
every place that starts one (``kvferry serve``, an offline engine, tests,
benchmarks): the store's flags are the engine's ``--kv-*`` flags, so the
two cannot drift apart.

Leftovers: a store removes its socket file and arena when it stops, and
exits (cleanly) when its parent is gone. One killed outright (SIGKILL, OOM)
cannot: its arena ``/dev/shm/kvferry-kvstore-<store pid>-*`` and its
socket ``$TMPDIR/kvferry-kvstore-<parent pid>-*.sock`` stay. Each start
removes those of dead pids first (``remove_stale_store_files``), and a
supervising server removes its own dead store's at once
(``supervisor.py``).

The cache secret: a path (``cache_secret_file``: the operator's file, or
the one kept beside a persistent tier on this host), or the secret itself
(``cache_secret``: what a server hands each of its node stores, on this
host or another, so that all of them seal, name and authenticate under
one secret). The latter reaches the store through a pipe whose read end
it inherits (``--cache-secret-fd``): never in argv (``ps`` shows argv to
every user), nor in a file left behind, nor in the environment that the
store's own children would inherit.

No torch is imported here (nor by the store): a server starts it before
its engine cores.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from kvferry import peer_auth
from kvferry.extras import require
from kvferry.kvstore.arena import SHM_DIR
from kvferry.kvstore.client import KVStoreClient
from kvferry.kvstore.mooncake_lib import check_available
from kvferry.kvstore.pool_address import PoolAddress
from kvferry.shm_segments import unlink_dead_segments, unlink_dead_sockets

if TYPE_CHECKING:
    from kvferry.config import KVTierConfig

logger = logging.getLogger(__name__)

# The arena's name (arena.py) and the socket's: PREFIX<pid>-<random>.
ARENA_PREFIX = SOCKET_PREFIX = "kvferry-kvstore-"


def ipc_address() -> str:
    """A fresh socket path named after this process (the store's parent),
    after removing those of parents that are gone."""
    unlink_dead_sockets(Path(tempfile.gettempdir()), SOCKET_PREFIX)
    return f"ipc://{tempfile.gettempdir()}/{SOCKET_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


def remove_stale_store_files(shm_dir: Path = SHM_DIR, socket_dir: Path | None = None) -> list[str]:
    """Unlink the arenas and socket files of stores whose owner pid is dead
    (see the module's docstring); the names removed."""
    removed = unlink_dead_segments(shm_dir, ARENA_PREFIX)
    removed += unlink_dead_sockets(socket_dir or Path(tempfile.gettempdir()), SOCKET_PREFIX)
    if removed:
        logger.info("removed %d KV store file(s) left by dead processes: %s", len(removed), removed)
    return removed


def socket_path(address: str) -> Path | None:
    """The file of an ipc:// address (None: tcp://, or an abstract socket)."""
    if not address.startswith("ipc://") or address.startswith("ipc://@"):
        return None
    return Path(address[len("ipc://"):])


def store_argv(tiers: KVTierConfig, address: str, *, block_nbytes: int | None = None,
               api_keys: str | None = None, cache_secret_file: str | None = None,
               cache_secret_fd: int | None = None) -> list[str]:
    """The ``kvferry kvstore`` flags serving ``tiers`` at ``address``
    (empty tier fields: no such tier)."""
    argv = ["--address", address, "--kv-dram-gb", str(tiers.kv_dram_gb)]
    for flag, value in (("--kv-disk", tiers.kv_disk or None), ("--kv-disk-gb", tiers.kv_disk_gb or None),
                        ("--kv-remote", tiers.kv_remote or None), ("--kv-cluster", tiers.kv_cluster or None),
                        ("--block-nbytes", block_nbytes),
                        ("--api-keys", api_keys), ("--cache-secret-file", cache_secret_file),
                        ("--cache-secret-fd", cache_secret_fd)):
        if value is not None:
            argv += [flag, str(value)]
    if tiers.insecure_shared_tier:
        argv.append("--insecure-shared-tier")
    return argv


def start_store(tiers: KVTierConfig, *, block_nbytes: int | None = None, api_keys: str | None = None,
                cache_secret_file: str | None = None, cache_secret: bytes | None = None,
                extra_args: list[str] | None = None, timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start a store with ``tiers``' DRAM, disk, cluster and remote tiers for this
    process (which it outlives by at most a fraction of a second: it exits
    when its parent is gone) and wait until it answers. It listens at
    ``tiers.kv_store`` when that is set (a store restarted at a known
    address), else at a fresh ipc:// socket. Returns the process and its
    address. Stop it with ``process.terminate()`` (SIGTERM: a clean
    shutdown) and ``wait()``; ``supervisor.StoreSupervisor`` also restarts
    one that dies. ``cache_secret`` (bytes) is handed over by pipe (module
    docstring); give it or ``cache_secret_file``, not both."""
    if cache_secret is not None and cache_secret_file is not None:
        raise ValueError("cache_secret, cache_secret_file: give one or neither")

    if tiers.kv_cluster:
        PoolAddress.parse(tiers.kv_cluster)  # "auto" is kvferry serve --ray's alone: refused here, by name
        check_available()  # a ValueError naming the missing package or library, here rather than in the child
    if tiers.kv_remote:
        require("redis", "remote", "--kv-remote")  # here rather than as the child's traceback
    peer_auth.socket_secret()  # in the environment before the store starts: it inherits it
    remove_stale_store_files()
    address = tiers.kv_store or ipc_address()
    secret_fd = _secret_pipe(cache_secret) if cache_secret is not None else None
    argv = [sys.executable, "-m", "kvferry.kvstore.process",
            *store_argv(tiers, address, block_nbytes=block_nbytes, api_keys=api_keys,
                        cache_secret_file=cache_secret_file, cache_secret_fd=secret_fd),
            "--parent-pid", str(os.getpid())]
    try:
        process = subprocess.Popen(argv + list(extra_args or []), pass_fds=() if secret_fd is None else (secret_fd,))
    finally:
        if secret_fd is not None:
            os.close(secret_fd)  # the child holds its own copy; its read ends at the closed write end
    deadline = time.monotonic() + timeout_s
    probe = KVStoreClient(address, timeout_s=0.5)
    try:
        while not probe.ping():
            if process.poll() is not None:
                raise RuntimeError(f"the kvstore process exited with code {process.returncode} before answering")
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(f"the kvstore process did not answer at {address} within {timeout_s} s")
            time.sleep(0.05)
    finally:
        probe.close()
    return process, address


def _secret_pipe(secret: bytes) -> int:
    """The read end of a pipe holding ``secret`` (its write end closed):
    the store reads it to its end at start. A cache secret (tens of bytes)
    fits in the pipe's buffer, so the write never blocks."""
    if not isinstance(secret, bytes) or len(secret) < 16 or len(secret) > 4096:
        raise ValueError("cache_secret: must be bytes, 16 to 4096 of them")
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, secret + b"\n")
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return read_end
