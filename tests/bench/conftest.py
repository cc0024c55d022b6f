"""One real ``kvferry serve`` (embedded tiny default model) for the bench tests."""
from __future__ import annotations

import pytest

from tests.serve.server_process import ServerProcess


# The session's default server (tests/conftest.py): its two modules' tests
# measure by before/after deltas of the server's counters, so a shared
# server serves them, as it serves the server tests.
@pytest.fixture(scope="package")
def server(default_server) -> ServerProcess:
    return default_server
