"""The engine core has its attention kernel before it says ready, so the
first requests' TTFT never pays for building or loading it."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.tiny_models import make_tiny_checkpoint

_PROBE = """
import sys
from kvferry.config import EngineArgs
from kvferry.engine.core import EngineCore
from kvferry.model import paged_kernel
assert not paged_kernel._loaded
core = EngineCore(EngineArgs(model=sys.argv[1], dtype="float32", num_kv_blocks=16).create_engine_config())
core.ready_message()
print("kernel fetched before ready:", paged_kernel._loaded)
"""


def test_cpu_core_fetches_the_kernel_before_ready(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path)
    # A fresh process: this one may have loaded the kernel in earlier tests.
    env = {k: v for k, v in os.environ.items() if k != "KVFERRY_DISABLE_CPP_KERNELS"}
    done = subprocess.run([sys.executable, "-c", _PROBE, str(checkpoint)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel fetched before ready: True" in done.stdout
