"""One reused HTTP/1.1 connection, for tests that check the server keeps a
keep-alive connection usable after bad input."""
from __future__ import annotations

import http.client


class KeepAlive:
    """Every request goes over the same socket; fails if the server dropped
    it between requests without announcing ``Connection: close``."""

    def __init__(self, base_url: str, timeout_s: float = 60) -> None:
        host, port = base_url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
        self.sock = None

    def post(self, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
        self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        if self.sock is None:
            self.sock = self.conn.sock
        assert self.conn.sock is self.sock, "the client had to reconnect: the server dropped the connection"
        response = self.conn.getresponse()
        data = response.read()
        if response.getheader("connection") == "close":
            self.conn.close()
            self.sock = None
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data

    def close(self) -> None:
        self.conn.close()
