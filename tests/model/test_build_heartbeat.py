"""A kernel build is never silent for long: the build script and the
engine's first-use build each say every HEARTBEAT_S (10 s, under the 15 s
a user waits before thinking it hung) that it is still going."""
from __future__ import annotations

import subprocess
import sys
import time

from kvferry.model.build_progress import HEARTBEAT_S, heartbeat


def test_heartbeat_calls_until_the_block_ends():
    beats: list[float] = []
    with heartbeat(beats.append, every_s=0.05):
        time.sleep(0.5)
    count = len(beats)
    assert count >= 3 and beats == sorted(beats)
    time.sleep(0.2)
    assert len(beats) == count  # stopped with the block
    assert HEARTBEAT_S <= 15


def test_the_build_script_prints_a_line_at_least_every_heartbeat():
    # A short heartbeat, so that even a kernel that only loads from the
    # cache (a few seconds: torch's import) is still running at a beat.
    code = ("import sys, kvferry.model.build_kernels as b; b.HEARTBEAT_S = 0.5; "
            "sys.exit(b.main(['--kernels', 'gemm', 'quant']))")
    proc = subprocess.Popen([sys.executable, "-u", "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    stamped = [(time.monotonic(), line.rstrip("\n")) for line in proc.stdout]
    assert proc.wait(timeout=900) == 0
    beats = [line for _, line in stamped if line.startswith("kvferry kernels: building kernels... ")]
    assert beats, [line for _, line in stamped]
    assert "gemm (native)" in beats[0] and " s" in beats[0]
    # Between the first line and the summary, no silence much longer than a
    # beat (generous: a busy 2-core machine delays a thread by seconds).
    times = [t for t, line in stamped if not line.startswith("kvferry kernels: summary")]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < 0.5 + 10, gaps
