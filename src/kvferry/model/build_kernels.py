"""Compile the C++ kernels into their cache now, all at once.

The engine builds each kernel on first use, before its core says ready.
Cold, on a slow 2-core CPU, the paged attention kernel alone takes over
3 minutes, and the four of them run one after another. ``make install``
runs this instead, once per machine and per source change: each kernel in
its own process, all in parallel. A cached kernel only loads (a few
seconds). Each build prints a line as it starts, with its typical time,
and one as it ends (a kernel already built: that one line), then a
summary. A kernel that cannot be built (no compiler, a CPU it does not
fit) is reported, and the engine runs its fallback::

    python -m kvferry.model.build_kernels                    # this CPU's builds
    python -m kvferry.model.build_kernels --isa native avx2  # and the AVX2 ones tests compare against
"""
from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from kvferry import envs
from kvferry.model.build_progress import HEARTBEAT_S

# What loads each kernel, building it first where needed; prints True when it is usable.
_LOADERS = {
    "paged": "from kvferry.model import paged_kernel as k; print(k.get_paged_decode_kernel() is not None)",
    "fused": "from kvferry.model import fused_ops as k; print(k.fused_ops_available())",
    "gemm": "import torch; from kvferry.model import small_gemm as k; "
            "print(k.available(torch.float32) or k.available(torch.bfloat16))",
    "layer": "from kvferry.model import layer_op as k; print(k.available())",
    "quant": "from kvferry.model import quant as k; print(k.available())",
    "int8": "from kvferry.model import int8_gemm as k; print(k.available())",
    "moe": "from kvferry.model import moe_op as k; print(k.available())",
}
# The cache name prefix of each kernel's own library (the layer's child also
# builds or loads the fused ops it needs: those events are the fused child's).
_PREFIXES = {"paged": "kvferry_paged", "fused": "kvferry_fused", "gemm": "kvferry_gemm", "layer": "kvferry_layer",
            "quant": "kvferry_quant", "int8": "kvferry_int8", "moe": "kvferry_moe"}
# Seconds from a kernel's "building" line to its "built" line, measured cold
# on a slow, busy 2-core AVX-512 CPU: the low end built alone, the high end
# with all four compiling at once (what this module does). The layer starts
# once the fused ops it calls are built. Only the progress message uses them.
TYPICAL_BUILD_S = {"paged": (100, 300), "fused": (30, 120), "gemm": (30, 100), "layer": (25, 60), "quant": (15, 60),
                   "int8": (10, 60), "moe": (15, 60)}
ISAS = ("native", "avx2")

# Run in each child before its loader: says on stdout, as each library the
# kernel needs starts, whether it loads from the cache or builds (the test
# load_extension itself makes). It wraps paged_kernel.load_extension, which
# every kernel's loader calls by its module-global name.
_REPORTER = """
from kvferry.model import paged_kernel as _pk
_load_extension = _pk.load_extension
def _reported(name, build_dir, source, cflags, what):
    cached = (build_dir / f"{name}.so").exists() and not (build_dir / "lock").exists()
    print("@kvferry-kernel", "load" if cached else "build", name, flush=True)
    return _load_extension(name, build_dir, source, cflags, what)
_pk.load_extension = _reported
"""
_EVENT = "@kvferry-kernel"


def _say(text: str) -> None:
    print(f"kvferry kernels: {text}", flush=True)


def _typical(kernel: str) -> str:
    low, high = TYPICAL_BUILD_S[kernel]
    return f"typically {low}-{high} s on 2 cores"


@dataclass
class _Child:
    isa: str
    kernel: str
    proc: subprocess.Popen
    started: float
    build_started: float | None = None  # when it began compiling its own library (None: it only loaded)
    waited_for: str = ""  # another library it needed was being built first (the layer: the fused ops)
    last_line: str = ""
    stderr: list[str] = field(default_factory=list)
    stderr_reader: threading.Thread | None = None

    @property
    def label(self) -> str:
        return f"{self.kernel} ({self.isa})"


def _read(index: int, child: _Child, events: queue.Queue) -> None:
    """Forward a child's stdout lines as (index, line), then (index, None)."""
    for line in child.proc.stdout:
        events.put((index, line.rstrip("\n")))
    events.put((index, None))


def _on_line(child: _Child, line: str) -> None:
    parts = line.split()
    if len(parts) != 3 or parts[0] != _EVENT:
        child.last_line = line
        return
    _, how, name = parts
    if how != "build":
        return
    if name.startswith(_PREFIXES[child.kernel] + "_"):
        child.build_started = time.monotonic()
        _say(f"{child.label}: building ... {_typical(child.kernel)}")
    else:
        child.waited_for = name.rsplit("_", 1)[0]


def _status(child: _Child, timed_out: bool, timeout_s: float) -> str:
    if timed_out:
        return f"failed: not built within {timeout_s:.0f} s"
    errors = "".join(child.stderr).strip().splitlines()
    if child.proc.returncode != 0:
        return f"failed: {(errors or ['exit code %d' % child.proc.returncode])[-1]}"
    if child.last_line.strip().endswith("True"):
        return "ok"
    # A compile error is logged (a warning on stderr: "... unavailable, using
    # <fallback>: <error>", then the compiler's output) and the kernel
    # reported unusable; a CPU the kernel does not fit says nothing.
    why = [line for line in errors if "unavailable, using" in line] or errors
    return f"unavailable: {why[-1]}" if why else "unavailable"


def _still_running(open_children: list[_Child]) -> str:
    now = time.monotonic()
    parts = []
    for c in open_children:
        if c.build_started is not None:
            parts.append(f"{c.label} {now - c.build_started:.0f} s")
        elif c.waited_for:  # the layer, while the fused ops it calls build
            parts.append(f"{c.label} {now - c.started:.0f} s (waiting for the {c.waited_for} build)")
        else:
            parts.append(f"{c.label} {now - c.started:.0f} s (starting or loading)")
    return "building kernels... " + ", ".join(parts)


def _end_line(child: _Child, status: str) -> str:
    now = time.monotonic()
    if status != "ok":
        return f"{child.label}: {status} (after {now - child.started:.0f} s)"
    if child.build_started is not None:
        return f"{child.label}: built in {now - child.build_started:.0f} s"
    waited = f", after the {child.waited_for} build it needs" if child.waited_for else ""
    return f"{child.label}: already built, loaded in {now - child.started:.1f} s{waited}"


def build(isas: list[str], kernels: list[str], timeout_s: float) -> list[tuple[str, str, str]]:
    """Build each kernel for each ISA in parallel processes; returns
    (isa, kernel, "ok" | "unavailable" | "same build as native on this CPU" | "failed: ...")
    per build. Prints a line as each build starts (with its typical time)
    and as each ends; a kernel already in the cache gets one line."""
    results = []
    if "native" in isas:
        from kvferry.model.paged_kernel import isa_is_native

        for isa in [i for i in isas if i != "native" and isa_is_native(i)]:
            isas = [i for i in isas if i != isa]
            results += [(isa, name, "same build as native on this CPU") for name in kernels]
    children: list[_Child] = []
    events: queue.Queue = queue.Queue()
    for isa in isas:
        env = {**os.environ, envs.KERNEL_ISA: isa, envs.DISABLE_CPP_KERNELS: "0"}
        for name in kernels:
            proc = subprocess.Popen([sys.executable, "-c", _REPORTER + _LOADERS[name]], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            child = _Child(isa, name, proc, time.monotonic())
            children.append(child)
            threading.Thread(target=_read, args=(len(children) - 1, child, events), daemon=True).start()
            # Read apart from stdout: a full stderr pipe would block the child.
            child.stderr_reader = threading.Thread(target=lambda c=child: c.stderr.extend(c.proc.stderr), daemon=True)
            child.stderr_reader.start()
    deadline = time.monotonic() + timeout_s
    open_children = set(range(len(children)))
    statuses: dict[int, str] = {}
    next_beat = time.monotonic() + HEARTBEAT_S
    while open_children and time.monotonic() < deadline:
        if time.monotonic() >= next_beat:
            # The compiler says nothing until it ends: a line now and then, so that the set-up does not look hung.
            next_beat = time.monotonic() + HEARTBEAT_S
            _say(_still_running([children[i] for i in sorted(open_children)]))
        try:
            index, line = events.get(timeout=max(min(deadline, next_beat) - time.monotonic(), 0.01))
        except queue.Empty:
            continue  # a heartbeat is due, or the deadline has passed (the loop's test)
        if line is not None:
            _on_line(children[index], line)
            continue
        open_children.discard(index)
        child = children[index]
        child.proc.wait()
        child.stderr_reader.join(timeout=5.0)
        statuses[index] = _status(child, False, timeout_s)
        _say(_end_line(child, statuses[index]))
    for index in sorted(open_children):
        child = children[index]
        child.proc.kill()
        child.proc.wait()
        statuses[index] = _status(child, True, timeout_s)
        _say(_end_line(child, statuses[index]))
    # In launch order, as before: the summary reads kernel by kernel.
    results += [(c.isa, c.kernel, statuses[i]) for i, c in enumerate(children)]
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
    _say(f"compiling or loading {', '.join(args.kernels)} for {' and '.join(args.isa)}, all at once on "
         f"{os.cpu_count()} cores (a kernel already in {envs.cache_dir() / 'torch_ext'} only loads)")
    results = build(args.isa, args.kernels, args.timeout)
    _say("summary:")
    for isa, name, status in results:
        _say(f"{name} ({isa}): {status}")
    _say(f"done in {time.monotonic() - t0:.0f} s")
    # Only a crash fails: without a compiler the engine runs its fallbacks.
    return 1 if any(status.startswith("failed") for *_, status in results) else 0


if __name__ == "__main__":
    sys.exit(main())
