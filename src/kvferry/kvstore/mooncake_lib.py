"""The Mooncake library as kvferry uses it: loading the client module
(naming what is missing), the master's binary and its metadata server's
command (``fleet/cluster_master.py``, the tests and the bench start them).

``mooncake`` is imported lazily: only a store started with
``--kv-cluster`` needs it (``pip install 'kvferry[cluster]'``, and the
Debian libraries ``libibverbs1`` and ``librdmacm1``).
"""
from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
import subprocess
import sys
from typing import Any

_INSTALL_HINT = "pip install 'kvferry[cluster]' (the mooncake-transfer-engine-non-cuda package)"
_LIBS_HINT = "apt-get install libibverbs1 librdmacm1"


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
    code = ("import sys\nfrom kvferry.kvstore.mooncake_lib import load_store_module\n"
            "try:\n    load_store_module()\nexcept ValueError as exc:\n    sys.exit(str(exc))\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"kv_cluster: cannot check the mooncake package: {exc}") from None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        reason = lines[-1] if lines else f"the check exited with code {proc.returncode}"
        raise ValueError(reason if reason.startswith("kv_cluster:") else f"kv_cluster: {reason}")




# -- the data plane: only the configured interface -------------------------------------------
# Mooncake's TCP transport (0.3.x) listens for transfers and handshakes on
# every interface (``::`` and ``0.0.0.0``), whatever host it is given, and
# advertises the first LAN address it finds. Its data plane has no
# authentication: whoever reaches those ports reads and writes the
# registered segments. ``MC_TCP_BIND_ADDRESS`` fixes what it advertises;
# the sockets it binds are then tied to the interface holding that address
# (SO_BINDTODEVICE, which a listening socket honours for every later
# connection), so that nothing else reaches them.
BIND_ADDRESS_ENV = "MC_TCP_BIND_ADDRESS"
_SIOCGIFADDR = 0x8915


def advertise_only(host: str) -> None:
    """Before ``setup``: the client advertises ``host`` (not its first LAN
    address) for its transfer and handshake ports."""
    os.environ[BIND_ADDRESS_ENV] = host.strip("[]")


def listening_sockets(pid: int | str = "self") -> dict[str, tuple[str, int]]:
    """The listening TCP sockets of process ``pid``: socket inode ->
    (address, port), from /proc (no third-party package)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            rows = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # /proc writes 32-bit words host-endian
            found[fields[9]] = (socket.inet_ntop(family, raw), int(port, 16))
    return found


def interface_of(host: str) -> str | None:
    """The name of the local interface holding ``host``'s address (None
    when no interface does)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except OSError:
        return None
    addresses = {info[4][0] for info in infos}
    v4 = {a for a in addresses if ":" not in a}
    for _, name in socket.if_nameindex():
        if v4:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    ifaddr = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    ifaddr = b""
            if ifaddr and socket.inet_ntoa(ifaddr[20:24]) in v4:
                return name
    if any(a.startswith("127.") for a in v4):
        return "lo"
    v6 = {socket.inet_pton(socket.AF_INET6, a.split("%")[0]) for a in addresses if ":" in a}
    try:
        rows = open("/proc/net/if_inet6").read().splitlines()
    except OSError:
        rows = []
    for row in rows:
        fields = row.split()
        if len(fields) >= 6 and bytes.fromhex(fields[0]) in v6:
            return fields[5]
    return None


def confine_listeners(host: str, before: set[str]) -> list[tuple[str, int]]:
    """After ``setup``: tie every wildcard listening socket this process
    opened since ``before`` (inodes of ``listening_sockets()``) to the
    interface holding ``host``. Returns the (address, port) pairs that are
    still open to every interface (none, unless the interface is unknown
    or the kernel refuses)."""
    opened = {inode: addr for inode, addr in listening_sockets().items()
              if inode not in before and addr[0] in ("0.0.0.0", "::")}
    if not opened:
        return []
    device = interface_of(host)
    if device is None:
        return list(opened.values())
    left = dict(opened)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        inode = target[8:-1] if target.startswith("socket:[") else None
        if inode not in left:
            continue
        try:
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
            del left[inode]
        except OSError:
            pass
        finally:
            sock.close()  # the duplicate only: the library's socket stays open, now bound to the device
    return list(left.values())


def bound_device(inode: str) -> str | None:
    """The interface a listening socket of this process is tied to (None:
    every interface); for the tests."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != f"socket:[{inode}]":
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            name = sock.getsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, 64).split(b"\0")[0]
        finally:
            sock.close()
        return name.decode() or None
    return None
