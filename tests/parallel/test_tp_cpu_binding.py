"""KVFERRY_CPU_BIND with ``-tp 2``: each rank on its own CPUs.

Rank 0's stepping thread pins itself before it builds the core, and builds
the ranks from that thread: the ranks' CPUs must come from the process's
set, not that thread's one CPU (which left the ranks unpinned and, through
inheritance, all of them on rank 0's CPU).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.tiny_models import make_tiny_checkpoint

ALLOWED = sorted(os.sched_getaffinity(0))

_RUN = """
import os, sys, threading, torch
torch.set_num_threads(1)  # rank 0's team: 1 thread, as --cpu-threads-per-rank 1
from kvferry import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", tensor_parallel_size=2, cpu_threads_per_rank=1, num_kv_blocks=32)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
assert len(out[0].token_ids) == 4
[worker] = llm.engine.core.tp._procs
steps = [t for t in threading.enumerate() if t.name.startswith("kvferry-steps")]
print("rank0", sorted(os.sched_getaffinity(steps[0].native_id)), "rank1", sorted(os.sched_getaffinity(worker.pid)))
llm.engine.core.close()
"""


@pytest.mark.skipif(len(ALLOWED) < 2, reason="two ranks on their own CPUs need 2 CPUs")
def test_tp_ranks_pin_to_their_own_cpus(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path)
    env = dict(os.environ, KVFERRY_CPU_BIND="1")
    done = subprocess.run([sys.executable, "-c", _RUN, str(checkpoint)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # The worker's pid is its main thread, the one that runs its torch ops.
    assert f"rank0 [{ALLOWED[0]}] rank1 [{ALLOWED[1]}]" in done.stdout, done.stdout + done.stderr[-2000:]
