"""The start-up warm-up runs the model at full step size and leaves nothing
behind: no request, no block taken or cached, the same outputs (greedy and
seeded) as a core that never warmed up. And the GC freeze of a serving
process exempts its start-up heap from later collections."""
from __future__ import annotations

import logging
import random
import subprocess
import sys

import pytest

from kvferry import LLM, SamplingParams
from kvferry.config import EngineArgs
from kvferry.engine.core import EngineCore
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("warm"), max_position_embeddings=1024))


def _core(path: str, **kwargs) -> EngineCore:
    return EngineCore(EngineArgs(model=path, dtype="float32", **kwargs).create_engine_config())


def test_warm_up_runs_a_full_step_and_leaves_no_trace(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="kvferry.engine.core"):
        core = _core(checkpoint, num_kv_blocks=256, max_num_batched_tokens=512)
    assert "warm-up: a 512-token prefill step and a decode step" in caplog.text
    assert core.runner.states == {} and core.runner.batch.req_ids == []
    assert not core.has_unfinished_requests()
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == 256
    assert not any(block.block_hash is not None for block in pool.blocks)
    assert core.scheduler.kv.take_events() == []
    core.check_integrity()
    core.close()


def test_warm_up_fits_a_pool_smaller_than_a_step(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="kvferry.engine.core"):
        core = _core(checkpoint, num_kv_blocks=2, block_size=16)
    # Two sequences of one block each, each block holding its prompt and
    # the decode step's token.
    assert "warm-up: a 30-token prefill step" in caplog.text
    assert core.scheduler.kv.pool.num_free_blocks == 2
    core.close()


def test_no_warm_up_flag_skips_it(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="kvferry.engine.core"):
        core = _core(checkpoint, num_kv_blocks=64, warm_up=False)
    assert "warm-up" not in caplog.text
    core.close()
    with pytest.raises(ValueError, match="warm_up"):
        EngineArgs(model=checkpoint, warm_up="yes")


def test_outputs_equal_a_cold_engine_greedy_and_sampled(checkpoint):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 40, 130)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)]
    results = {}
    for warm in (True, False):
        llm = LLM(model=checkpoint, dtype="float32", warm_up=warm)
        results[warm] = [[o.token_ids for o in llm.generate(prompts, p)] for p in params]
        llm.engine.check_integrity()
    assert results[True] == results[False]


_FREEZE_PROBE = """
import gc
from kvferry.gc_heap import freeze_startup_heap
startup = [[i] for i in range(50_000)]  # tracked objects alive at start-up
frozen = freeze_startup_heap("probe")
later = [[i] for i in range(10)]
tracked = {id(o) for o in gc.get_objects()}
print(frozen >= 50_000, id(startup[0]) in tracked, id(later[0]) in tracked)
"""


def test_freeze_exempts_the_startup_heap_from_collections():
    out = subprocess.run([sys.executable, "-c", _FREEZE_PROBE], capture_output=True, text=True, check=True)
    # gc.get_objects() lists what collections walk: the frozen heap is not in it.
    assert out.stdout.split() == ["True", "False", "True"]


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_warm_up_with_speculation_warms_the_draft_and_leaves_no_trace(checkpoint, method, caplog):
    """The draft model (here a copy of the target) runs in the warm-up, its
    weights packed before the first request, and the decode step verifies
    k drafts a request; afterwards no request, block or draft state is left,
    and outputs equal a cold engine's."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        spec["model"] = checkpoint
    with caplog.at_level(logging.INFO, logger="kvferry.engine.core"):
        core = _core(checkpoint, num_kv_blocks=256, max_num_batched_tokens=512, speculative=spec)
    assert "warm-up: a 512-token prefill step and a decode step" in caplog.text
    drafter = core.runner.drafter
    if method == "draft":
        assert drafter.model.weights_packed and drafter.num_computed == {}
    else:
        assert drafter is None
    assert core.runner.states == {} and core.runner.batch.req_ids == []
    assert core.scheduler.kv.pool.num_free_blocks == 256
    core.check_integrity()
    core.close()
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (6, 50)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for warm in (True, False):
        llm = LLM(model=checkpoint, dtype="float32", warm_up=warm, speculative=spec)
        results[warm] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.engine.check_integrity()
    assert results[True] == results[False]
