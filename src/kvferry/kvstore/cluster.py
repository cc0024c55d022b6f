"""The cluster KV pool on Mooncake Store: a tier below each node store's
DRAM, shared by every node whose store points at the same Mooncake master
(``--kv-cluster mooncake://MASTER_HOST:PORT?metadata=URL``).

    node store A --+                                +-- segment of A's DRAM (mounted by A's client)
                   +-- Mooncake master (metadata) --+
    node store B --+                                +-- segment of B's DRAM
    (put/get move block bytes between the clients' buffers and the segments)

Each node's store process runs one Mooncake client. It contributes
``segment_gb`` of its memory to the pool (Mooncake places and evicts
objects across all segments) and moves blocks through a local transfer
buffer of ``buffer_mb``. A block written by one node is a hit for every
other node whose engines compute the same block hash: the same model, KV
dtype and cache namespace, so the same ``--cache-secret-file`` on every
node for private blocks.

Objects (string keys, ``ns`` the URL's namespace, default ``kvferry``)::

    {ns}/{owner}/{block hash hex}   the value, remote.py's format: header,
                                    tenant tag, xxh3-128 checksum, payload;
                                    a private payload is sealed with the
                                    tenant's AES-GCM key (crypto.py)
    {ns}/k/{block hash hex}         a one-byte marker: some owner's block
                                    with this hash is in the pool

``owner`` is ``pub`` for a public block, else the hex of the tenant's tag
(``crypto.tenant_tag``: no tenant name is ever stored). A reader fetches
the object under its own owner part, so another tenant's private block is
never even transferred; the checksum and the AES-GCM tag are checked all
the same. ``contains`` (asked without an owner) reads the marker.
``drop_tenant`` removes ``{ns}/{tag}/*`` on the master by pattern, whichever
node wrote them. Markers may outlive their block (a purge, an eviction):
such a block is found by ``contains``, comes back a miss from ``get`` (the
load is short, the engine recomputes) and is written again, marker and
all, by the next write-through.

**Batches.** The store's pool writer hands blocks over in batches
(``put_many``): one ``batch_is_exist`` of their values and markers, then
what is missing in one ``batch_put_from``, each value encoded and sealed
in place in a registered transfer buffer (``cluster_buffers.py``). Loads
(``get_into``, the store's DRAM slots; ``get_many`` for bytes) use one
``batch_get_into`` per batch and no lookup: an absent value is a cheap
per-key miss. Values are checked and opened in their transfer slot.

**Soft pin.** ``retain`` (a paused conversation's blocks,
``kv_retention_s``) writes the blocks the pool holds again, in place, with
Mooncake's soft pin and that TTL: the master evicts them only after every
unpinned object, until the pin lapses.

A store that stops unmounts its segment: the blocks placed in it leave the
pool (``segment_gb=0``: a node that lends nothing, whose blocks all live
in the other nodes' segments). Capacity is Mooncake's: the master evicts
objects when the segments fill (its ``--eviction_high_watermark_ratio``);
an evicted block is a plain miss here, and a put the pool cannot place is
a refused write.

**Faults.** A master that stops answering (a call failing with an RPC
error) disables the tier: one warning per outage, every call a miss or a
refused write without touching the network, and a key lookup after a
backoff that doubles up to ``retry_max_s``. The client library reconnects
by itself (and mounts this node's segment again on a restarted master);
when the master answers, the tier logs (INFO) that it is back. A master
absent at start is waited for on a thread (its port probed before each
``setup``, which holds the GIL while it retries): the store serves at
once, the pool missing until then. Nothing
raises out of ``put``/``get``. Mooncake's own log lines (glog, on stderr)
are kept to errors unless ``MC_LOG_LEVEL`` is set (its failed RPCs while
a master is down are among them).

``stats()``: hits, misses and bytes of this node's reads and writes
(the attribute ``pinned``: blocks this node soft-pinned);
``num_blocks``/``num_bytes`` stay 0, the pool's contents being the
master's to count (its metrics port).

``mooncake`` is imported lazily: only a store started with
``--kv-cluster`` needs it (``pip install 'kvferry[cluster]'``, and the
Debian libraries ``libibverbs1`` and ``librdmacm1``). ``check_available``
names what is missing.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit


from kvferry.kvstore.block_value import encode_value_into, parse_value, value_nbytes
from kvferry.kvstore.cluster_buffers import BufferPool
from kvferry.kvstore.crypto import SEAL_OVERHEAD, TierCrypto, tenant_tag
from kvferry.kvstore.tenant_lru import pool_of
from kvferry.kvstore.tier import BlockOwner, ColdTier, TenantTierStats, TierStats

log = logging.getLogger(__name__)

SCHEME = "mooncake://"
MIB = 2**20
GIB = 2**30
# What this node lends the pool, and the client's transfer buffer (every
# block a put or a batched get moves passes through it).
DEFAULT_SEGMENT_GB = 1.0
DEFAULT_BUFFER_MB = 256
# The port the master's built-in HTTP metadata server listens on by default
# (mooncake_master --enable_http_metadata_server=true).
DEFAULT_METADATA_PORT = 8080
_INSTALL_HINT = "pip install 'kvferry[cluster]' (the mooncake-transfer-engine-non-cuda package)"
_LIBS_HINT = "apt-get install libibverbs1 librdmacm1"

_MARKER = b"\x01"
# batch_get_into's per-key codes besides a length: the value is absent, or
# larger than the slot given.
_NOT_FOUND = -704
_TOO_SMALL = -600
# Any call's code when its RPC to the master failed (the master is gone).
_RPC_FAIL = -900
_PUBLIC_PART = "pub"
_MARKER_PART = "k"


# -- the --kv-cluster URL ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PoolAddress:
    """A parsed ``mooncake://MASTER_HOST:PORT?metadata=URL[&...]``.

    Query options: ``metadata`` (the metadata server; default the master's
    built-in one, ``http://MASTER_HOST:8080/metadata``), ``protocol``
    (``tcp`` or ``rdma``), ``device`` (RDMA devices), ``host`` (this node's
    address as the other nodes reach it; default the address this node
    reaches the master from), ``segment_gb``, ``buffer_mb``, ``namespace``
    (the key prefix; stores that should share blocks use the same one)."""

    url: str
    master: str
    metadata: str
    protocol: str = "tcp"
    device: str = ""
    host: str = ""
    segment_bytes: int = int(DEFAULT_SEGMENT_GB * GIB)
    buffer_bytes: int = DEFAULT_BUFFER_MB * MIB
    namespace: str = "kvferry"

    @classmethod
    def parse(cls, url: str) -> PoolAddress:
        if is_auto(url):
            raise ValueError(f"kv_cluster: {url!r} (a mooncake_master started by the server on the Ray head node) "
                             f"needs kvferry serve --ray; elsewhere give {SCHEME}MASTER_HOST:PORT?metadata=URL")
        if not isinstance(url, str) or not url.startswith(SCHEME):
            raise ValueError(f"kv_cluster: must be {SCHEME}MASTER_HOST:PORT?metadata=URL, got {url!r}")
        parts = urlsplit(url)
        try:
            host, port = parts.hostname, parts.port
        except ValueError as exc:  # a port that is not a number
            raise ValueError(f"kv_cluster: {exc} in {url!r}") from None
        if not host or port is None or parts.path not in ("", "/"):
            raise ValueError(f"kv_cluster: must be {SCHEME}MASTER_HOST:PORT?metadata=URL, got {url!r}")
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        unknown = set(query) - {"metadata", "protocol", "device", "host", "segment_gb", "buffer_mb", "namespace"}
        if unknown:
            raise ValueError(f"kv_cluster: unknown option(s) {', '.join(sorted(unknown))} in {url!r}")
        master = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        metadata = query.get("metadata") or f"http://{master.rsplit(':', 1)[0]}:{DEFAULT_METADATA_PORT}/metadata"
        if not metadata.startswith(("http://", "https://", "etcd://", "redis://")) and metadata != "P2PHANDSHAKE":
            raise ValueError(f"kv_cluster: metadata must be an http://, etcd:// or redis:// URL, got {metadata!r}")
        protocol = query.get("protocol", "tcp")
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"kv_cluster: protocol must be tcp or rdma, got {protocol!r}")
        namespace = query.get("namespace", "kvferry")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", namespace):
            raise ValueError(f"kv_cluster: namespace must be letters, digits, '_', '.', '-', got {namespace!r}")

        def size(name: str, default: float, unit: int, zero_ok: bool = False) -> int:
            raw = query.get(name)
            try:
                value = default if raw is None else float(raw)
            except ValueError:
                raise ValueError(f"kv_cluster: {name} must be a number, got {raw!r}") from None
            if not (value >= 0 if zero_ok else value > 0) or value == float("inf"):
                raise ValueError(f"kv_cluster: {name} must be {'>= 0' if zero_ok else '> 0'}, got {raw!r}")
            return int(value * unit)

        # segment_gb=0: a node that lends the pool nothing (its blocks live
        # in the other nodes' segments, and outlive its store).
        return cls(url=url, master=master, metadata=metadata, protocol=protocol, device=query.get("device", ""),
                   host=query.get("host", ""), segment_bytes=size("segment_gb", DEFAULT_SEGMENT_GB, GIB, zero_ok=True),
                   buffer_bytes=size("buffer_mb", DEFAULT_BUFFER_MB, MIB), namespace=namespace)

    def reachable(self, timeout_s: float = 1.0) -> bool:
        """Whether the master's port (and an http:// metadata server's)
        accept a TCP connection."""
        endpoints = [_host_port(self.master, 0)]
        if self.metadata.startswith(("http://", "https://")):
            endpoints.append(_host_port(urlsplit(self.metadata).netloc,
                                        443 if self.metadata.startswith("https://") else 80))
        for host, port in endpoints:
            try:
                socket.create_connection((host, port), timeout=timeout_s).close()
            except (OSError, ValueError):
                return False
        return True

    def local_host(self) -> str:
        """This node's address for the pool: ``host`` if given, else the
        local address of the route to the master (loopback for a master on
        this machine)."""
        if self.host:
            return self.host
        master_host = self.master.rsplit(":", 1)[0].strip("[]")
        family = socket.AF_INET6 if ":" in master_host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((master_host, 9))  # UDP: no packet is sent
                return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


# -- --kv-cluster auto: a master the server starts (fleet/cluster_master.py) ----------------------
AUTO = "auto"


def is_auto(value: object) -> bool:
    """``auto`` or ``auto?OPTIONS``: kvferry serve --ray starts the master."""
    return isinstance(value, str) and (value == AUTO or value.startswith(AUTO + "?"))


def _auto_options(value: str) -> str:
    """The query of ``auto?OPTIONS`` ("" for ``auto``)."""
    return value[len(AUTO) + 1:] if value.startswith(AUTO + "?") else ""


def check_auto(value: str) -> None:
    """Validate the options of ``auto?OPTIONS`` (those of a mooncake:// URL
    but ``metadata``, which the server's own master sets). Raises ValueError."""
    if "metadata" in parse_qs(_auto_options(value), keep_blank_values=True):
        raise ValueError(f"kv_cluster: {value!r}: the master the server starts serves the metadata itself; "
                         f"drop the metadata option")
    PoolAddress.parse(auto_url(value, "127.0.0.1", 1, 2))


def auto_url(value: str, host: str, rpc_port: int, metadata_port: int) -> str:
    """The mooncake:// URL of a master the server started at ``host``, with
    the options ``value`` (``auto?OPTIONS``) gives."""
    bracketed = f"[{host}]" if ":" in host else host
    url = f"{SCHEME}{bracketed}:{rpc_port}?metadata=http://{bracketed}:{metadata_port}/metadata"
    options = _auto_options(value)
    return f"{url}&{options}" if options else url


def master_binary() -> str:
    """The ``mooncake_master`` executable of the installed mooncake package,
    or a ValueError naming what is missing."""
    load_store_module()
    import mooncake

    binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    if not os.access(binary, os.X_OK):
        raise ValueError(f"kv_cluster: no executable mooncake_master in {os.path.dirname(binary)} ({_INSTALL_HINT})")
    return binary


def metadata_server_argv(host: str, port: int) -> list[str]:
    """The command of Mooncake's HTTP metadata server (the package's
    ``mooncake.http_metadata_server``) listening on ``host:port`` only: the
    master's built-in one listens on every interface whatever its
    ``--http_metadata_server_host`` says."""
    return [sys.executable, "-c", "from mooncake.http_metadata_server import main; main()",
            "--host", host.strip("[]"), "--port", str(port), "--log-level", "WARNING"]


def _host_port(netloc: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit("//" + netloc)
    return parts.hostname or "", parts.port or default_port


# -- availability of the client library ------------------------------------------------------
def load_store_module() -> Any:
    """``mooncake.store``, or a ValueError naming what is missing: the
    package, or the shared libraries its extension needs."""
    # Its client logs a dozen INFO lines per start and a warning per
    # lookup of an absent segment; errors only, unless the operator says.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        import mooncake.store as store
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "mooncake":
            raise ValueError(f"kv_cluster: the mooncake package is not installed: {_INSTALL_HINT}") from None
        raise ValueError(f"kv_cluster: mooncake.store cannot load: {exc}") from None
    except ImportError as exc:  # the extension module's own libraries
        missing = re.findall(r"([\w.+-]+\.so[\w.]*): cannot open shared object file", str(exc))
        if missing:
            raise ValueError(f"kv_cluster: mooncake.store cannot load: {', '.join(missing)} not found "
                             f"({_LIBS_HINT})") from None
        raise ValueError(f"kv_cluster: mooncake.store cannot load: {exc}") from None
    return store


def check_available(timeout_s: float = 60.0) -> None:
    """Raise a ValueError naming what is missing for ``--kv-cluster``
    (called before a store with a cluster tier is started). It tries the
    import in a child process, so that the caller (a server's front end)
    never loads Mooncake's libraries itself."""
    code = ("import sys\nfrom kvferry.kvstore.cluster import load_store_module\n"
            "try:\n    load_store_module()\nexcept ValueError as exc:\n    sys.exit(str(exc))\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"kv_cluster: cannot check the mooncake package: {exc}") from None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        reason = lines[-1] if lines else f"the check exited with code {proc.returncode}"
        raise ValueError(reason if reason.startswith("kv_cluster:") else f"kv_cluster: {reason}")


# -- the tier ---------------------------------------------------------------------------------
class MooncakeTier(ColdTier):
    name = "cluster"

    def __init__(self, address: str | PoolAddress, *, crypto: TierCrypto | None = None,
                 retry_initial_s: float = 1.0, retry_max_s: float = 30.0, connect_wait_s: float = 5.0) -> None:
        if retry_initial_s <= 0 or retry_max_s < retry_initial_s:
            raise ValueError("retry_initial_s, retry_max_s: must be > 0 and max >= initial")
        self.address = address if isinstance(address, PoolAddress) else PoolAddress.parse(address)
        self._module = load_store_module()
        self.crypto = crypto
        self.ns = self.address.namespace
        self._host = self.address.local_host()
        self._lock = threading.Lock()  # stats, availability, the client handle
        self._stats = TierStats()
        self._per_pool: dict[str, TenantTierStats] = {}
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._backoff_s = retry_initial_s
        self._down_until = float("inf")  # time.monotonic() before which calls skip the network
        self._probing = False
        self.down = True  # until the first setup succeeds
        self.outages = 0
        self.pinned = 0  # blocks soft-pinned by retain()
        self._store: Any = None
        self._buffers: BufferPool  # set with _store: its registered transfer buffers
        self._value_nbytes = 0  # the largest value seen (read slots are sized to it)
        self._closed = threading.Event()
        self._put_config = self._module.ReplicateConfig()
        self._put_config.replica_num = 1
        # The client is set up on a thread of its own: the store serves at
        # once, every pool call a miss until the client is up. A master
        # that is up is waited for (a second), so that a fresh store starts
        # with its pool.
        self._first_try = threading.Event()
        self._connector = threading.Thread(target=self._connect_loop, name="kvstore-pool-connect", daemon=True)
        self._connector.start()
        self._first_try.wait(connect_wait_s)
        if self.down:
            log.warning("cluster KV tier: no Mooncake master at %s yet; every block a miss until it answers",
                        self.address.master)

    # ---- the client -----------------------------------------------------

    def _connect_loop(self) -> None:
        """Set a client up, retrying with backoff until it is (or the tier
        closes). Once set up, the client library itself reconnects to a
        master that restarts (and mounts this node's segment again)."""
        backoff = self._retry_initial_s
        while not self._closed.is_set():
            if not self.address.reachable():
                # setup() holds the GIL while it retries an absent master
                # (about 90 s): the whole store would stall. A refused
                # connection is the common case, told apart here at once.
                self._first_try.set()
                self._closed.wait(backoff)
                backoff = min(2 * backoff, self._retry_max_s)
                continue
            store = self._module.MooncakeDistributedStore()
            rc = store.setup({
                "local_hostname": self._host, "metadata_server": self.address.metadata,
                "global_segment_size": self.address.segment_bytes, "local_buffer_size": self.address.buffer_bytes,
                "protocol": self.address.protocol, "rdma_devices": self.address.device,
                "master_server_addr": self.address.master,
            })
            if rc == 0:
                name = store.get_hostname()
                with self._lock:
                    if not self._closed.is_set():
                        self._buffers = BufferPool(store)
                        self._store, store = store, None
                        self.down = False
                if store is None:
                    log.info("cluster KV tier: connected to the Mooncake master %s as %s", self.address.master, name)
                    self._first_try.set()
                    return
            self._first_try.set()
            _close_quietly(store)
            self._closed.wait(backoff)
            backoff = min(2 * backoff, self._retry_max_s)

    def _client(self) -> Any:
        """The client to call now, or None while the tier is down and its
        backoff has not run out. When it has, one caller asks the master
        (a key lookup: the client library reconnects by itself) and the
        tier comes back if it answers."""
        with self._lock:
            if self._closed.is_set():
                return None
            if not self.down:
                return self._store
            store = self._store
            if store is None or self._probing or time.monotonic() < self._down_until:
                return None
            self._probing = True
        try:
            answered = _answers(store, f"{self.ns}/probe")
        finally:
            with self._lock:
                self._probing = False
        with self._lock:
            if not answered:
                self._backoff_s = min(2 * self._backoff_s, self._retry_max_s)
                self._down_until = time.monotonic() + self._backoff_s
                return None
            self.down = False
            self._backoff_s = self._retry_initial_s
        log.info("cluster KV tier: the Mooncake master %s is back", self.address.master)
        return store

    def _master_lost(self, store: Any, what: str, rpc_failed: bool = False) -> bool:
        """After a failed call: is the master gone (then the tier goes down:
        one warning per outage), or was it this call alone (a full pool)?
        ``rpc_failed``: the call said its RPC failed, no need to ask (asking
        a dead master takes seconds while the client retries)."""
        if not rpc_failed and _answers(store, f"{self.ns}/probe"):
            return False
        with self._lock:
            if not self.down:
                self.down = True
                self.outages += 1
                log.warning("cluster KV tier: the Mooncake master %s is unreachable (%s); every block a miss "
                            "until it answers, retrying with backoff", self.address.master, what)
            self._down_until = time.monotonic() + self._backoff_s
        return True

    # ---- keys -----------------------------------------------------------

    def _owner_part(self, owner: BlockOwner) -> str:
        return _PUBLIC_PART if owner.public else tenant_tag(self.crypto, owner.tenant).hex()

    def object_key(self, key: bytes, owner: BlockOwner) -> str:
        """The pool key of ``owner``'s block ``key`` (tests read it raw)."""
        return f"{self.ns}/{self._owner_part(owner)}/{key.hex()}"

    def _marker_key(self, key: bytes) -> str:
        return f"{self.ns}/{_MARKER_PART}/{key.hex()}"

    # ---- writes ---------------------------------------------------------

    def put(self, key: bytes, data: bytes | memoryview, owner: BlockOwner) -> bool:
        return self.put_many([(key, data, owner)])[0]

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview, BlockOwner]]) -> list[bool]:
        """Write blocks (the store's write-through hands them over in
        batches); True for each one the pool holds on return. Each block
        crosses the network once: one lookup of every value and marker
        first (another node, or this one before, may have written it), then
        what is missing in one ``batch_put_from`` per buffer of values, each
        encoded and sealed in place. A block whose marker is gone (evicted)
        gets its marker back."""
        if not items:
            return []
        store = self._client()
        if store is None:
            for _, _, owner in items:
                self._refuse(pool_of(owner))
            return [False] * len(items)
        datas = [memoryview(data).cast("B") for _, data, _ in items]  # lengths in bytes, whatever the format
        names = [self.object_key(key, owner) for key, _, owner in items]
        markers = [self._marker_key(key) for key, _, _ in items]
        ok = [False] * len(items)
        wrote = [False] * len(items)
        present: list[int] = []
        try:
            present = store.batch_is_exist(names + markers)
            if len(present) != 2 * len(items) or any(p < 0 for p in present):
                raise _CallFailed(f"batch_is_exist returned {min(present, default=-1)}", _RPC_FAIL in present)
            todo = []
            for i in range(len(items)):
                if present[i] == 1 and present[len(items) + i] == 1:
                    ok[i] = True  # already in the pool: nothing crosses the network
                else:
                    todo.append(i)
            if todo:
                self._put_missing(store, items, datas, names, markers, present, todo, wrote)
        except _CallFailed as exc:
            self._master_lost(store, f"put failed: {exc}", exc.rpc_failed)
        except Exception as exc:
            log.warning("cluster KV tier: put raised %r", exc)
            self._master_lost(store, f"put failed: {exc}")
        with self._lock:
            # The values put (a block whose marker alone was missing sent one byte).
            self._stats.bytes_written += sum(len(d) for i, d in enumerate(datas) if wrote[i] and present[i] != 1)
        for i in range(len(items)):
            if not (ok[i] or wrote[i]):
                self._refuse(pool_of(items[i][2]))
        return [a or b for a, b in zip(ok, wrote)]

    def _put_missing(self, store: Any, items: Sequence[tuple[bytes, bytes | memoryview, BlockOwner]],
                     datas: list[memoryview], names: list[str], markers: list[str], present: list[int],
                     todo: list[int], wrote: list[bool]) -> None:
        """Put the values and markers of ``todo`` the lookup did not find;
        ``wrote[i]`` for each block the pool took whole."""
        n = len(items)
        value_sizes = [value_nbytes(self.crypto, len(datas[i]), items[i][2]) for i in todo]
        self._learn_size(max(value_sizes))
        calls = refused_calls = 0
        rpc_failed = False
        with self._buffers.write_lock:
            buf = self._buffers.writer(max(value_sizes))
            for at in range(0, len(todo), buf.slots):
                chunk = todo[at:at + buf.slots]
                keys, ptrs, lens, whose = [], [], [], []
                for slot, i in enumerate(chunk):
                    if present[i] != 1:
                        key, _, owner = items[i]
                        lens.append(encode_value_into(self.crypto, key, datas[i], owner, buf.slot(slot)))
                        keys.append(names[i])
                        ptrs.append(buf.slot_ptr(slot))
                        whose.append(i)
                    if present[n + i] != 1:
                        keys.append(markers[i])
                        ptrs.append(buf.marker_ptr)
                        lens.append(len(_MARKER))
                        whose.append(i)
                rcs = store.batch_put_from(keys, ptrs, lens, self._put_config)
                refused = {i for i, rc in zip(whose, rcs) if rc != 0} | set(whose[len(rcs):])
                rpc_failed = rpc_failed or _RPC_FAIL in rcs
                calls += 1
                refused_calls += len(refused) == len(chunk)
                for i in chunk:
                    wrote[i] = i not in refused
        if refused_calls and refused_calls == calls:
            self._master_lost(store, "put refused", rpc_failed)

    def _learn_size(self, value_nbytes: int) -> None:
        """The largest value seen: the read buffers' slot size."""
        if value_nbytes > self._value_nbytes:
            self._value_nbytes = value_nbytes

    def _refuse(self, pool: str) -> None:
        with self._lock:
            self._stats.refused_writes += 1
            self._pool_stats(pool).refused_writes += 1

    def _pool_stats(self, pool: str) -> TenantTierStats:
        stats = self._per_pool.get(pool)
        if stats is None:
            stats = self._per_pool[pool] = TenantTierStats()
        return stats

    # ---- reads ----------------------------------------------------------

    def get(self, key: bytes, owner: BlockOwner) -> bytes | None:
        return self.get_many([key], owner)[0]

    def get_many(self, keys: list[bytes], owner: BlockOwner) -> list[bytes | None]:
        return self._get(keys, owner, None)  # type: ignore[return-value]

    def get_into(self, keys: list[bytes], owner: BlockOwner, outs: list[memoryview]) -> list[bool]:
        """The store's loads: each block checked and opened (decrypted)
        straight from its transfer slot into its DRAM slot."""
        return [r is not None for r in self._get(keys, owner, [out.cast("B") for out in outs])]

    def _get(self, keys: list[bytes], owner: BlockOwner,
             outs: list[memoryview] | None) -> list[bytes | memoryview | None]:
        start = time.perf_counter()
        results: list[bytes | memoryview | None] = [None] * len(keys)
        store = self._client() if keys else None
        if store is not None:
            try:
                self._read(store, keys, owner, outs, results)
            except Exception as exc:
                results = [None] * len(keys)
                self._master_lost(store, f"get failed: {exc}")
        self._count_reads(results, pool_of(owner), time.perf_counter() - start)
        return results

    def _read(self, store: Any, keys: list[bytes], owner: BlockOwner, outs: list[memoryview] | None,
              results: list[bytes | memoryview | None]) -> None:
        """Fetch, check and open ``keys`` into ``results`` (into ``outs``
        when given). No lookup first: ``batch_get_into`` tells an absent
        value (a cheap miss) from a failed call per key. Each value lands in
        a slot of a registered buffer and is checked and opened there;
        values larger than the slots (or every buffer busy) go through the
        client's ``get_batch``."""
        names = [self.object_key(k, owner) for k in keys]
        buf = self._buffers.take_reader(self._value_nbytes) if self._value_nbytes else None
        rest = list(range(len(keys)))
        failed = rpc_failed = False
        if buf is not None:
            rest = []
            try:
                for at in range(0, len(keys), buf.slots):
                    chunk = range(at, min(at + buf.slots, len(keys)))
                    rcs = store.batch_get_into([names[i] for i in chunk], [buf.slot_ptr(j) for j in range(len(chunk))],
                                               [buf.slot_nbytes] * len(chunk))
                    for j, (i, rc) in enumerate(zip(chunk, rcs)):
                        if rc > 0:
                            results[i] = self._decode(keys[i], buf.slot(j)[:rc], owner, outs and outs[i])
                        elif rc == _TOO_SMALL:
                            rest.append(i)
                        elif rc != _NOT_FOUND:
                            failed = True
                            rpc_failed = rpc_failed or rc == _RPC_FAIL
            finally:
                self._buffers.give_back(buf)
        if rest:
            # The client's own copy: for a first read (the value size not
            # known yet) or a value larger than the slots.
            values = store.get_batch([names[i] for i in rest])
            for i, value in zip(rest, values):
                if value:
                    self._learn_size(len(value))
                    results[i] = self._decode(keys[i], value, owner, outs and outs[i])
            # get_batch answers an absent value and a master that is gone
            # alike (empty bytes): a full miss asks the master.
            failed = failed or (len(rest) == len(keys) and not any(values))
        if failed:
            self._master_lost(store, "get failed", rpc_failed)

    def _decode(self, key: bytes, value: bytes | memoryview, owner: BlockOwner,
                out: memoryview | None = None) -> bytes | memoryview | None:
        """The block's bytes: a copy (``value`` may be a transfer slot), or
        ``out`` written whole (a block of another length is a miss); None
        for a miss."""
        parsed = parse_value(key, value)
        if parsed is None:
            return self._quarantine(key, owner)
        tenant, payload = parsed.tenant, parsed.payload
        if parsed.public != owner.public or (
                not owner.public and bytes(tenant) != tenant_tag(self.crypto, owner.tenant)):
            # Under this owner's key but labelled another's: never served.
            with self._lock:
                self._stats.auth_failures += 1
            return None
        if owner.public or not parsed.sealed:
            if out is None:
                return bytes(payload)
            if len(payload) != len(out):
                return None
            out[:] = payload
            return out
        if self.crypto is None:
            return None  # sealed by a node with a secret this one lacks
        if out is not None and len(payload) - SEAL_OVERHEAD != len(out):
            return None
        plain: bytes | memoryview | None
        if out is None:
            plain = self.crypto.open(key, owner.tenant, payload)
        else:
            plain = out if self.crypto.open_into(key, owner.tenant, payload, out) else None
        if plain is None:
            # Checksum intact but the tag fails under the owner's own key:
            # forged, or moved here from another block key.
            with self._lock:
                self._stats.auth_failures += 1
            self._quarantine(key, owner)
        return plain

    def _quarantine(self, key: bytes, owner: BlockOwner) -> None:  # returns the miss it is
        with self._lock:
            self._stats.quarantined += 1
        log.warning("cluster KV tier: block %s failed its checksum; removed", key.hex()[:16])
        store = self._client()
        if store is not None:
            try:
                store.remove(self.object_key(key, owner), True)
            except Exception:
                pass
        return None

    def _count_reads(self, results: list[bytes | memoryview | None], pool: str, elapsed: float) -> None:
        hits = sum(r is not None for r in results)
        with self._lock:
            self._stats.bytes_read += sum(len(r) for r in results if r is not None)
            self._stats.hits += hits
            self._stats.misses += len(results) - hits
            stats = self._pool_stats(pool)
            stats.hits += hits
            stats.misses += len(results) - hits
            if hits:
                self._stats.load_seconds += elapsed

    # ---- soft pin ---------------------------------------------------------

    def retain(self, keys: list[bytes], owner: BlockOwner, seconds: float) -> int:
        """Soft-pin ``owner``'s blocks ``keys`` (and their markers) for
        ``seconds``: a paused conversation's (``kv_retention_s``). The master
        evicts soft-pinned objects only after every unpinned one, until the
        pin's TTL runs out (capped by its ``--max_kv_soft_pin_ttl``, one day
        by default). A pin is set by writing the object with it, so each
        block the pool holds is read back and upserted in place (within the
        pool: the node's DRAM is not asked). Returns how many were pinned;
        blocks the pool does not hold are skipped. ``seconds`` <= 0 does
        nothing: pins lapse by their TTL."""
        if seconds <= 0 or not keys:
            return 0
        store = self._client()
        if store is None:
            return 0
        names = [self.object_key(k, owner) for k in keys]
        config = self._module.ReplicateConfig()
        config.replica_num = 1
        config.soft_pin_action = self._module.SoftPinAction.ENABLE
        config.soft_pin_ttl_ms = max(1, int(seconds * 1000))
        pinned = 0
        try:
            with self._buffers.write_lock:
                if not self._value_nbytes:  # nothing put or got yet: learn the size from one value
                    first = store.get_batch(names[:1])
                    self._learn_size(len(first[0]) if first and first[0] else 0)
                if not self._value_nbytes:
                    return 0
                buf = self._buffers.writer(self._value_nbytes)
                for at in range(0, len(keys), buf.slots):
                    chunk = range(at, min(at + buf.slots, len(keys)))
                    rcs = store.batch_get_into([names[i] for i in chunk], [buf.slot_ptr(j) for j in range(len(chunk))],
                                               [buf.slot_nbytes] * len(chunk))
                    found = [(i, j, rc) for j, (i, rc) in enumerate(zip(chunk, rcs)) if rc > 0]
                    if not found:
                        continue
                    up = store.batch_upsert_from(
                        [names[i] for i, _, _ in found] + [self._marker_key(keys[i]) for i, _, _ in found],
                        [buf.slot_ptr(j) for _, j, _ in found] + [buf.marker_ptr] * len(found),
                        [rc for _, _, rc in found] + [len(_MARKER)] * len(found), config)
                    pinned += sum(1 for rc in up[:len(found)] if rc == 0)
        except Exception as exc:
            log.warning("cluster KV tier: soft pin raised %r", exc)
            self._master_lost(store, f"soft pin failed: {exc}")
        with self._lock:
            self.pinned += pinned
        return pinned

    # ---- the rest of the interface ----------------------------------------

    def contains(self, key: bytes) -> bool:
        store = self._client()
        if store is None:
            return False
        try:
            found = store.is_exist(self._marker_key(key))
        except Exception:
            found = -1
        if found < 0:
            self._master_lost(store, f"is_exist returned {found}", found == _RPC_FAIL)
        return found == 1

    def delete(self, key: bytes) -> None:
        """Every owner's object of ``key`` and its marker (one pattern)."""
        self._remove_matching(rf"^{re.escape(self.ns)}/[0-9a-z]+/{key.hex()}$")

    def drop_tenant(self, tenant: str) -> int:
        """Every private block of ``tenant`` in the pool, whichever node
        wrote it; 0 while the master is down."""
        with self._lock:
            self._per_pool.pop(tenant, None)
        return self._remove_matching(rf"^{re.escape(self.ns)}/{tenant_tag(self.crypto, tenant).hex()}/.*$")

    def _remove_matching(self, pattern: str) -> int:
        store = self._client()
        if store is None:
            return 0
        try:
            # force: a block read a moment ago still holds a lease; a purge
            # must not wait for it.
            removed = store.remove_by_regex(pattern, True)
        except Exception as exc:
            removed = -1
            log.warning("cluster KV tier: remove raised %r", exc)
        if removed < 0:
            self._master_lost(store, f"remove returned {removed}")
            return 0
        return removed

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats
            return TierStats(hits=s.hits, misses=s.misses, bytes_read=s.bytes_read, bytes_written=s.bytes_written,
                             quarantined=s.quarantined, auth_failures=s.auth_failures,
                             refused_writes=s.refused_writes, num_blocks=s.num_blocks, num_bytes=s.num_bytes,
                             load_seconds=s.load_seconds,
                             per_tenant={p: TenantTierStats(t.hits, t.misses, t.num_blocks, t.num_bytes,
                                                            t.refused_writes)
                                         for p, t in self._per_pool.items()})

    def close(self) -> None:
        """Unmount this node's segment (the blocks in it leave the pool) and
        drop the client. With the master gone, the client is left as it is:
        its close retries the unmount for ten seconds and more, and the
        master forgets a silent client's segment by itself (its
        ``--client_ttl``). A process that leaves it so should end with
        ``os._exit``: the library's teardown at exit retries the same way."""
        with self._lock:
            self._closed.set()
            store, self._store = self._store, None
        if store is None:
            return
        if not self.address.reachable():
            log.warning("cluster KV tier: the Mooncake master %s is unreachable; leaving without unmounting",
                        self.address.master)
            _ABANDONED.append((store, self._buffers))  # never destroyed: its destructor would retry too
            return
        self._buffers.close()  # unregistered before the client goes
        _close_quietly(store)


class _CallFailed(OSError):
    def __init__(self, what: str, rpc_failed: bool) -> None:
        super().__init__(what)
        self.rpc_failed = rpc_failed


# Clients left open by close() with their master gone.
_ABANDONED: list[Any] = []


def _answers(store: Any, probe_key: str) -> bool:
    """Whether the master answers a key lookup (0 or 1; an RPC failure is
    negative). Not ``health_check``: it reports a master that just died as
    healthy for a while."""
    try:
        return store.is_exist(probe_key) >= 0
    except Exception:
        return False


def _close_quietly(store: Any) -> None:
    if store is not None:
        try:
            store.close()
        except Exception:
            log.exception("cluster KV tier: closing the Mooncake client failed")

