"""``kvferry serve --mode afd`` on a tiny random Qwen3-MoE (8 experts, top-2,
one dense layer among the sparse ones) at 1+1, 2+1 and 1+2 attention cores
+ FFN workers (1+2: each FFN worker holds 4 whole experts and half of the
dense layer's columns; the core adds their partial sums): greedy output
equals HF transformers (float32), alone and concurrent.

Two servers: 2+1 and 1+2. 1+1 is the 2+1 server with one attention core
drained by ``kvferry scale --attention 1`` (attention cores are
data-parallel replicas on the server's FFN workers, started or scaled
alike)."""
from __future__ import annotations

from functools import partial

import pytest

from tests.parallel.afd_helpers import (PROMPTS, complete, complete_all, ffn_pids, reference, scale,
                                        servers_at_once, start_afd, workers)
from tests.tiny_moe_models import make_tiny_moe_checkpoint

LAYOUTS = {"2+1": (2, 1), "1+2": (1, 2)}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both layouts' servers, started at once while the offline reference runs."""
    path = str(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("afd-moe"), "qwen3_moe_top2",
                                        max_position_embeddings=1024))
    dirs = {layout: tmp_path_factory.mktemp(f"afd-moe-{layout}") for layout in LAYOUTS}
    with servers_at_once({layout: partial(start_afd, dirs[layout], path, *LAYOUTS[layout]) for layout in LAYOUTS},
                         meanwhile=partial(reference, path)) as both:
        yield both


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, servers):
    started, expected = servers
    return request.param, started[request.param], expected


def check_moe(srv, expected, attention: int, ffn: int) -> None:  # noqa: ANN001
    assert complete(srv, PROMPTS[2]) == expected[2]
    assert complete_all(srv, PROMPTS) == expected
    listed = workers(srv)
    assert len(listed) == attention and len(ffn_pids(srv, listed[0]["name"], count=ffn)) == ffn


def test_moe_greedy_output_equals_hf(served):
    layout, srv, expected = served
    check_moe(srv, expected, *LAYOUTS[layout])
    if layout == "2+1":  # and 1+1: one attention core drained
        down = scale(srv, "--attention", "1")
        assert down.returncode == 0, down.stdout + down.stderr
        check_moe(srv, expected, 1, 1)
