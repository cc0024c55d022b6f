"""A server started without --kv-cache-memory-gb sizes its KV pool from the
memory it has and the sequences it serves, logs one line with the
arithmetic, and /metrics reports the pool that line names."""
from __future__ import annotations

import re

import pytest

from kvferry.engine.kv_memory import FRACTION, GIB
from tests.serve.server_process import start_server

# Four sequences of 1024 tokens: the cap (4 x 1024 tokens, 0.18 GiB in
# float32) is below half of any machine's free memory, so the test takes
# little memory on a shared box while the line still shows both arms.
MAX_NUM_SEQS, MAX_MODEL_LEN = 4, 1024
ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS), "--dtype", "float32",
        "--no-warm-up", "--disable-uvicorn-access-log", "--log-level", "info"]
LINE = re.compile(r"KV cache: (?P<gib>[\d.]+) GiB = min\((?P<fraction>[\d.]+) x (?P<available>[\d.]+) GiB available"
                  r"(?: / (?P<cores>\d+) cores)?, (?P<seqs>\d+) seqs x (?P<len>\d+) tokens x "
                  r"(?P<kib>[\d.]+) KiB/token\) -> (?P<blocks>[\d,]+) blocks of (?P<bs>\d+) = (?P<tokens>[\d,]+) tokens")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("kv-memory")
    yield from serve_for_tests_with(log_dir)


def serve_for_tests_with(log_dir):
    proc = start_server(log_dir / "serve.log", serve_args=ARGS)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def test_the_default_pool_is_logged_with_its_arithmetic_and_reported_by_metrics(server):
    found = [m for m in map(LINE.search, server.log().splitlines()) if m]
    assert len(found) == 1, server.log()
    m = found[0]
    assert float(m["fraction"]) == FRACTION
    assert (int(m["seqs"]), int(m["len"])) == (MAX_NUM_SEQS, MAX_MODEL_LEN)
    # SmolLM2-135M in float32: 30 layers x K, V x 3 KV heads x 64 x 4 bytes = 45 KiB per token.
    assert float(m["kib"]) == 45
    blocks, block_size = int(m["blocks"].replace(",", "")), int(m["bs"])
    token_bytes = 45 * 1024
    cores = int(m["cores"] or 1)
    share_blocks = int(FRACTION * float(m["available"]) * GIB / cores) // (token_bytes * block_size)
    cap_blocks = MAX_NUM_SEQS * MAX_MODEL_LEN // block_size
    # "available" is printed to 0.01 GiB: the share's blocks are known to within that.
    slack = int(FRACTION * 0.01 * GIB / cores) // (token_bytes * block_size) + 1
    assert abs(blocks - min(share_blocks, cap_blocks)) <= slack
    assert int(m["tokens"].replace(",", "")) == blocks * block_size
    assert abs(float(m["gib"]) - blocks * block_size * token_bytes / GIB) < 0.006
    # The pool the server runs with is the one the line names.
    assert server.metric("kvferry:kv_blocks_total") == blocks
