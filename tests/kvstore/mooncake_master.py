"""A real ``mooncake_master`` (from the mooncake pip package) on 127.0.0.1
for the tests, with Mooncake's HTTP metadata server beside it (the
package's own ``mooncake.http_metadata_server``: the master's built-in one
listens on every interface whatever its host flag says): free ports, no
HA; both killed (SIGKILL) and restarted on the same ports at will."""
from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvferry.kvstore.mooncake_lib import metadata_server_argv
from tests.kvstore.redis_server import free_port


def mooncake_binary() -> str:
    """The master binary, or a skip naming what is missing."""
    from kvferry.kvstore.mooncake_lib import master_binary

    try:
        return master_binary()
    except ValueError as exc:
        pytest.skip(str(exc))


class MooncakeMaster:
    def __init__(self, workdir: Path, *, segment_gb: float = 1 / 32, buffer_mb: int = 16,
                 extra_args: list[str] | None = None) -> None:
        self.binary = mooncake_binary()
        self.workdir = workdir
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"
        self.url = (f"mooncake://127.0.0.1:{self.rpc_port}?metadata={self.metadata}"
                    f"&segment_gb={segment_gb}&buffer_mb={buffer_mb}")
        self.extra_args = list(extra_args or [])  # more mooncake_master flags
        self.proc: subprocess.Popen | None = None
        self.metadata_proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.workdir / "mooncake_master.log", "ab")
        self.metadata_proc = subprocess.Popen(metadata_server_argv("127.0.0.1", self.http_port), stdout=log,
                                              stderr=subprocess.STDOUT)
        self.proc = subprocess.Popen(
            [self.binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
             "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
             "--enable_metric_reporting=false", "--client_ttl=3", *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for name, proc in (("mooncake_master", self.proc), ("the metadata server", self.metadata_proc)):
                if proc.poll() is not None:
                    code = proc.returncode
                    self.kill()
                    raise RuntimeError(f"{name} exited with {code} (log: {self.workdir / 'mooncake_master.log'})")
            if all(_listening(port) for port in (self.rpc_port, self.http_port)):
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("mooncake_master did not start")

    def kill(self) -> None:
        """SIGKILL: the master and its metadata server vanish mid-run."""
        for proc in (self.proc, self.metadata_proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.proc = self.metadata_proc = None


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
