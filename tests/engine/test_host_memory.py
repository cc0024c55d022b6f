"""tune_malloc sets glibc's thresholds in a real process, and stays out of
the way where the user tunes malloc or turns it off."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, resource, sys
from kvferry.engine.host_memory import tune_malloc
print("tuned", tune_malloc())
import torch
torch.empty(1 << 20, dtype=torch.uint8).fill_(1)  # torch's own first-use work, outside the count
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(int(sys.argv[1])):
    # 40 MiB: above the largest mmap threshold glibc adapts to by itself (32 MiB)
    x = torch.empty(40 << 20, dtype=torch.uint8)
    x.fill_(1)
    del x
print("faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _run(env_extra: dict[str, str], rounds: int = 60) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE, str(rounds)], env=env, capture_output=True, text=True, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tuned_process_reuses_its_heap_for_large_temporaries():
    tuned, default = _run({}), _run({"KVFERRY_MALLOC_TUNING": "0"})
    assert tuned["tuned"] == "True" and default["tuned"] == "False"
    # 60 x 40 MiB (10,240 pages each): glibc's defaults map and unmap the
    # block every time; tuned, the heap grows for a few rounds (the aligned
    # block does not quite fit the one just freed) and then reuses it.
    assert int(default["faults"]) > 50 * 10_240
    assert int(tuned["faults"]) < int(default["faults"]) / 3


def test_user_malloc_settings_are_left_alone():
    assert _run({"MALLOC_ARENA_MAX": "2"}, rounds=0)["tuned"] == "False"
    assert _run({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, rounds=0)["tuned"] == "False"
