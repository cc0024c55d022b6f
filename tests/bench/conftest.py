"""One real ``kvferry serve`` (embedded tiny default model) for the bench tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.serve.server_process import ServerProcess, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    # KVFERRY_TEST_SERVER=http://127.0.0.1:PORT reuses a server started by hand.
    if url := os.environ.get("KVFERRY_TEST_SERVER"):
        yield ServerProcess(None, url.rstrip("/"), Path(os.devnull))
        return
    srv = start_server(tmp_path_factory.mktemp("bench-server") / "server.log")
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"
