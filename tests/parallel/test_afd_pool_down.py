"""An attention core on the server's FFN pool (a shared folder, as under
``kvferry serve --mode afd``) notices at once, idle, when the pool is down
(its restart budget spent): ``check()`` (the core's idle turn calls it)
raises, so the core ends and /health sees it before any request fails."""
from __future__ import annotations

import os
import signal
import time

import pytest

from kvferry.config import EngineArgs
from kvferry.engine.afd_leader import AFDLeader
from kvferry.engine.afd_pool import FFNPool
from kvferry.parallel import RankFailed
from tests.tiny_models import make_tiny_checkpoint


def test_an_idle_core_ends_at_once_when_the_pool_is_down(tmp_path):
    checkpoint = str(make_tiny_checkpoint(tmp_path / "m", arch="llama", num_hidden_layers=2, vocab_size=387))
    folder = tmp_path / "afd"
    folder.mkdir(mode=0o700)
    config = EngineArgs(model=checkpoint, dtype="float32", ffn=1, afd_folder=str(folder)).create_engine_config()
    pool = FFNPool(config, max_restarts=0, window_s=600)
    leader = AFDLeader(config, name="engine-0")
    try:
        leader.connect()
        leader.check()
        [ffn] = pool.pids
        os.kill(ffn, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while leader.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(RankFailed, match="the FFN workers are down"):
            leader.check()
        assert pool.health == "down"
    finally:
        leader.close()
        pool.stop()
