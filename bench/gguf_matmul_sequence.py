"""A batch-1 decode step's GGUF matmuls alone, in the step's order, against
the weight-read floor of their bytes.

Random blocks (tests/model/quant/blocks.py) in the shapes and types of a
model's linear layers, each weight its own memory, called as the one-call
decoder layer calls them (``kvferry_quant::layer_linear_parts``: q/k/v and
gate/up as parts of one call), layer after layer, then the lm_head; one row
of bf16 x. What ``bench/gguf_decode_step.py`` times around them (attention,
norms, the runner's Python) is left out, so this isolates the kernels' cold
streaming. Also one layer's calls repeated (``hot``: in the caches).

* ``q41``: the embedded SmolLM2-135M Q4_1 file (30 layers, hidden 576, its
  lm_head Q8_0);
* ``1b``: ``bench/make_random_gguf.py``'s 1B-shaped Q4_K_M mix (16 layers,
  hidden 2048, ffn 8192, v and down in Q6_K on llama.cpp's layers, lm_head Q6_K);
* ``8b``: the 8B-shaped Q4_K_M mix (hidden 4096, kv 1024, ffn 14336; v and
  down in Q6_K on llama.cpp's layers), ``--layers`` of its 32 spread evenly
  (default 4: half of them Q6_K's, as in the file), its lm_head with ``--head``.

``--threads 1`` (the default) reports the calling thread's CPU time, which
other processes on a shared machine inflate least; the floor's bandwidth is
gguf_decode_step.py's (a cold 512 MiB sum, same thread count). Not a test.

    PYTHONPATH=src python bench/gguf_matmul_sequence.py [q41|1b] [--repeats 9] [--threads 1]

``--rows 1 8 12 16 24 32`` times the step's matmuls at each batch size (x
of that many rows) instead, and ``--ab 12,16`` alternates, in this one
process, the step with the library's configured paths against the same step
with the dots taking batches only below 12 rows of 32-blocks and 16 rows of
K-quants (the dequantized bf16 tiles above, ``kernels.PREFILL_DOTS`` off;
``--ab 33,33``: the dots up to 32 rows), or ``--ab-panels 33,33`` against
the prefill dots' panels from 33 rows (the decode kernels below): both halves of each pair see
about the same load, which separate processes do not. Medians of ``--repeats``
pairs, the CPU time of all threads (``time.process_time``) and wall time.
``--ab-packed`` alternates the configured step with the same step over the
Q4_K / Q6_K weights' panels packed at load (quant/panels.py, the same bits),
and ``--bf16`` adds the step over the dequantized weights in bf16 through
small_gemm (``--quantization none``'s path; q/k/v and gate/up one weight each).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.model.quant.blocks, bench
from bench.gguf_decode_step import read_bandwidth_gbs  # noqa: E402
from bench.make_random_gguf import more_bits  # noqa: E402
from kvferry.model import quant, small_gemm  # noqa: E402
from tests.model.quant.blocks import random_blocks  # noqa: E402

TYPES = {"Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


def model_calls(which: str) -> list[list[tuple[str, int, int]]]:
    """Each call's parts (type, rows, K), in the step's order."""
    if which == "q41":
        layer = [[("Q4_1", 576, 576), ("Q4_1", 192, 576), ("Q4_1", 192, 576)], [("Q4_1", 576, 576)],
                 [("Q4_1", 1536, 576), ("Q4_1", 1536, 576)], [("Q4_1", 576, 1536)]]
        return layer * 30 + [[("Q8_0", 49152, 576)]]
    calls = []
    for i in range(16):
        hi = "Q6_K" if more_bits(i, 16) else "Q4_K"
        calls += [[("Q4_K", 2048, 2048), ("Q4_K", 512, 2048), (hi, 512, 2048)], [("Q4_K", 2048, 2048)],
                  [("Q4_K", 8192, 2048), ("Q4_K", 8192, 2048)], [(hi, 2048, 8192)]]
    return calls + [[("Q6_K", 49152, 2048)]]


def calls_8b(layers: int, head: bool) -> list[list[tuple[str, int, int]]]:
    """``layers`` of the 8B mix's 32, spread evenly, and its lm_head where ``head``."""
    calls = []
    for i in (j * 32 // layers for j in range(layers)):
        hi = "Q6_K" if more_bits(i, 32) else "Q4_K"
        calls += [[("Q4_K", 4096, 4096), ("Q4_K", 1024, 4096), (hi, 1024, 4096)], [("Q4_K", 4096, 4096)],
                  [("Q4_K", 14336, 4096), ("Q4_K", 14336, 4096)], [(hi, 4096, 14336)]]
    return calls + ([[("Q6_K", 128256, 4096)]] if head else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="q41", choices=["q41", "1b", "8b"])
    ap.add_argument("--layers", type=int, default=4, help="8b: how many of its 32 layers")
    ap.add_argument("--head", action="store_true", help="8b: with its lm_head")
    ap.add_argument("--ab-packed", action="store_true",
                    help="alternate the configured step with the same step over packed panels (quant/panels.py)")
    ap.add_argument("--bf16", action="store_true", help="with --rows: also the step in bf16 through small_gemm")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="batch sizes to time (default: 1, and the hot layer)")
    ap.add_argument("--ab", default=None, metavar="M32,MK",
                    help="alternate the configured paths with the dots below M32 rows (32-blocks) and MK (K-quants)")
    ap.add_argument("--ab-panels", default=None, metavar="M32,MK",
                    help="alternate the configured paths with the prefill dots' panels from M32 rows (32-blocks) "
                         "and MK (K-quants), the decode kernels below (33,33: the routing before they moved to 6,12)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not quant.available():
        sys.exit("the C++ quantized matmul is unavailable here")
    bw = read_bandwidth_gbs(args.threads)
    rng = np.random.default_rng(0)
    made: dict[tuple, torch.Tensor] = {}

    def blocks(t: str, n: int, k: int) -> torch.Tensor:
        if (t, n, k) not in made:
            made[(t, n, k)] = torch.from_numpy(random_blocks(t, n, k, rng))
        return made[(t, n, k)].clone()  # every use its own memory, as a model's weights

    shapes = calls_8b(args.layers, args.head) if args.model == "8b" else model_calls(args.model)
    calls = [([blocks(*p) for p in parts], [TYPES[p[0]] for p in parts], parts[0][2]) for parts in shapes]
    if args.rows:
        return rows_ab(calls, args)
    xs = {k: torch.randn(1, k).bfloat16() for k in {c[2] for c in calls}}
    op = torch.ops.kvferry_quant.layer_linear_parts
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    def timed(sel, repeats: int) -> list[float]:
        out = []
        for _ in range(repeats):
            t0 = clock()
            for ws, ts, k in sel:
                op(xs[k], ws, ts)
            out.append(clock() - t0)
        return out

    timed(calls, 1)  # warm: the code, and each thread's order of the calls
    nbytes = sum(w.numel() for ws, _, _ in calls for w in ws)
    floor_ms = nbytes / (bw * 1e9) * 1e3
    step = timed(calls, args.repeats)
    layers = timed(calls[:-1], args.repeats)
    head = timed(calls[-1:], args.repeats)
    hot = timed(calls[:4], 200)
    hot_bytes = sum(w.numel() for ws, _, _ in calls[:4] for w in ws)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    med = {k: statistics.median(v) * 1e3 for k, v in (("step", step), ("layers", layers), ("head", head))}
    print(f"{args.model}: {nbytes / 2**20:.1f} MiB, read bandwidth {bw:.1f} GB/s, floor {floor_ms:.2f} ms, "
          f"{args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time, load {load}")
    print(f"median ms: all matmuls {med['step']:.2f} (min {min(step) * 1e3:.2f}) = {med['step'] / floor_ms:.2f}x "
          f"the floor | layers {med['layers']:.2f} | lm_head {med['head']:.2f} | one layer hot "
          f"{statistics.median(hot) * 1e3:.3f} ms ({hot_bytes / statistics.median(hot) / 1e9:.1f} GB/s)")


def rows_ab(calls: list, args: argparse.Namespace) -> None:
    """The step's matmuls at each of ``args.rows`` batch sizes: CPU and wall ms,
    and with ``--ab`` the same against the given thresholds, pair by pair."""
    from kvferry.model.quant import kernels

    op = torch.ops.kvferry_quant.layer_linear_parts
    configured = (dict(kernels.PREFILL_MIN_ROWS), kernels.PREFILL_DOTS, dict(kernels.PREFILL_DOTS_FROM_ROWS))
    configs = {"configured": configured}
    if args.ab and args.ab_panels:
        sys.exit("--ab or --ab-panels, not both")
    if args.ab:
        m32, mk = (int(v) for v in args.ab.split(","))
        configs["ab"] = ({32: m32, 256: mk}, False, configured[2])  # the prefill dots off: tiles from mk rows
    if args.ab_panels:
        m32, mk = (int(v) for v in args.ab_panels.split(","))
        configs["ab"] = (configured[0], configured[1], {32: m32, 256: mk})

    ops = torch.ops.kvferry_quant
    packs: list[tuple[torch.Tensor, int, torch.Tensor]] = []  # (blocks, type, panels)
    handles: list[int] = []
    if args.ab_packed:  # packed once; registered for the packed step only (the library finds them by address)
        for ws, ts, k in calls:
            for w, t in zip(ws, ts):
                n = int(ops.packed_panel_bytes(t, w.shape[0], k))
                if n:
                    p = torch.empty(n, dtype=torch.uint8)
                    ops.pack_panels_into(w, t, p)
                    packs.append((w, t, p))
        configs["packed"] = configured
    dense = []
    if args.bf16:
        if not small_gemm.available(torch.bfloat16):
            sys.exit("--bf16: small_gemm is unavailable here")
        for ws, ts, k in calls:
            d = torch.cat([ops.dequant(w, t, k).bfloat16() for w, t in zip(ws, ts)])
            dense.append((small_gemm.pack(d), d.shape[0], k))
        configs["bf16"] = configured

    def use(name: str, config: tuple) -> None:
        kernels.PREFILL_MIN_ROWS, kernels.PREFILL_DOTS, kernels.PREFILL_DOTS_FROM_ROWS = config
        kernels.configure()
        while handles:
            ops.unregister_panels(handles.pop())
        if name == "packed":
            handles.extend(ops.register_panels(w, t, p) for w, t, p in packs)

    def one_step(name: str, xs: dict) -> tuple[float, float]:
        c0, w0 = time.process_time(), time.perf_counter()
        if name == "bf16":
            for w, n, k in dense:
                small_gemm.linear(xs[k], w, n)
        else:
            for ws, ts, k in calls:
                op(xs[k], ws, ts)
        return (time.process_time() - c0) * 1e3, (time.perf_counter() - w0) * 1e3

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"{args.model}: {args.threads} thread(s), all matmuls of a step, median ms of {args.repeats} "
          f"(CPU of all threads / wall), load {load}; configured {configured[0]}, K-quants' prefill dots "
          f"{kernels.prefill_dots_fit() if configured[1] is None else configured[1]}" +
          (f", ab {configs['ab']}" if "ab" in configs else ""))
    try:
        for m in args.rows:
            xs = {k: torch.randn(m, k).bfloat16() for k in {c[2] for c in calls}}
            got: dict[str, list] = {name: [] for name in configs}
            for name, config in configs.items():  # warm each path
                use(name, config)
                one_step(name, xs)
            for _ in range(args.repeats):
                for name, config in configs.items():
                    use(name, config)
                    got[name].append(one_step(name, xs))
            cells = []
            for name, runs in got.items():
                cpu, wall = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
                cells.append(f"{name} {cpu:7.1f} / {wall:7.1f}")
            ratio = ""
            for other in ("ab", "packed", "bf16"):
                if other in configs:
                    pairs = [b[0] / a[0] for a, b in zip(got["configured"], got[other])]
                    ratio += f" | {other} / configured CPU {statistics.median(pairs):.2f}x"
            if "packed" in configs and "bf16" in configs:
                pairs = [b[0] / a[0] for a, b in zip(got["bf16"], got["packed"])]
                ratio += f" | packed / bf16 CPU {statistics.median(pairs):.2f}x"
            print(f"rows {m:3d}: " + " | ".join(cells) + ratio, flush=True)
    finally:
        use("configured", configured)


if __name__ == "__main__":
    main()
