"""The server's listening socket: connections it accepts send small writes
at once (TCP_NODELAY), and a busy port fails fast with the address."""
from __future__ import annotations

import asyncio
import socket

import pytest

from kvferry.serve.server import bind_socket


def test_accepted_connections_have_nodelay():
    # The real asyncio server uvicorn runs on, over our socket: without
    # TCP_NODELAY a non-streamed response (headers, then body) waits for the
    # client's delayed ACK (~40 ms per request on a kept-alive connection).
    listen = bind_socket("127.0.0.1", 0)
    port = listen.getsockname()[1]
    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            sock = transport.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main():
        server = await asyncio.get_running_loop().create_server(Probe, sock=listen)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0


def test_busy_port_names_the_address():
    taken = bind_socket("127.0.0.1", 0)
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
        bind_socket("127.0.0.1", port)
    taken.close()
