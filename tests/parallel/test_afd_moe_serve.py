"""``kvferry serve --mode afd`` on a tiny random Qwen3-MoE (8 experts, top-2,
one dense layer among the sparse ones) at 1+1, 2+1 and 1+2 attention cores
+ FFN workers (1+2: each FFN worker holds 4 whole experts and half of the
dense layer's columns; the core adds their partial sums): greedy output
equals HF transformers (float32), alone and concurrent."""
from __future__ import annotations

import pytest

from tests.parallel.afd_helpers import PROMPTS, complete, complete_all, ffn_pids, reference, start_afd, workers
from tests.tiny_moe_models import make_tiny_moe_checkpoint

LAYOUTS = {"1+1": (1, 1), "2+1": (2, 1), "1+2": (1, 2)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("afd-moe"), "qwen3_moe_top2",
                                        max_position_embeddings=1024))
    return path, reference(path)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, checkpoint, tmp_path_factory):
    path, expected = checkpoint
    attention, ffn = LAYOUTS[request.param]
    srv = start_afd(tmp_path_factory.mktemp(f"afd-moe-{request.param}"), path, attention, ffn)
    yield request.param, srv, expected
    assert srv.stop() == 0, srv.log()[-5000:]


def test_moe_greedy_output_equals_hf(served):
    layout, srv, expected = served
    assert complete(srv, PROMPTS[2]) == expected[2]
    assert complete_all(srv, PROMPTS) == expected
    attention, ffn = LAYOUTS[layout]
    assert len(workers(srv)) == attention and len(ffn_pids(srv, count=ffn)) == ffn
