"""Compile the C++ kernels into their cache now, all at once.

The engine builds each kernel on first use, before its core says ready.
Cold, on a slow 2-core CPU, the paged attention kernel alone takes over
3 minutes, and the four of them run one after another. ``make install``
runs this instead, once per machine and per source change: each kernel in
its own process, all in parallel. A cached kernel only loads (a few
seconds). A kernel that cannot be built (no compiler, a CPU it does not
fit) is reported, and the engine runs its fallback::

    python -m kvferry.model.build_kernels                    # this CPU's builds
    python -m kvferry.model.build_kernels --isa native avx2  # and the AVX2 ones tests compare against
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from kvferry import envs

# What loads each kernel, building it first where needed; prints True when it is usable.
_LOADERS = {
    "paged": "from kvferry.model import paged_kernel as k; print(k.get_paged_decode_kernel() is not None)",
    "fused": "from kvferry.model import fused_ops as k; print(k.fused_ops_available())",
    "gemm": "import torch; from kvferry.model import small_gemm as k; "
            "print(k.available(torch.float32) or k.available(torch.bfloat16))",
    "layer": "from kvferry.model import layer_op as k; print(k.available())",
}
ISAS = ("native", "avx2")


def build(isas: list[str], kernels: list[str], timeout_s: float) -> list[tuple[str, str, str]]:
    """Build each kernel for each ISA in parallel processes; returns
    (isa, kernel, "ok" | "unavailable" | "same build as native on this CPU" | "failed: ...")
    per build."""
    procs = []
    results = []
    if "native" in isas:
        from kvferry.model.paged_kernel import isa_is_native

        for isa in [i for i in isas if i != "native" and isa_is_native(i)]:
            isas = [i for i in isas if i != isa]
            results += [(isa, name, "same build as native on this CPU") for name in kernels]
    for isa in isas:
        env = {**os.environ, envs.KERNEL_ISA: isa, envs.DISABLE_CPP_KERNELS: "0"}
        for name in kernels:
            code = _LOADERS[name]
            procs.append((isa, name, subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    deadline = time.monotonic() + timeout_s
    for isa, name, proc in procs:
        try:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            results.append((isa, name, f"failed: not built within {timeout_s:.0f} s"))
            continue
        if proc.returncode != 0:
            results.append((isa, name, f"failed: {(err.strip().splitlines() or ['exit code %d' % proc.returncode])[-1]}"))
        else:
            results.append((isa, name, "ok" if out.strip().endswith("True") else "unavailable"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvferry.model.build_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", nargs="+", choices=ISAS, default=["native"],
                        help="builds to make: native (-march=native, what the engine loads) and/or avx2")
    parser.add_argument("--kernels", nargs="+", choices=list(_LOADERS), default=list(_LOADERS))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for all builds together")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    results = build(args.isa, args.kernels, args.timeout)
    for isa, name, status in results:
        print(f"kvferry kernels: {name} ({isa}): {status}")
    print(f"kvferry kernels: done in {time.monotonic() - t0:.0f} s")
    # Only a crash fails: without a compiler the engine runs its fallbacks.
    return 1 if any(status.startswith("failed") for *_, status in results) else 0


if __name__ == "__main__":
    sys.exit(main())
