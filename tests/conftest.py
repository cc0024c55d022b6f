import os

import pytest

from kvferry import envs


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Without a GPU, the Triton attention kernels run in Triton's interpreter
# (numpy): that is how they are tested on CPU. Triton reads this when it is
# first imported, so it is set before any test module imports it.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The servers the tests start import xgrammar (and torch and transformers
# under it: ~1.5 CPU-s each) at their first structured request, not at
# start-up: most serve none. Inherited by every process a test starts.
os.environ.setdefault(envs.GRAMMAR_IMPORT, "first-use")


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA exists; no test may need a GPU."""
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """One real ``kvferry serve`` with the test defaults (SERVE_ARGS) for the
    whole session: the server tests, the bench tests and the docs' examples
    all ran the same configuration, each starting its own. Its users measure
    by before/after deltas of its counters; stopped (exit code 0 checked)
    at the end of the session."""
    from tests.serve.server_process import serve_for_tests

    yield from serve_for_tests(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="session")
def disagg_server(tmp_path_factory):
    """One real disaggregated ``kvferry serve`` (1 prefill + 1 decode core,
    the test defaults otherwise) for the session: ``kvferry profile``'s
    host-sharing test and the scaling test each started the same one.
    Each user takes it at 1 + 1 and leaves it so (test_scale.py scales
    both pools, then back with ``kvferry scale``); stopped, exit code 0
    checked, at the end of the session."""
    from tests.serve.server_process import start_server

    srv = start_server(tmp_path_factory.mktemp("disagg") / "server.log",
                       ["--mode", "disagg", "--prefill", "1", "--decode", "1"])
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"
