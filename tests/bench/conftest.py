"""One real ``kvferry serve`` (embedded tiny default model) for the bench tests."""
from __future__ import annotations

import pytest

from tests.serve.server_process import ServerProcess, serve_for_tests


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    yield from serve_for_tests(tmp_path_factory.mktemp("bench-server"))
