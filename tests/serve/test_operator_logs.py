"""What an operator reads in a normal server's log: a periodic stats line
while busy, no access line per probe, no WARNING at a normal start, and no
socket files left in the temp directory after a clean stop.

One real server (embedded model, a KV store in DRAM so that the store's
socket and stats are part of it) with a private TMPDIR, at log level info
with the access log on. The last test stops it."""
from __future__ import annotations

import logging
import re
import signal
import time

import httpx
import openai
import pytest

from kvferry.types.stats import SchedulerStats
from kvferry.serve.stats_logger import StatsSample, stats_line
from tests.serve.server_process import MODEL_NAME, SERVE_ARGS, ServerProcess, start_server

STATS_INTERVAL_S = 0.5  # --log-stats-interval-s: the idle check waits in intervals of it
STATS_LINE = re.compile(
    r"engine stats: prompt (?P<prompt>[\d.]+) tok/s, generation (?P<gen>[\d.]+) tok/s, "
    r"running \d+ reqs, waiting \d+ reqs, KV cache [\d.]+%, prefix cache hit rate [\d.]+%, "
    r"KV store hits \d+/\d+ tokens \([\d.]+%\)")


@pytest.fixture(scope="module")
def tmpdir_and_server(tmp_path_factory) -> tuple:
    tmp = tmp_path_factory.mktemp("tmpdir")
    args = [a for a in SERVE_ARGS if a != "--disable-uvicorn-access-log"]
    srv = start_server(tmp_path_factory.mktemp("log") / "server.log",
                       ["--log-level", "info", "--log-stats-interval-s", str(STATS_INTERVAL_S), "--kv-dram-gb", "0.05"],
                       serve_args=args, env={"TMPDIR": str(tmp)})
    yield tmp, srv
    srv.stop()


@pytest.fixture(scope="module")
def server(tmpdir_and_server) -> ServerProcess:
    return tmpdir_and_server[1]


def _stats_lines(srv: ServerProcess) -> list[re.Match]:
    return [m for m in map(STATS_LINE.search, srv.log().splitlines()) if m]


def test_stats_line_while_busy_and_none_while_idle(server):
    with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120) as client:
        for _ in range(3):
            client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=24)
    deadline = time.monotonic() + 10
    while not any(float(m["gen"]) > 0 for m in _stats_lines(server)) and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = _stats_lines(server)
    assert any(float(m["gen"]) > 0 for m in lines) and any(float(m["prompt"]) > 0 for m in lines), \
        server.log()[-3000:]
    # The interval the burst ended in has logged by now; an idle server logs no more.
    time.sleep(1.5 * STATS_INTERVAL_S)
    before = len(_stats_lines(server))
    time.sleep(2.5 * STATS_INTERVAL_S)
    assert len(_stats_lines(server)) == before, server.log()[-3000:]


def test_health_and_metrics_polls_not_in_access_log(server):
    for _ in range(5):
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.base_url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{server.base_url}/v1/models", timeout=10).status_code == 200
    deadline = time.monotonic() + 5
    while '"GET /v1/models HTTP/1.1" 200' not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log()
    assert '"GET /v1/models HTTP/1.1" 200' in log, log[-3000:]  # the access log is on
    assert '"GET /health' not in log and '"GET /metrics' not in log, log[-3000:]


def test_no_warning_at_a_normal_start(server):
    log = server.log()
    assert "KV store started" in log  # the store (whose probe used to warn) is part of this start
    assert not [line for line in log.splitlines() if "WARNING" in line], log[-5000:]


def test_clean_stop_leaves_no_socket_files(tmpdir_and_server):
    tmp, srv = tmpdir_and_server
    assert any(p.name.startswith("kvferry-") for p in tmp.iterdir())  # it did use this TMPDIR
    assert srv.stop(signal.SIGTERM) == 0, srv.log()[-5000:]
    left = sorted(p.name for p in tmp.iterdir() if p.name.startswith("kvferry") or p.suffix == ".sock")
    assert left == [], left


# -- the stats line's arithmetic, without a server --------------------------------------
def _sample(t: float, prompt: int = 0, gen: int = 0, queries: int = 0, hits: int = 0) -> StatsSample:
    return StatsSample(t, prompt, gen, queries, hits, 0, 0)


def test_stats_line_rates_and_idle():
    idle = SchedulerStats(kv_blocks_total=100)
    assert stats_line(_sample(0.0), _sample(10.0), idle) is None
    busy = SchedulerStats(num_running=2, num_waiting=1, kv_blocks_used=25, kv_blocks_total=100)
    line = stats_line(_sample(0.0, 100, 50, 400, 100), _sample(10.0, 600, 250, 800, 300), busy)
    assert line == ("engine stats: prompt 50.0 tok/s, generation 20.0 tok/s, running 2 reqs, waiting 1 reqs, "
                    "KV cache 25.0%, prefix cache hit rate 50.0%")
    # Nothing moved but a request still waits: still worth a line.
    assert stats_line(_sample(0.0), _sample(10.0), SchedulerStats(num_waiting=1)) is not None


def test_early_store_probe_is_quiet_and_a_real_refusal_warns(caplog):
    from kvferry.config import KVTierConfig
    from kvferry.kvstore.client import KVStoreClient
    from kvferry.kvstore.launch import start_store

    process, address = start_store(KVTierConfig(kv_dram_gb=0.01))
    try:
        with caplog.at_level(logging.DEBUG, logger="kvferry.kvstore.client"):
            KVStoreClient(address).close()  # no arena yet: early, not refused
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            KVStoreClient(address, block_nbytes=4096).close()  # makes the arena
            KVStoreClient(address, block_nbytes=8192).close()  # another block size: refused
        assert [r for r in caplog.records if r.levelno == logging.WARNING and "block_nbytes" in r.getMessage()]
    finally:
        process.terminate()
        process.wait(timeout=10)
