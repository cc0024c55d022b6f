"""Starting the node's KV store ("kvferry: kvstore") as a child process.

One function, from the ``KVTierConfig`` the engine is configured with, for
every place that starts one (``kvferry serve``, an offline engine, tests,
benchmarks): the store's flags are the engine's ``--kv-*`` flags, so the
two cannot drift apart.

No torch is imported here (nor by the store): a server starts it before
its engine cores.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from kvferry import peer_auth

if TYPE_CHECKING:
    from kvferry.config import KVTierConfig


def ipc_address() -> str:
    """A fresh socket path named after this process (the store's parent),
    after removing those of parents that are gone: a store killed with
    SIGKILL never removes its own (its parent's death ends a live one)."""
    _remove_dead_sockets(Path(tempfile.gettempdir()))
    return f"ipc://{tempfile.gettempdir()}/{_SOCKET_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


_SOCKET_PREFIX = "kvferry-kvstore-"


def _remove_dead_sockets(directory: Path) -> None:
    from kvferry.shm_segments import pid_alive

    for path in directory.glob(f"{_SOCKET_PREFIX}*-*.sock"):
        try:
            pid = int(path.name[len(_SOCKET_PREFIX):].split("-")[0])
            if not pid_alive(pid) and path.is_socket() and path.lstat().st_uid == os.getuid():
                path.unlink()
        except (ValueError, OSError):
            continue


def store_argv(tiers: KVTierConfig, address: str, *, block_nbytes: int | None = None,
               api_keys: str | None = None, cache_secret_file: str | None = None) -> list[str]:
    """The ``kvferry kvstore`` flags serving ``tiers`` at ``address``
    (empty tier fields: no such tier)."""
    argv = ["--address", address, "--kv-dram-gb", str(tiers.kv_dram_gb)]
    for flag, value in (("--kv-disk", tiers.kv_disk or None), ("--kv-disk-gb", tiers.kv_disk_gb or None),
                        ("--kv-remote", tiers.kv_remote or None), ("--kv-cluster", tiers.kv_cluster or None),
                        ("--block-nbytes", block_nbytes),
                        ("--api-keys", api_keys), ("--cache-secret-file", cache_secret_file)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def start_store(tiers: KVTierConfig, *, block_nbytes: int | None = None, api_keys: str | None = None,
                cache_secret_file: str | None = None, extra_args: list[str] | None = None,
                timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start a store with ``tiers``' DRAM, disk, cluster and remote tiers for this
    process (which it outlives by at most a fraction of a second: it exits
    when its parent is gone) and wait until it answers. It listens at
    ``tiers.kv_store`` when that is set (a store restarted at a known
    address), else at a fresh ipc:// socket. Returns the process and its
    address. Stop it with ``process.terminate()`` (SIGTERM: a clean
    shutdown) and ``wait()``."""
    from kvferry.kvstore.client import KVStoreClient

    if tiers.kv_cluster:
        from kvferry.kvstore.cluster import PoolAddress, check_available

        PoolAddress.parse(tiers.kv_cluster)  # "auto" is kvferry serve --ray's alone: refused here, by name
        check_available()  # a ValueError naming the missing package or library, here rather than in the child
    peer_auth.socket_secret()  # in the environment before the store starts: it inherits it
    address = tiers.kv_store or ipc_address()
    argv = [sys.executable, "-m", "kvferry.kvstore.process",
            *store_argv(tiers, address, block_nbytes=block_nbytes, api_keys=api_keys,
                        cache_secret_file=cache_secret_file),
            "--parent-pid", str(os.getpid())]
    process = subprocess.Popen(argv + list(extra_args or []))
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
