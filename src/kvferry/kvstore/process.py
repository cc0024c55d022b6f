"""The store's process: ``kvferry kvstore`` (and ``python -m
kvferry.kvstore.process``, what ``launch.start_store`` runs): its flags, the
``StoreConfig`` and cold tiers they ask for, signals, and the parent
watchdog. The service itself (requests, the arena, the tiers' policy) is in
``service.py``.

Signals: SIGTERM stops the store cleanly (pending write-backs and the
cluster pool's writes are flushed; the socket file and the arena are
removed). A store with ``--parent-pid`` (started by a server, an engine or
a node actor, which stops it with SIGTERM) ignores SIGINT, as the engine
cores do: Ctrl-C reaches the whole process group, and the parent decides
when its store stops (a supervising server would otherwise see it die and
start it again during its own shutdown). Without a parent SIGINT stops it
as SIGTERM does.

No torch is imported here: the process starts fast.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import setproctitle
import zmq

from kvferry import envs, peer_auth
from kvferry.kvstore.secret_file import ensure_secret_file, read_secret_fd, tier_secret_path
from kvferry.kvstore.service import GIB, KVStoreService, StoreConfig
from kvferry.kvstore.tenant_lru import TierQuotas
from kvferry.kvstore.tier import ColdTier

logger = logging.getLogger(__name__)


# -- configuration from flags ------------------------------------------------------------
def add_kvstore_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", required=True, help="where to listen: ipc:///path or tcp://127.0.0.1:PORT")
    # The tier flags are spelled as kvferry serve's --kv-* flags (the same
    # options, one name each); the short spellings still parse, deprecated.
    parser.add_argument("--kv-dram-gb", "--dram-gb", dest="kv_dram_gb", type=float, required=True,
                        help="size of the shared-memory DRAM arena, GiB")
    parser.add_argument("--block-nbytes", type=int, default=None,
                        help="bytes per KV block; default: taken from the first engine that connects")
    parser.add_argument("--kv-disk", "--disk", dest="kv_disk", default=None, help="directory of the SSD tier")
    parser.add_argument("--kv-disk-gb", "--disk-gb", dest="kv_disk_gb", type=float, default=None,
                        help="size of the SSD tier, GiB")
    parser.add_argument("--kv-remote", "--remote", dest="kv_remote", default=None,
                        help="remote tier, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--remote-min-hits", type=int, default=2,
                        help="loads a block must serve before write-back sends it to the remote tier too")
    parser.add_argument("--kv-cluster", dest="kv_cluster", default=None,
                        help="cluster KV pool shared by every node's store, "
                             "mooncake://MASTER_HOST:PORT?metadata=URL (Mooncake Store)")
    parser.add_argument("--cluster-min-hits", type=int, default=0,
                        help="loads a block must serve before it is written to the cluster pool (0: at its commit)")
    parser.add_argument("--cache-secret-file", default=None, help="server secret: per-tenant keys at rest")
    parser.add_argument("--cache-secret-fd", type=int, default=None,
                        help="read the server secret from this inherited file descriptor (a pipe its parent wrote "
                             "and closed: how a server hands every node store its one secret, never in argv); "
                             "the parent hands its socket secret in the environment too")
    parser.add_argument("--insecure-shared-tier", action="store_true",
                        help="run --kv-remote / --kv-cluster without the cluster secret (unkeyed checksums, private "
                             "blocks unsealed: whoever reaches the server can read and forge every tenant's KV)")
    parser.add_argument("--api-keys", default=None,
                        help="the server's key file: per-tenant quotas from quota.dram_gb / quota.disk_gb")
    parser.add_argument("--default-dram-gb", type=float, default=None,
                        help="DRAM quota of a tenant the key file gives none (default: no cap)")
    parser.add_argument("--public-dram-gb", type=float, default=None,
                        help="DRAM quota of the public pool (blocks of declared public prefixes)")
    parser.add_argument("--default-disk-gb", type=float, default=None,
                        help="disk quota of a tenant the key file gives none (default: no cap)")
    parser.add_argument("--public-disk-gb", type=float, default=None, help="disk quota of the public pool")
    parser.add_argument("--io-threads", type=int, default=4, help="threads loading blocks from cold tiers")
    parser.add_argument("--client-lease-s", type=float, default=60.0,
                        help="free the pins and reservations of a client silent this long (it died)")
    parser.add_argument("--check-integrity", action="store_true",
                        help="check the DRAM index after every request; exit non-zero if it ever broke")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit once this process is gone")
    parser.add_argument("--log-level", default="info")


def tenant_quotas_gb(path: str | Path | None, field_name: str) -> dict[str, float]:
    """Tenant -> quota.<field_name> (GiB) from the server's key file."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"api_keys: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("api_keys: the file must hold a JSON object mapping key -> tenant")
    quotas: dict[str, float] = {}
    for entry in data.values():
        if not isinstance(entry, dict) or not isinstance(entry.get("tenant"), str):
            raise ValueError("api_keys: every entry must be an object with a 'tenant' string")
        value = (entry.get("quota") or {}).get(field_name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"api_keys[{entry['tenant']!r}].quota.{field_name}: must be a number >= 0")
        quotas[entry["tenant"]] = float(value)
    return quotas


def config_from_args(args: argparse.Namespace) -> StoreConfig:
    def nbytes(gb: float | None) -> int | None:
        return None if gb is None else int(gb * GIB)

    return StoreConfig(
        address=args.address, dram_bytes=int(args.kv_dram_gb * GIB), block_nbytes=args.block_nbytes,
        tenant_dram_bytes={t: int(g * GIB) for t, g in tenant_quotas_gb(args.api_keys, "dram_gb").items()},
        default_dram_bytes=nbytes(args.default_dram_gb), public_dram_bytes=nbytes(args.public_dram_gb),
        remote_min_hits=args.remote_min_hits, cluster_min_hits=args.cluster_min_hits, io_threads=args.io_threads,
        client_lease_s=args.client_lease_s, check_integrity=args.check_integrity)


def cold_tiers_from_args(args: argparse.Namespace) -> list[ColdTier]:
    """The tiers below DRAM the flags ask for, in load order: disk, cluster,
    remote.
    Private blocks are sealed under per-tenant keys derived from the cache
    secret: the one its server handed it (``--cache-secret-fd``: every node
    store of a server shares one), else ``--cache-secret-file``, else the
    one kept beside the tiers (``secret_file.py``, generated at the first
    start), so that a restarted store can still open what it wrote."""
    if (args.kv_disk is None) != (args.kv_disk_gb is None):
        raise ValueError("kv_disk / kv_disk_gb: give both or neither")
    if not (args.kv_disk or args.kv_remote or args.kv_cluster):
        return []
    # Lazy: the CLI imports this module for every command; cryptography,
    # xxhash and the tiers (~35 ms) load only when a store has cold tiers.
    from kvferry.kvstore.crypto import TierCrypto

    secret: bytes | None = getattr(args, "cache_secret", None)  # from --cache-secret-fd (run)
    if secret is not None:
        crypto = TierCrypto(secret)
    else:
        secret_file = args.cache_secret_file
        if secret_file is None:
            secret_file, created = ensure_secret_file(tier_secret_path(args.kv_disk, args.kv_remote or args.kv_cluster))
            logger.warning("no --cache-secret-file: %s the cache secret in %s, so the tiers survive a restart",
                           "generated" if created else "using", secret_file)
            if (args.kv_cluster or args.kv_remote) and not args.insecure_shared_tier:
                # Every value in a shared tier is authenticated under the
                # secret (and pool names derive from it): under another
                # secret, a value is a forgery, public prefixes included.
                logger.warning("no --cache-secret-file: this store shares no blocks at all (public or private) "
                               "through the cluster pool or Redis with stores of another secret (give every "
                               "node's store and server the same secret file)")
        crypto = TierCrypto.from_file(secret_file)
    tiers: list[ColdTier] = []
    if args.kv_disk:
        from kvferry.kvstore.disk import DiskTier  # lazy: see TierCrypto's

        if args.kv_disk_gb <= 0:
            raise ValueError(f"kv_disk_gb: must be > 0, got {args.kv_disk_gb}")
        quotas = TierQuotas.from_gb(tenant_quotas_gb(args.api_keys, "disk_gb"), default_tenant_gb=args.default_disk_gb,
                                    public_gb=args.public_disk_gb)
        tiers.append(DiskTier(args.kv_disk, int(args.kv_disk_gb * GIB), crypto=crypto, quotas=quotas))
    if args.kv_cluster:
        from kvferry.kvstore.cluster import MooncakeTier  # lazy: see TierCrypto's

        tiers.append(MooncakeTier(args.kv_cluster, crypto=None if args.insecure_shared_tier else crypto,
                                  insecure=args.insecure_shared_tier))
    if args.kv_remote:
        from kvferry.kvstore.remote import RedisTier  # optional dependency: redis (and lazy, as above)

        tiers.append(RedisTier(args.kv_remote, crypto=None if args.insecure_shared_tier else crypto,
                               insecure=args.insecure_shared_tier))
    return tiers


def run(args: argparse.Namespace) -> int:
    """``kvferry kvstore``: serve until SIGTERM, SIGINT without a parent,
    or the parent is gone."""
    setproctitle.setproctitle("kvferry: kvstore")
    if args.parent_pid is not None:
        # Ctrl-C reaches the whole process group; the parent decides when we stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s [kvstore] %(name)s: %(message)s")
    try:
        if args.cache_secret_fd is not None:
            if args.cache_secret_file is not None:
                raise ValueError("cache_secret_file, cache_secret_fd: give one or neither")
            if envs.socket_secret() is None:
                # The socket secret derives from a cache secret *file*: a
                # parent that pipes the secret hands its socket secret too.
                raise ValueError(f"cache_secret_fd: needs the parent's socket secret in {envs.SOCKET_SECRET}")

            args.cache_secret = read_secret_fd(args.cache_secret_fd)
        elif envs.socket_secret() is None and args.cache_secret_file is None:
            logger.warning("no --cache-secret-file: only engines started by this process could present this "
                           "store's token; give the store and its servers the same --cache-secret-file")
        # The secret the engines' tokens derive from: inherited from the
        # process that started this one, else from the cache secret file.
        peer_auth.socket_secret(args.cache_secret_file)
        service = KVStoreService(config_from_args(args), cold_tiers_from_args(args))
    except (ValueError, OSError, zmq.ZMQError) as exc:
        print(f"kvferry kvstore: {exc}", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM,) if args.parent_pid is not None else (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, f: service.request_stop())
    if args.parent_pid is not None:
        _watch_parent(args.parent_pid, service)
    logger.info("kvstore serving at %s", args.address)
    service.serve_forever()
    code = 3 if service.integrity_failures else 0
    if args.kv_cluster:
        # Everything the store owns is closed by now (serve_forever). The
        # Mooncake client library's own teardown at exit retries through a
        # master that is gone for ten seconds and more: skip it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _watch_parent(parent_pid: int, service: KVStoreService) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        logger.warning("parent process %d is gone; kvstore exiting", parent_pid)
        service.request_stop()

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry kvstore", description="the node's KV store service")
    add_kvstore_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
