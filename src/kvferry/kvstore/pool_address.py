"""The cluster pool's address: the ``--kv-cluster`` URL
(``mooncake://MASTER_HOST:PORT?metadata=URL[&...]``) and ``auto`` (a master
that ``kvferry serve --ray`` starts, ``fleet/cluster_master.py``).

Standard library only: the config checks a URL with this module alone,
without loading the tier (``cluster.py``) or the Mooncake client.
"""
from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

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


def _host_port(netloc: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit("//" + netloc)
    return parts.hostname or "", parts.port or default_port


