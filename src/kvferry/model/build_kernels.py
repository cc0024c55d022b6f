"""Compile the C++ kernels into their cache now, all at once.

The engine builds each kernel on first use, before its core says ready.
Cold, on a slow 2-core CPU, the paged attention kernel alone takes over
3 minutes, and the four of them run one after another. ``make install``
runs this instead, once per machine and per source change: each kernel in
its own process, all in parallel. First one process per ISA loads every
kernel already in the cache (one torch import, not one a kernel: ``make
test`` runs this on every call, nearly always with nothing to build); only
the kernels it could not load get a process each. Each build prints a line
as it starts, with its typical time,
and one as it ends (a kernel already built: that one line), then a
summary. A kernel that cannot be built (no compiler, a CPU it does not
fit) is reported, and the engine runs its fallback::

    python -m kvferry.model.build_kernels                    # this CPU's builds
    python -m kvferry.model.build_kernels --isa native avx2  # and the AVX2 ones tests compare against
"""
from __future__ import annotations

import argparse
import json
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

# Run first, once per ISA (argv: the ISA, then the loaders as a dict's
# repr): loads each kernel whose libraries are all in the cache, builds none
# (a library not there raises in its loader, which then says False), and
# prints one _PROBED line per kernel: its name, True / False / error, the
# seconds since the start, the libraries missing so far, and the warning it
# logged (why it is unavailable). On a CPU where the ISA's build is the
# native one it prints _SAME and loads nothing.
_PROBE = """
import ast, contextlib, io, json, sys, time
t0 = time.monotonic()
from kvferry.model import paged_kernel as _pk
if sys.argv[1] != "native" and _pk.isa_is_native(sys.argv[1]):
    print("@kvferry-probe-same", flush=True)
    sys.exit(0)
_load_extension = _pk.load_extension
_missing = []
def _cached_only(name, build_dir, source, cflags, what):
    if (build_dir / f"{name}.so").exists() and not (build_dir / "lock").exists():
        return _load_extension(name, build_dir, source, cflags, what)
    _missing.append(name)
    raise RuntimeError(f"{name} is not in the cache")
_pk.load_extension = _cached_only
for kernel, code in ast.literal_eval(sys.argv[2]).items():
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(code, {})
        said = (out.getvalue().split() or ["error"])[-1]
    except Exception:
        said = "error"
    warnings = [line for line in err.getvalue().splitlines() if "unavailable, using" in line]
    print("@kvferry-probed", kernel, said, f"{time.monotonic() - t0:.1f}", len(_missing),
          json.dumps(warnings[-1] if warnings else ""), flush=True)
"""
_PROBED = "@kvferry-probed"
_SAME = "@kvferry-probe-same"
_PROBE_KERNEL = "*"  # a probe's _Child.kernel: it loads several


def _say(text: str) -> None:
    print(f"kvferry kernels: {text}", flush=True)


def _typical(kernel: str) -> str:
    low, high = TYPICAL_BUILD_S[kernel]
    return f"typically {low}-{high} s on 2 cores"


@dataclass
class _Probed:
    """What a probe said of one kernel."""
    said: str  # "True" (loaded), "False" (not usable) or "error"
    seconds: float  # since the probe started
    missing: int  # libraries not in the cache so far, in the probe
    warning: str  # the warning the kernel logged, if any


@dataclass
class _Child:
    isa: str
    kernel: str  # _PROBE_KERNEL for a probe
    proc: subprocess.Popen
    started: float
    kernels: tuple[str, ...] = ()  # a probe's kernels
    probed: dict[str, _Probed] = field(default_factory=dict)
    same: bool = False  # a probe found the ISA's build to be the native one
    build_started: float | None = None  # when it began compiling its own library (None: it only loaded)
    waited_for: str = ""  # another library it needed was being built first (the layer: the fused ops)
    last_line: str = ""
    stderr: list[str] = field(default_factory=list)
    stderr_reader: threading.Thread | None = None

    @property
    def label(self) -> str:
        if self.kernel == _PROBE_KERNEL:
            return ", ".join(f"{k} ({self.isa})" for k in self.kernels if k not in self.probed)
        return f"{self.kernel} ({self.isa})"


def _read(index: int, child: _Child, events: queue.Queue) -> None:
    """Forward a child's stdout lines as (index, line), then (index, None)."""
    for line in child.proc.stdout:
        events.put((index, line.rstrip("\n")))
    events.put((index, None))


def _on_probe_line(child: _Child, line: str) -> None:
    parts = line.split(" ", 5)  # the warning, last, is JSON: it may hold spaces
    if parts[0] == _SAME:
        child.same = True
    elif parts[0] == _PROBED and len(parts) == 6:
        _, kernel, said, seconds, missing, warning = parts
        child.probed[kernel] = _Probed(said, float(seconds), int(missing), json.loads(warning))
        if said == "True":
            _say(f"{kernel} ({child.isa}): already built, loaded in {float(seconds):.1f} s")
    else:
        child.last_line = line


def _on_line(child: _Child, line: str) -> None:
    if child.kernel == _PROBE_KERNEL:
        _on_probe_line(child, line)
        return
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
        if c.kernel == _PROBE_KERNEL:
            parts.append(f"{c.label} {now - c.started:.0f} s (loading from the cache)")
        elif c.build_started is not None:
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


def _spawn(isa: str, kernel: str, args: list[str], events: queue.Queue, children: list[_Child],
           kernels: tuple[str, ...] = ()) -> None:
    env = {**os.environ, envs.KERNEL_ISA: isa, envs.DISABLE_CPP_KERNELS: "0"}
    proc = subprocess.Popen([sys.executable, "-c", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child = _Child(isa, kernel, proc, time.monotonic(), kernels=kernels)
    children.append(child)
    threading.Thread(target=_read, args=(len(children) - 1, child, events), daemon=True).start()
    # Read apart from stdout: a full stderr pipe would block the child.
    child.stderr_reader = threading.Thread(target=lambda c=child: c.stderr.extend(c.proc.stderr), daemon=True)
    child.stderr_reader.start()


def _run(children: list[_Child], events: queue.Queue, deadline: float, timeout_s: float) -> dict[int, str]:
    """Until every child has ended or the deadline: forwards their lines,
    prints the heartbeat, kills what is left at the deadline; the status of
    each (a probe's: only whether it timed out or failed)."""
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
        if child.kernel != _PROBE_KERNEL:
            _say(_end_line(child, statuses[index]))
    for index in sorted(open_children):
        child = children[index]
        child.proc.kill()
        child.proc.wait()
        statuses[index] = _status(child, True, timeout_s)
        if child.kernel != _PROBE_KERNEL:
            _say(_end_line(child, statuses[index]))
    return statuses


def _after_probe(probe: _Child, status: str, kernels: list[str]) -> dict[str, str]:
    """The kernels a probe settled: {kernel: status}. The others are built,
    each in its own process. A kernel that loaded is settled; one that said
    False only where nothing was missing (a library not yet built makes the
    kernels that need it say False too) and the probe ended well."""
    if probe.same:
        return {k: "same build as native on this CPU" for k in kernels}
    if status.startswith("failed: not built within"):
        return {k: "ok" if k in probe.probed and probe.probed[k].said == "True" else status for k in kernels}
    missing = max((p.missing for p in probe.probed.values()), default=0)
    settled = {}
    for kernel, p in probe.probed.items():
        if p.said == "True":
            settled[kernel] = "ok"
        elif p.said == "False" and not missing and probe.proc.returncode == 0:
            settled[kernel] = f"unavailable: {p.warning}" if p.warning else "unavailable"
            _say(f"{kernel} ({probe.isa}): {settled[kernel]} (after {p.seconds:.0f} s)")
    return settled


def build(isas: list[str], kernels: list[str], timeout_s: float) -> list[tuple[str, str, str]]:
    """Build each kernel for each ISA in parallel processes; returns
    (isa, kernel, "ok" | "unavailable" | "same build as native on this CPU" | "failed: ...")
    per build. Prints a line as each build starts (with its typical time)
    and as each ends; a kernel already in the cache gets one line."""
    deadline = time.monotonic() + timeout_s
    events: queue.Queue = queue.Queue()
    probes: list[_Child] = []
    loaders = repr({name: _LOADERS[name] for name in kernels})
    for isa in isas:
        _spawn(isa, _PROBE_KERNEL, [_PROBE, isa, loaders], events, probes, kernels=tuple(kernels))
    probe_statuses = _run(probes, events, deadline, timeout_s)
    statuses: dict[tuple[str, str], str] = {}
    for index, probe in enumerate(probes):
        statuses.update({(probe.isa, k): status for k, status in
                         _after_probe(probe, probe_statuses[index], kernels).items()})
    children: list[_Child] = []
    events = queue.Queue()  # the probes' readers are done with theirs
    for isa in isas:
        for name in kernels:
            if (isa, name) not in statuses:
                _spawn(isa, name, [_REPORTER + _LOADERS[name]], events, children)
    built = _run(children, events, deadline, timeout_s)
    statuses.update({(child.isa, child.kernel): built[index] for index, child in enumerate(children)})
    return [(isa, name, statuses[(isa, name)]) for isa in isas for name in kernels]


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
