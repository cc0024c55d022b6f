"""Tokens the node's internal sockets ask of their peers: the KV store's
(``kvstore/service.py``) and a core's KV transfer socket
(``disagg/transport.py``). Any local process can connect to a tcp://
port, and an ipc:// socket is only as private as its file; a peer that
does not present the token is refused and none of its commands runs.

    socket secret  = HMAC-SHA256(cache secret, "kvferry socket secret v1")  given a cache secret file
                   = 32 random bytes                                         otherwise
    token(purpose) = HMAC-SHA256(socket secret, "kvferry socket token v1" 0x00 purpose)

One secret per process tree. The first kvferry process that needs it (a
server's front end, ``kvferry kvstore``, ``kvferry engine-core``, an
offline ``LLM``) puts it in its environment (``KVFERRY_SOCKET_SECRET``,
hex), where every process it starts afterwards (engine cores, the store)
finds it: peers started together agree without any flag. Processes
started apart (a store and the servers that attach to it, prefill and
decode cores on two nodes) agree when each gets the same
``--cache-secret-file``. A secret already in the environment wins: the
process was started by one that chose it for the whole tree.

The environment of a process is readable only by its user (and root),
who can read the cache secret file as well; it holds a derived value, so
it never reveals the cache secret itself (tenant namespaces, keys at rest).
No heavy imports: the front end imports this before anything loads.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from pathlib import Path

from kvferry import envs

SECRET_ENV = envs.SOCKET_SECRET  # written here for the processes this one starts
TOKEN_BYTES = 32

# Purposes: one token per kind of socket, so that a token seen on one
# (e.g. sniffed from a tcp:// transfer link) opens no other.
KVSTORE = "kvstore"
KV_TRANSFER = "kv-transfer"
ENGINE_CORE = "engine-core"  # a front end's inputs to an engine core (engine/core_auth.py)

_SECRET_LABEL = b"kvferry socket secret v1"
_TOKEN_LABEL = b"kvferry socket token v1\0"
_MIN_SECRET_BYTES = 16
_lock = threading.Lock()  # two threads drawing a first secret at once must agree


def socket_secret(cache_secret_file: str | os.PathLike | None = None) -> bytes:
    """This process tree's socket secret, set in the environment (for the
    processes started from now on) if it was not there yet. Raises
    ValueError naming the file or the variable when either is unusable."""
    with _lock:
        return _socket_secret(cache_secret_file)


def _socket_secret(cache_secret_file: str | os.PathLike | None) -> bytes:
    value = envs.socket_secret()
    if value:
        try:
            secret = bytes.fromhex(value)
        except ValueError:
            raise ValueError(f"{SECRET_ENV}: must be hex digits") from None
        if len(secret) < _MIN_SECRET_BYTES:
            raise ValueError(f"{SECRET_ENV}: must hold at least {_MIN_SECRET_BYTES} bytes")
        return secret
    if cache_secret_file is not None:
        try:
            cache_secret = Path(cache_secret_file).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"cache_secret_file: cannot read {cache_secret_file}: {exc.strerror or exc}") from None
        if len(cache_secret) < _MIN_SECRET_BYTES:
            raise ValueError(f"cache_secret_file: {cache_secret_file} must hold at least {_MIN_SECRET_BYTES} bytes")
        secret = hmac.new(cache_secret, _SECRET_LABEL, hashlib.sha256).digest()
    else:
        secret = secrets.token_bytes(32)
    os.environ[SECRET_ENV] = secret.hex()
    return secret


def use_cache_secret_file(path: str | os.PathLike) -> None:
    """Derive this process tree's socket secret from a cache secret file,
    replacing one already set: for a process that attaches to peers
    started apart with ``--cache-secret-file path`` (e.g. an offline
    ``LLM(kv_store=...)`` on a separately started store)."""
    with _lock:
        os.environ.pop(SECRET_ENV, None)
        _socket_secret(path)


def token(purpose: str) -> bytes:
    """The token peers present on sockets of kind ``purpose``."""
    return hmac.new(socket_secret(), _TOKEN_LABEL + purpose.encode(), hashlib.sha256).digest()


def check(presented: bytes, expected: bytes) -> bool:
    """Constant time: a peer learns nothing from how fast it is refused."""
    return isinstance(presented, bytes) and hmac.compare_digest(presented, expected)
