"""``kvferry profile --tensor-parallel-sizes 1,2 --pipeline-parallel-sizes 1,2``:
the step fits at each parallel layout this host can run.

A layout is a (TP, PP) pair: one engine core as ``TP x PP`` rank processes
(docs/parallelism.md). Each is measured as ``run_profile`` measures one
core, on the same CPU budget (``--threads``, default torch's threads: this
host's cores), split evenly: ``threads per rank = budget // ranks``. So the
fits compare layouts on the same host, and a layout's fit already holds what
it overlaps (the pipeline's micro-batches) and what it adds (all-reduces,
the stage hops): the planner uses each fit as that layout's step time.

A layout that cannot run is skipped with one line saying why: more ranks
than CPUs, or the engine refusing it (heads or layers that do not split,
a device the ranks cannot use): the engine's own one-line ``ValueError``.
TP x PP layouts run as one core of both (docs/parallelism.md).

The profile JSON keeps the first measured layout's fits at its top level
(what older readers and the plot read) and every layout under ``layouts``;
``layouts_of`` reads a profile written before layouts as TP 1 PP 1.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvferry.bench.profile import ProfileGrid, plot_profile, run_profile
# layouts_of lives with the step model, which the planner reads without the engine
from kvferry.bench.step_cost import layouts_of  # noqa: F401
from kvferry.bench.workloads import BenchError


@dataclass(frozen=True, slots=True)
class Layout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @property
    def ranks(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def name(self) -> str:
        return f"tp{self.tensor_parallel_size}pp{self.pipeline_parallel_size}"


def _sizes(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise BenchError(f"{flag}: expected integers >= 1 separated by commas, got {text!r}")
    return sorted(set(values))


def parse_layouts(tp_text: str, pp_text: str) -> list[Layout]:
    """Every (TP, PP) of the two comma lists, fewest ranks first (TP 1 PP 1
    leads when asked for: the reference the planner prices the others by)."""
    tps = _sizes(tp_text, "--tensor-parallel-sizes")
    pps = _sizes(pp_text, "--pipeline-parallel-sizes")
    return sorted((Layout(t, p) for t in tps for p in pps),
                  key=lambda lay: (lay.ranks, lay.tensor_parallel_size))


def run_layout_profiles(make_engine: Callable[[Layout, int], object], grid: ProfileGrid, layouts: list[Layout],
                        cpus: int, on_point=lambda kind, p: None,
                        say: Callable[[str], None] = print) -> tuple[list[dict], list[dict]]:
    """Profile each layout on ``cpus`` threads in all (``make_engine(layout,
    threads_per_rank)`` builds its engine; closed after). Returns (measured
    layouts' entries, skipped layouts with the reason), each skip said once."""
    measured: list[dict] = []
    skipped: list[dict] = []

    def skip(layout: Layout, reason: str) -> None:
        skipped.append({"name": layout.name, "tensor_parallel_size": layout.tensor_parallel_size,
                        "pipeline_parallel_size": layout.pipeline_parallel_size, "reason": reason})
        say(f"kvferry profile: skipping {layout.name}: {reason}")

    for layout in layouts:
        threads = cpus // layout.ranks
        if threads < 1:
            skip(layout, f"{layout.ranks} ranks need at least {layout.ranks} CPUs; the budget is {cpus} "
                         "(--threads, default this host's cores)")
            continue
        try:
            engine = make_engine(layout, threads)
        except ValueError as e:  # the engine's one-line refusal: heads/layers that do not split
            skip(layout, str(e).splitlines()[0] if str(e) else type(e).__name__)
            continue
        say(f"kvferry profile: {layout.name}: {layout.ranks} rank(s) of {threads} thread(s)")
        try:
            result = run_profile(engine, grid, on_point)
        finally:
            engine.core.close()
        measured.append({"name": layout.name, "tensor_parallel_size": layout.tensor_parallel_size,
                         "pipeline_parallel_size": layout.pipeline_parallel_size, "ranks": layout.ranks,
                         "threads_per_rank": threads, "cpus": threads * layout.ranks, **result})
    return measured, skipped


def _fit_text(f: dict) -> str:
    terms = " + ".join(f"{c * 1e6:.3g} us*{t}" if t != "1" else f"{c * 1e6:.3g} us"
                       for t, c in zip(f["terms"], f["coef"]))
    return f"t = {terms} (R^2 {f['r2']:.3f})"


def layout_summary(measured: list[dict], skipped: list[dict]) -> list[str]:
    """One line per fit of each measured layout, one per skipped layout (the
    profile's closing lines, so that the layouts are seen side by side)."""
    lines = []
    for lay in measured:
        head = f"{lay['name']} ({lay['ranks']} rank(s) x {lay['threads_per_rank']} thread(s))"
        lines += [f"{head} {kind} fit: {_fit_text(lay[kind]['fit'])}" for kind in ("prefill", "decode")]
    lines += [f"{s['name']} skipped: {s['reason']}" for s in skipped]
    return lines


def plot_layouts(measured: list[dict], title: str, png) -> list:
    """Each layout's fits as ``PROFILE.NAME.png`` beside the profile's plot
    (which shows the first layout); none for a profile of one layout."""
    if len(measured) < 2:
        return []
    paths = []
    for lay in measured:
        path = png.with_name(f"{png.stem}.{lay['name']}.png")
        plot_profile(lay, f"{title} {lay['name']}", path)
        paths.append(path)
    return paths
