"""One real ``kvferry serve`` (embedded tiny default model) for the bench tests."""
from __future__ import annotations

import pytest

from tests.serve.server_process import ServerProcess, serve_for_tests


# One for the package: its two modules' tests measure by before/after
# deltas of the server's counters, so a shared server serves both.
@pytest.fixture(scope="package")
def server(tmp_path_factory) -> ServerProcess:
    yield from serve_for_tests(tmp_path_factory.mktemp("bench-server"))
