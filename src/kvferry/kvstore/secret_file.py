"""The cache secret kept beside a persistent KV tier when no
``--cache-secret-file`` is given.

The secret keys the tenants' cache namespaces (so the block hashes) and
the per-tenant keys that seal private blocks at rest. A fresh one per start
makes every block on the SSD (or in Redis) unreachable after a restart, so
a server with a persistent tier keeps the one it generated::

    <--kv-disk DIR>/cache-secret               with a disk tier
    $KVFERRY_CACHE_DIR/cache-secret-<url hash>  a remote tier only (never in
                                               Redis itself: the secret must
                                               not sit beside what it seals)

The file is 64 hex characters and a newline, mode 0600, written to a
temporary file first and linked into place (a start that races another
keeps whichever secret landed first, never a half-written one). No heavy
imports: the server's front end calls this before anything loads.

A server hands its one cache secret to every node store it starts
(``server_cache_secret``), through a pipe (``launch.start_store``,
``--cache-secret-fd``), never in argv: stores on other nodes could not
read the server's file, and a secret per store would share nothing
between them.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
from pathlib import Path

from kvferry import envs

logger = logging.getLogger(__name__)

SECRET_FILE_NAME = "cache-secret"
# What CacheNamespaces and TierCrypto accept.
_MIN_SECRET_BYTES = 16


def cache_dir() -> Path:
    return envs.cache_dir()


def tier_secret_path(disk: str | None, remote: str | None) -> Path | None:
    """Where the generated secret of these tiers lives (None: no
    persistent tier, a fresh secret per start loses nothing)."""
    if disk:
        return Path(disk) / SECRET_FILE_NAME
    if remote:
        # One file per remote URL, named by a digest so that no credential
        # in the URL lands in a file name.
        digest = hashlib.sha256(remote.encode()).hexdigest()[:16]
        return cache_dir() / f"{SECRET_FILE_NAME}-{digest}"
    return None


def read_secret(path: str | os.PathLike) -> bytes:
    """The secret a cache secret file holds (its bytes, stripped, as
    ``TierCrypto.from_file`` reads them). Raises ValueError naming the file."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cache secret file {path}: {exc.strerror or exc}") from None
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"cache secret file {path}: holds {len(secret)} bytes, needs at least {_MIN_SECRET_BYTES}")
    return secret


def server_cache_secret(path: str | os.PathLike | None) -> bytes:
    """The one cache secret a server hands to each node store it starts:
    the file's (given, or kept beside a persistent tier), else a fresh one
    for this server's lifetime (what a generated file would hold)."""
    return read_secret(path) if path is not None else secrets.token_hex(32).encode()


def read_secret_fd(fd: int) -> bytes:
    """The secret a parent wrote into the pipe ``fd`` (then closed): read to
    its end and closed. Raises ValueError naming the flag."""
    chunks = []
    try:
        with os.fdopen(fd, "rb") as pipe:
            while chunk := pipe.read(4096):
                chunks.append(chunk)
                if sum(map(len, chunks)) > 4096:
                    raise ValueError("cache_secret_fd: more than 4096 bytes: not a cache secret")
    except OSError as exc:
        raise ValueError(f"cache_secret_fd: cannot read fd {fd}: {exc.strerror or exc}") from None
    secret = b"".join(chunks).strip()
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"cache_secret_fd: holds {len(secret)} bytes, needs at least {_MIN_SECRET_BYTES}")
    return secret


def ensure_secret_file(path: str | os.PathLike) -> tuple[Path, bool]:
    """The secret file at ``path``, generated if missing. Returns (path,
    created). Raises ValueError naming the file when it cannot be read,
    written, or holds too short a secret."""
    path = Path(path)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        created = not path.exists() and _create(path)
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cache secret file {path}: {exc.strerror or exc}") from None
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"cache secret file {path}: holds {len(secret)} bytes, needs at least {_MIN_SECRET_BYTES}")
    if not created and path.stat().st_mode & 0o077:
        logger.warning("cache secret file %s is readable by other users (chmod 600 it)", path)
    return path, created


def _create(path: Path) -> bool:
    """Write a new secret beside ``path`` and link it into place. False
    when another process put one there first (theirs is kept)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.write(fd, (secrets.token_hex(32) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and never replaces a file already there
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                return False
            raise
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    _sync_dir(path.parent)
    return True


def _sync_dir(directory: Path) -> None:
    """Make the new name durable (a crash must not lose the secret that
    sealed blocks already on disk)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
