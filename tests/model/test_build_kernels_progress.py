"""``python -m kvferry.model.build_kernels`` says what it is doing: per
kernel, a line as a build starts (with its typical time) and one as it
ends; a kernel already in the cache gets one line. Run against the user's
cache, which ``make test`` has filled: the one-line path is the usual one
here, the two-line one is accepted where a kernel source changed."""
from __future__ import annotations

import subprocess
import sys

KERNELS = ("gemm", "fused")


def test_one_line_per_cached_kernel_two_per_build_then_a_summary():
    done = subprocess.run([sys.executable, "-m", "kvferry.model.build_kernels", "--kernels", *KERNELS],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("kvferry kernels: compiling or loading gemm, fused for native")
    for kernel in KERNELS:
        label = f"kvferry kernels: {kernel} (native): "
        mine = [line[len(label):] for line in lines if line.startswith(label)]
        progress, summary = mine[:-1], mine[-1]
        assert summary == "ok", lines
        if progress[0].startswith("building ... typically "):
            assert len(progress) == 2 and progress[1].startswith("built in "), lines
        else:
            assert len(progress) == 1 and progress[0].startswith("already built, loaded in "), lines
    assert "kvferry kernels: summary:" in lines and lines[-1].startswith("kvferry kernels: done in ")
