"""A GGUF file's blocks held as views of the mapped file (4 KiB pages)
against read into huge pages (2 MiB), ``KVFERRY_GGUF_WEIGHTS`` (model/gguf_memory.py).

Default: the file is loaded both ways into this one process, and a batch-1
decode step's matmuls (every layer's qkv, o, gate/up and down calls, as
the one-call decoder layer makes them, then the lm_head: one bf16 row of
x) run over each model's own blocks, alternating mapped and huge pages
``--pairs`` times: both halves of a pair see about the same load, which
separate processes do not. Reported: medians of the CPU time of all
threads (``time.process_time``) and wall time, and the median of each
pair's ratio (huge / mapped). Also the embedding's look-up of one row.

``--load N``: N fresh processes each way, alternating, that only load the
model (load_model + pack_weights, no step): the load's wall and CPU time,
the process's peak RSS (VmHWM) and what it holds after (RSS, anonymous,
of which on transparent huge pages), in MB.

    PYTHONPATH=src python bench/gguf_blocks_memory.py FILE.gguf [--threads 1 2] [--pairs 41] [--load 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("mapped", "huge-pages")


def load(path: str, mode: str):  # -> LlamaModel
    from kvferry.model.loader import load_model

    os.environ["KVFERRY_GGUF_WEIGHTS"] = mode
    m = load_model(path, dtype="bfloat16", quantization="gguf").model
    m.pack_weights()
    return m


def step_calls(model) -> list[tuple[list, list, int]]:
    """(blocks, ggml types, K) of each matmul of a decode step, in its order."""
    calls = []
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            ws = lin.qweights
            calls.append(([w.data for w in ws], [w.fmt.ggml_type for w in ws], lin.in_features))
    head = model.logits_proj.qweights
    calls.append(([w.data for w in head], [w.fmt.ggml_type for w in head], model.logits_proj.in_features))
    return calls


def ab(path: str, threads: list[int], pairs: int) -> None:
    import torch

    models = {mode: load(path, mode) for mode in MODES}
    calls = {mode: step_calls(m) for mode, m in models.items()}
    for a, b in zip(*calls.values()):  # the same bytes both ways
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    op = torch.ops.kvferry_quant.layer_linear_parts
    xs = {k: torch.randn(1, k).bfloat16() for k in {c[2] for c in calls["mapped"]}}
    ids = torch.tensor([1234])

    def one(sel) -> tuple[float, float, float]:
        """(CPU ms, wall ms, of the CPU ms the lm_head's)."""
        c0, w0 = time.process_time(), time.perf_counter()
        for ws, ts, k in sel[:-1]:
            op(xs[k], ws, ts)
        c1 = time.process_time()
        ws, ts, k = sel[-1]
        op(xs[k], ws, ts)
        c2 = time.process_time()
        return (c2 - c0) * 1e3, (time.perf_counter() - w0) * 1e3, (c2 - c1) * 1e3

    def embed(m) -> float:  # a step's look-up: one row, a fresh one each time (cold)
        c0 = time.process_time()
        for i in range(200):
            m.embed(ids + 97 * i)
        return (time.process_time() - c0) / 200 * 1e6

    nbytes = sum(w.numel() for ws, _, _ in calls["mapped"] for w in ws)
    for n in threads:
        torch.set_num_threads(n)
        for mode in MODES:  # warm: code, the mapped file's pages in
            one(calls[mode])
        got: dict[str, list] = {mode: [] for mode in MODES}
        for i in range(pairs):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):  # each goes first half the time
                got[mode].append(one(calls[mode]))
        with open("/proc/loadavg") as f:
            loadavg = " ".join(f.read().split()[:3])
        cells = [f"{mode} CPU {statistics.median(r[0] for r in got[mode]):.2f} (lm_head "
                 f"{statistics.median(r[2] for r in got[mode]):.2f}) / wall "
                 f"{statistics.median(r[1] for r in got[mode]):.2f}" for mode in MODES]
        ratio = [statistics.median(h[i] / m[i] for m, h in zip(got["mapped"], got["huge-pages"])) for i in range(3)]
        print(f"{n} thread(s), all matmuls of a step ({nbytes / 2**20:.0f} MiB), median ms of {pairs} pairs: "
              + " | ".join(cells) + f" | huge / mapped, pairs' median: CPU {ratio[0]:.3f}x (lm_head "
              f"{ratio[2]:.3f}x), wall {ratio[1]:.3f}x | load {loadavg}", flush=True)
    torch.set_num_threads(1)
    print("token embedding, one row a look-up, CPU us: " + " | ".join(
        f"{mode} {embed(models[mode]):.1f} (a {type(models[mode].embed.qweight.data.untyped_storage()).__name__} of "
        f"{models[mode].embed.qweight.data.untyped_storage().nbytes() / 1e6:.0f} MB)" for mode in MODES))


def load_once(path: str, mode: str) -> dict:
    def status() -> dict:
        out = {}
        for line in open("/proc/self/status"):
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "VmHWM"):
                out[k] = int(v.split()[0]) / 1024
        return out

    import torch  # noqa: F401 - its import is not the load's
    from kvferry.model import loader  # noqa: F401

    before = status()
    c0, w0 = time.process_time(), time.perf_counter()
    model = load(path, mode)  # held while measured: the slab is freed with it
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    after = status()
    huge = sum(int(line.split()[1]) for line in open("/proc/self/smaps") if line.startswith("AnonHugePages:")) / 1024
    del model
    return {"wall": wall, "cpu": cpu, "peak": after["VmHWM"], "rss": after["VmRSS"],
            "anon_added": after["RssAnon"] - before["RssAnon"], "huge": huge, "rss_before": before["VmRSS"]}


def fresh_process_loads(script: str, path: str, ways: tuple[str, ...], n: int) -> dict[str, dict[str, float]]:
    """Each way's medians over ``n`` loads, each in a fresh process
    (``script PATH --load-once WAY``, whose last stdout line is its JSON
    record), the ways' order alternating from one round to the next."""
    got: dict[str, list] = {way: [] for way in ways}
    for i in range(n):
        for way in (ways if i % 2 == 0 else ways[::-1]):
            out = subprocess.run([sys.executable, script, path, "--load-once", way], capture_output=True,
                                 text=True, check=True).stdout
            got[way].append(json.loads(out.strip().splitlines()[-1]))
    return {way: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for way, runs in got.items()}


def loads(path: str, n: int) -> None:
    medians = fresh_process_loads(__file__, path, MODES, n)
    print(f"file {os.path.getsize(path) / 1e6:.0f} MB; medians of {n} loads each (MB, s):")
    for mode, med in medians.items():
        print(f"  {mode:10s} load wall {med['wall']:.2f} s, CPU {med['cpu']:.2f} s | RSS before {med['rss_before']:.0f}, "
              f"peak {med['peak']:.0f}, after {med['rss']:.0f}, anonymous added {med['anon_added']:.0f} "
              f"(on huge pages {med['huge']:.0f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--pairs", type=int, default=41)
    ap.add_argument("--load", type=int, default=0, metavar="N")
    ap.add_argument("--load-once", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_once:
        print(json.dumps(load_once(args.model, args.load_once)))
    elif args.load:
        loads(args.model, args.load)
    else:
        ab(args.model, args.threads, args.pairs)


if __name__ == "__main__":
    main()
