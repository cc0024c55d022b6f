"""What expert parallelism costs on one host: decode tokens/s of EP 2 (whole
experts per rank, 1 thread per rank) against EP 1 (one process, 2
threads), with TP 2 (every expert sliced, 1 thread per rank) beside them,
at concurrency 1 and 16; and the all-reduce's share of a decode step
(rank 0's time inside it: the copy, the sum and the wait for the slower
rank, which for EP is where an unbalanced routing shows); and the CPU
time per decoded token summed over the core's processes, which a host
that other work shares disturbs less than the wall clock.

An OLMoE-1B-7B-shaped model as Qwen3-MoE (hidden 2048, 16 heads of 128,
64 experts of width 1024, top-8, vocabulary 50304) with random bf16
weights and ``--layers`` decoder layers, each an OLMoE layer (16 is the
whole 7B: 0.8 GB of experts a layer). Each sequence has a 32-token prompt
and decodes ``--tokens`` more; only the decode steps are timed. Each mode
runs in its own process; the modes alternate over ``--runs``.

    python bench/moe_ep.py [--runs 1] [--layers 2] [--tokens 32] [--modes ep1,ep2,tp2] [--experts 64]

(``--experts 8 --layers 1 --tokens 4``: a quick check that every mode runs.)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tp_decode import TimedGroup

REPO = Path(__file__).resolve().parents[1]
MODES = {  # name -> (tensor_parallel_size, threads per rank, expert parallel)
    "ep1": (1, 2, False),
    "ep2": (2, 1, True),
    "tp2": (2, 1, False),
}
OLMOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=50304, hidden_size=2048,
             intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
             num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024, norm_topk_prob=False,
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
CONCURRENCY = (1, 16)


def child(mode: str, checkpoint: str, tokens: int) -> None:
    from kvferry import LLM, SamplingParams

    tp, threads, ep = MODES[mode]
    if tp == 1:
        import torch
        torch.set_num_threads(threads)
    llm = LLM(model=checkpoint, dtype="bfloat16", tensor_parallel_size=tp, cpu_threads_per_rank=threads,
              enable_expert_parallel=ep, num_kv_blocks=256, block_size=16, enable_prefix_caching=False,
              max_num_seqs=16, warm_up=False)
    shard = llm.engine.core.runner.model.shard
    timed = TimedGroup(shard.group) if shard.group is not None else None
    if timed is not None:
        shard.group = timed
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(3, 380) for _ in range(32)] for _ in range(n)]  # ids the test tokenizer knows

    out: dict = {"mode": mode}
    llm.generate(prompts(2), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm
    engine = llm.engine
    workers = [proc.pid for proc in engine.core.tp._procs] if engine.core.tp is not None else []
    for conc in CONCURRENCY:
        params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts(conc)):
            engine.add_request(f"c{conc}-{i}", prompt, params)
        engine.step()  # every prompt in one prefill step: not timed
        if timed is not None:
            timed.seconds = 0.0
        decode_s, steps = 0.0, 0
        cpu0 = _cpu_seconds(workers)
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            decode_s += time.perf_counter() - t0
            steps += 1
        out[f"c{conc}_cpu_ms_per_tok"] = 1000 * (_cpu_seconds(workers) - cpu0) / (conc * tokens)
        out[f"c{conc}_tok_s"] = conc * tokens / decode_s
        out[f"c{conc}_step_ms"] = 1000 * decode_s / steps
        if timed is not None:
            out[f"c{conc}_all_reduce_share"] = timed.seconds / decode_s
    llm.engine.core.close()
    print(json.dumps(out), flush=True)


def _cpu_seconds(workers: list[int]) -> float:
    """CPU time of this process (every thread) and of the worker ranks: on a
    shared host the wall clock measures the other tenants too, this does not
    (though a rank spinning in a wait counts)."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in workers:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def make_checkpoint(root: Path, layers: int, experts: int) -> str:
    """OLMOE with ``layers`` layers, random bf16 weights, one safetensors
    file per layer (so that writing it holds one layer at a time)."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO))
    from tests.tiny_models import write_tokenizer

    c = dict(OLMOE, num_hidden_layers=layers, num_experts=experts)
    folder = root / "olmoe-shaped"
    folder.mkdir()
    write_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(c))
    gen = torch.Generator().manual_seed(0)
    h, q, e, inter = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], c["num_experts"], c["moe_intermediate_size"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    save({"model.embed_tokens.weight": rand(c["vocab_size"], h), "lm_head.weight": rand(c["vocab_size"], h),
          "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}, "model-outer.safetensors")
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "self_attn.q_norm.weight": torch.ones(c["head_dim"], dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(c["head_dim"], dtype=torch.bfloat16),
             p + "self_attn.o_proj.weight": rand(h, q), p + "mlp.gate.weight": rand(e, h)}
        for proj in "qkv":
            t[p + f"self_attn.{proj}_proj.weight"] = rand(q, h)
        for x in range(e):
            t[p + f"mlp.experts.{x}.gate_proj.weight"] = rand(inter, h)
            t[p + f"mlp.experts.{x}.up_proj.weight"] = rand(inter, h)
            t[p + f"mlp.experts.{x}.down_proj.weight"] = rand(h, inter)
        save(t, f"model-layer{i}.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(folder)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--experts", type=int, default=OLMOE["num_experts"])
    p.add_argument("--child", nargs=3, metavar=("MODE", "CHECKPOINT", "TOKENS"))
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_checkpoint(Path(tmp), args.layers, args.experts)
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        for _ in range(args.runs):
            for mode in modes:
                proc = subprocess.run([sys.executable, __file__, "--child", mode, checkpoint, str(args.tokens)],
                                      env=env, capture_output=True, text=True, check=True)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
                results[mode].append(json.loads(line))
                loads.append(os.getloadavg()[0])
                print(line, flush=True)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, {args.layers} layers of {args.experts} experts, "
          f"load average (1 min) {min(loads):.1f}-{max(loads):.1f} over the run")
    base = {c: statistics.median(r[f"c{c}_tok_s"] for r in results[modes[0]]) for c in CONCURRENCY}
    base_cpu = {c: statistics.median(r[f"c{c}_cpu_ms_per_tok"] for r in results[modes[0]]) for c in CONCURRENCY}
    for mode in modes:
        row = [mode]
        for c in CONCURRENCY:
            v = statistics.median(r[f"c{c}_tok_s"] for r in results[mode])
            step = statistics.median(r[f"c{c}_step_ms"] for r in results[mode])
            cpu = statistics.median(r[f"c{c}_cpu_ms_per_tok"] for r in results[mode])
            row.append(f"c{c} {v:.1f} tok/s ({v / base[c]:.2f}x), step {step:.1f} ms, "
                       f"CPU {cpu:.1f} ms/token ({cpu / base_cpu[c]:.2f}x)")
            shares = [r[f"c{c}_all_reduce_share"] for r in results[mode] if f"c{c}_all_reduce_share" in r]
            if shares:
                row.append(f"c{c} all-reduce {100 * statistics.median(shares):.0f}%")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
