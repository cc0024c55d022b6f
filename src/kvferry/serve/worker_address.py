"""An admin's worker address, checked before the server tries to join it.

    check_worker_address(address)             ValueError (a 400) naming ``address``
    await probe_worker(addresses)             WorkerUnreachable (a 502)

A core's address names two sockets (``CoreAddresses.from_address``):
``tcp://HOST:PORT`` is PORT and PORT+1; ``ipc://PATH`` is PATH-input and
PATH-output. Left to ZeroMQ, a connect to anything (``ipc:///etc/passwd``,
a closed port) "succeeds" and the join waits out its whole handshake
timeout before failing. So the address is checked here first:

- its form: a port in range (both of its ports), an ipc path whose two
  sockets exist and are Unix sockets (not arbitrary files);
- the peer: each socket is connected to with a plain socket and must start
  ZeroMQ's handshake (ZMTP's greeting, which a ZeroMQ peer sends at once,
  even while its core still loads) within a few seconds. No ZeroMQ socket
  connects here, so the probe never becomes one of the core's pipes:
  nothing the core sends is lost to it. A refused connection is tried
  again for a while (``wait_s``): a core started just before it was
  joined binds its sockets within seconds.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import time

from kvferry.engine.core_client import CoreAddresses

# Every ZMTP greeting (versions 1 to 3) starts with the byte 0xFF, which a
# ZeroMQ peer sends as soon as a connection opens.
_GREETING_FIRST_BYTE = b"\xff"
GREETING_TIMEOUT_S = 3.0  # a connected peer that sends no greeting in this time is not ZeroMQ
REFUSED_WAIT_S = 30.0  # how long a refused connection is tried again (the join's own handshake budget)


class WorkerUnreachable(Exception):
    """Nothing that speaks ZeroMQ answers at the address (a 502)."""


def check_worker_address(address: str) -> CoreAddresses:
    """The address's two sockets; ValueError naming ``address`` when it
    cannot be a core's address."""
    addresses = CoreAddresses.from_address(address)  # the form; a port whose PORT+1 is one too
    if address.startswith("tcp://"):
        return addresses
    for path in (_ipc_path(addresses.input), _ipc_path(addresses.output)):
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise ValueError(f"address: {address!r} names no core: {path} {exc.strerror.lower()}") from None
        if not stat.S_ISSOCK(mode):
            raise ValueError(f"address: {address!r} names no core: {path} is not a Unix socket")
    return addresses


async def probe_worker(addresses: CoreAddresses, greeting_timeout_s: float = GREETING_TIMEOUT_S,
                       wait_s: float = REFUSED_WAIT_S) -> None:
    """Raise WorkerUnreachable unless both sockets accept a connection (tried
    again while refused, up to ``wait_s``) and start ZeroMQ's handshake
    within ``greeting_timeout_s`` of connecting."""
    deadline = time.monotonic() + wait_s
    await asyncio.gather(*(_probe_until(a, greeting_timeout_s, deadline)
                           for a in (addresses.input, addresses.output)))


async def _probe_until(endpoint: str, timeout_s: float, deadline: float) -> None:
    while True:
        try:
            return await _probe(endpoint, timeout_s)
        except ConnectionRefusedError as exc:
            if time.monotonic() >= deadline:
                raise WorkerUnreachable(f"cannot connect to {endpoint}: {exc.strerror or exc}") from None
            await asyncio.sleep(0.2)


async def _probe(endpoint: str, timeout_s: float) -> None:
    """ConnectionRefusedError while nothing listens there (yet)."""
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            if endpoint.startswith("ipc://"):
                reader, writer = await asyncio.open_unix_connection(_ipc_path(endpoint))
            else:
                host, _, port = endpoint[len("tcp://"):].rpartition(":")
                reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            greeting = await reader.readexactly(1)
    except TimeoutError:
        raise WorkerUnreachable(f"{endpoint} did not start a ZeroMQ handshake within {timeout_s:g} s") from None
    except asyncio.IncompleteReadError:
        raise WorkerUnreachable(f"{endpoint} closed the connection without a ZeroMQ handshake") from None
    except ConnectionRefusedError:
        raise
    except (OSError, socket.gaierror) as exc:
        raise WorkerUnreachable(f"cannot connect to {endpoint}: {exc.strerror or exc}") from None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    if greeting != _GREETING_FIRST_BYTE:
        raise WorkerUnreachable(f"{endpoint} is not a ZeroMQ socket (no ZMTP greeting)")


def _ipc_path(endpoint: str) -> str:
    return endpoint[len("ipc://"):]
