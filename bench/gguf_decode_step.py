"""Where a batch-1 decode step of a GGUF file's blocks (``--quantization gguf``)
spends its time, against the weight-read floor of its quantized bytes.

One request (a short prompt, ``--output-len`` greedy tokens, ignore_eos)
through the offline engine; per decode step: the runner, the model's
forward (the decoder layers), the logits (lm_head) and the rest of the
runner (inputs, sampling), the median over the steps. With ``--threads 1``
these are the stepping thread's CPU time (``time.thread_time``), which other
processes on a shared machine inflate least; with more, wall time. The
floor is the bytes of the weights a step reads (every linear layer's blocks,
the lm_head's and one embedding row) over the machine's read bandwidth,
measured here by summing a cold buffer larger than the caches with the same
thread count (``--bandwidth-gbs`` to give it instead).

    python bench/gguf_decode_step.py [--model FILE.gguf] [--threads 2] [--output-len 64] [--profile] [--ab-runs N] [--ab-workspace N]

``--profile`` adds torch.profiler's table of one step's ops (self CPU time).
``--ab-runs N`` then alternates, in this one process, N runs of the step as
it is (every layer in one C++ call, the greedy shortcut) with N runs of the
step as it was before them (a Python call per layer, the general sampler),
and checks that both give the same tokens: on a loaded machine the two
halves of each pair see about the same load, which separate processes do not.
``--ab-workspace N`` alternates the same way the layer stack's step in its
reused buffers with each layer allocating its outputs and views (as before).
``--ab-prefill N`` alternates the same way N prefills of a ``--prefill-tokens``
(512) token prompt (random token ids, a fresh prompt each run: no prefix-cache
hit) with the K-quants' prefill dots as the CPU decides
(``quant.kernels.PREFILL_DOTS``: on a CPU without AMX, the integer dots) and
off (the bf16 tiles): the process's CPU time (all threads) and the runner's
time per prefill, and prompt tokens per second of each.
On a shared machine report the load average printed with the figures.
"""
from __future__ import annotations

import argparse
import statistics
import time


def read_bandwidth_gbs(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Read bandwidth of ``threads`` threads over a buffer far larger than the
    caches (the best of ``repeats`` passes): a sum of int64, so each byte is
    read once and the compute is trivial."""
    import torch

    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter  # as the step's figures
    buf = torch.ones(mib << 17, dtype=torch.int64)  # mib MiB
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        buf.sum()
        best = min(best, clock() - t0)
    return buf.numel() * 8 / best / 1e9


def weight_bytes(model) -> tuple[int, int]:
    """(bytes a decode step reads from the linear layers' and lm_head's weights, of which the lm_head)."""
    lm = model.logits_proj.method.nbytes(model.logits_proj)
    total = sum(lin.method.nbytes(lin) for lin in model.linears())
    return total, lm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded Q4_1 file)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--bandwidth-gbs", type=float, default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ab-runs", type=int, default=0)
    ap.add_argument("--ab-workspace", type=int, default=0)
    ap.add_argument("--ab-prefill", type=int, default=0)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    args = ap.parse_args()

    import torch

    from kvferry import LLM, SamplingParams
    from kvferry.engine import runner
    from kvferry.model import llama
    from kvferry.model.gguf_convert import embedded_gguf_path

    torch.set_num_threads(args.threads)
    bw = args.bandwidth_gbs or read_bandwidth_gbs(args.threads)
    model_path = args.model or str(embedded_gguf_path())
    llm = LLM(model=model_path, quantization=args.quantization, dtype=args.dtype, max_num_seqs=4,
              kv_cache_memory_gb=0.25)

    clock = time.thread_time if args.threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {"execute": [], "forward": [], "logits": []}
    execute, forward, logits = runner.ModelRunner.execute, llama.LlamaModel.forward, llama.LlamaModel.compute_logits
    holder = {}

    def timed(name, fn):
        def wrapper(self, *a, **k):
            holder["model"] = self if name != "execute" else holder.get("model")
            t0 = clock()
            out = fn(self, *a, **k)
            times[name].append(clock() - t0)
            return out
        return wrapper

    runner.ModelRunner.execute = timed("execute", execute)
    llama.LlamaModel.forward = timed("forward", forward)
    llama.LlamaModel.compute_logits = timed("logits", logits)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompt = "The river carried old stories past the mill while the town slept"
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    for v in times.values():
        v.clear()
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    wall = time.perf_counter() - t0
    steps = len(out.token_ids)
    # The first step is the prefill: drop it from the decode figures.
    dec = {k: v[1:] for k, v in times.items()}
    med = {k: 1e3 * statistics.median(v) for k, v in dec.items()}
    total, lm = weight_bytes(holder["model"])
    floor_ms = total / (bw * 1e9) * 1e3
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    layer_op = holder["model"]._layer_args is not None
    print(f"model {model_path}, {args.quantization}, {args.dtype}, {args.threads} threads, load {load}, "
          f"one-call layer {'on' if layer_op else 'off'}, {'CPU' if args.threads == 1 else 'wall'} time")
    print(f"weights read per step {total / 2**20:.1f} MiB (lm_head {lm / 2**20:.1f}), read bandwidth {bw:.1f} GB/s, "
          f"floor {floor_ms:.2f} ms")
    print(f"{steps} tokens in {wall * 1e3:.0f} ms: {wall / steps * 1e3:.2f} ms per token (engine, all in)")
    print(f"per decode step, median ms: runner {med['execute']:.2f}  forward {med['forward']:.2f}  "
          f"logits {med['logits']:.2f}  runner rest {med['execute'] - med['forward'] - med['logits']:.2f}")
    print(f"step (runner) / floor {med['execute'] / floor_ms:.2f}x, forward + logits / floor "
          f"{(med['forward'] + med['logits']) / floor_ms:.2f}x")
    if args.ab_runs:
        ab_per_layer(llm, prompt, params, times, holder["model"], args.ab_runs, floor_ms)
    if args.ab_workspace:
        ab_workspace(llm, prompt, params, times, holder["model"], args.ab_workspace, floor_ms)
    if args.ab_prefill:
        ab_prefill(llm, times, args.ab_prefill, args.prefill_tokens)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def ab_per_layer(llm, prompt, params, times, model, runs: int, floor_ms: float) -> None:
    """--ab-runs: the step now ("stack") against a Python call per layer and the general sampler ("per-layer")."""
    from kvferry.engine import runner
    from kvferry.model import layer_op

    stack_layers, greedy = layer_op.run_layers, runner.plain_greedy_tokens

    def per_layer(stack, h, x, cos, sin, kv_cache, meta):
        for i, args in enumerate(model._layer_args):
            h, x = layer_op.run_layer(args, h, x, cos, sin, kv_cache[i], meta)
        return h, x

    def use(mode):
        layer_op.run_layers = stack_layers if mode == "stack" else per_layer
        runner.plain_greedy_tokens = greedy if mode == "stack" else (lambda *a: None)

    alternate(llm, prompt, params, times, runs, floor_ms, ("per-layer", "stack"), use)
    use("stack")


def ab_workspace(llm, prompt, params, times, model, runs: int, floor_ms: float) -> None:
    """--ab-workspace: the layer stack's steps in its reused buffers ("workspace") against
    each layer allocating its outputs and views ("allocating", as before them)."""
    stack = model._layer_stack
    if stack is None or not hasattr(stack, "set_workspace_rows"):
        raise SystemExit("--ab-workspace: the step does not run the layer stack, or its build has no workspace")
    alternate(llm, prompt, params, times, runs, floor_ms, ("allocating", "workspace"),
              lambda mode: stack.set_workspace_rows(32 if mode == "workspace" else 0))
    if stack.workspace_rows() < 1:
        raise SystemExit("--ab-workspace: the workspace never ran (the layers are not all GGUF dots)")


def ab_prefill(llm, times, runs: int, tokens: int) -> None:
    """--ab-prefill: prefills of ``tokens`` random token ids with the K-quants'
    prefill dots as this CPU's routing decides ("dots") and off ("tiles")."""
    import random

    from kvferry import SamplingParams
    from kvferry.model.quant import kernels

    decided = kernels.PREFILL_DOTS

    def use(mode: str) -> None:
        kernels.PREFILL_DOTS = decided if mode == "dots" else False
        kernels.configure()

    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    modes = ("tiles", "dots")
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    run_ms: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for r in range(2 * runs + 2):
            mode = modes[(r + r // 2) % 2]  # a, b, b, a, a, b, ...
            use(mode)
            for v in times.values():
                v.clear()
            prompt = [rng.randrange(1000, 20000) for _ in range(tokens)]
            c0 = time.process_time()
            out = llm.generate(prompt, params)[0]
            if r >= 2:  # the first pair warms both paths
                cpu[mode].append(time.process_time() - c0)
                run_ms[mode].append(sum(times["execute"]))
            assert len(out.prompt_token_ids) == tokens
    finally:
        use("dots")
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"prefill of {tokens} tokens, {runs} runs each alternating, load {load}, prefill dots "
          f"{kernels.prefill_dots_fit() if decided is None else decided} here:")
    for mode in modes:
        c, w = statistics.median(cpu[mode]), statistics.median(run_ms[mode])
        print(f"  {mode:6s} CPU {c * 1e3:8.0f} ms ({tokens / c:6.1f} tok/s of CPU)  runner {w * 1e3:8.0f} ms "
              f"({' '.join(f'{x * 1e3:.0f}' for x in run_ms[mode])})")
    pairs = [t / d for t, d in zip(cpu["tiles"], cpu["dots"])]
    print(f"  tiles / dots CPU time, median of pairs: {statistics.median(pairs):.2f}x")


def alternate(llm, prompt, params, times, runs: int, floor_ms: float, modes: tuple[str, str], use) -> None:
    """``runs`` generations in each of two ``modes`` (``use(mode)`` switches), in the order
    a b b a a b ..., checking that both give the same tokens; prints each mode's figures."""
    res = {m: {k: [] for k in times} for m in modes}
    tokens = {}
    for r in range(2 * runs):
        mode = modes[(r + r // 2) % 2]  # a, b, b, a, a, b, ...
        use(mode)
        for v in times.values():
            v.clear()
        ids = llm.generate([prompt], params)[0].token_ids
        if tokens.setdefault(mode, ids) != ids or tokens.get(modes[0], ids) != ids:
            raise SystemExit(f"{mode}: different tokens")
        for k, v in times.items():
            res[mode][k].append(1e3 * statistics.median(v[1:]))
    print(f"alternating in one process, {runs} runs each, the same tokens; ms per decode step (median of a run's steps):")
    for mode, r in res.items():
        rest = [e - f - lg for e, f, lg in zip(r["execute"], r["forward"], r["logits"])]
        print(f"  {mode:10s} runner {statistics.median(r['execute']):.2f} ({' '.join(f'{x:.2f}' for x in r['execute'])}; "
              f"/ floor {statistics.median(r['execute']) / floor_ms:.2f}x)  forward {statistics.median(r['forward']):.2f}  "
              f"logits {statistics.median(r['logits']):.2f}  rest {statistics.median(rest):.2f}")


if __name__ == "__main__":
    main()
