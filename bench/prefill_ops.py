"""Where a dense bf16 prefill step's time goes, op by op, on the 1B-shaped
Llama (bench/_peer_models.py's LLAMA_1B with the real 128256 vocabulary,
random weights): ``--tokens`` new tokens (one fresh prompt, or ``--prompts``
of equal length) through the model
as the engine runs it (one C++ call for all layers where the layer op
applies), then the lm_head on the sampled row and greedy sampling.

Per thread count, alternated within the run (``--reps`` rounds, medians),
in CPU time (time.process_time: all of the process's threads; a shared
host's wall clock is noise):

- ``step``: the whole step (model forward, lm_head, sampling);
- each op of layer 0 called alone on the step's own tensors, exactly as
  csrc/decoder_layer.cpp calls it (the same op, packed weight and views):
  qkv / o / gate_up / down, rope, write_kv, attention, the two residual
  norms, silu_and_mul; then the embedding, the lm_head on the sampled row
  and sampling. ``layers x (layer ops) + the rest`` against ``step`` says
  how much of the step the list covers;
- ``sdpa``: torch's scaled_dot_product_attention (its flash kernel, 4-D
  inputs, enable_gqa) on the same q, k, v, causal: what the attention op
  is compared with.

``--profile`` also prints torch.profiler's op table of one step (its
times are the calling thread's wall time).

    python bench/prefill_ops.py [--tokens 2048 512] [--prompts 1] [--threads 1 2] [--layers 16] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer_models import LLAMA_1B, random_checkpoint  # noqa: E402

from kvferry.model.attention import AttentionMetadata  # noqa: E402
from kvferry.model.fused_ops import argmax_rows  # noqa: E402
from kvferry.model.llama import allocate_kv_cache  # noqa: E402
from kvferry.model.loader import load_model  # noqa: E402


class Prefill:
    """``prompts`` fresh prompts of ``tokens // prompts`` tokens each, in one step, over a paged cache."""

    def __init__(self, model, tokens: int, prompts: int = 1, block_size: int = 16) -> None:  # noqa: ANN001
        assert tokens % prompts == 0, "--tokens must be a multiple of --prompts"
        self.model, self.tokens, self.prompts, self.bs = model, tokens, prompts, block_size
        each = tokens // prompts
        blocks = -(-each // block_size)
        self.kv = allocate_kv_cache(model.config, prompts * blocks + 4, block_size, model.dtype)
        self.tables = torch.arange(prompts * blocks, dtype=torch.int64).view(prompts, blocks)
        self.slots = (self.tables[:, :, None] * block_size + torch.arange(block_size)).reshape(prompts, -1)[:, :each]
        self.slots = self.slots.reshape(-1).contiguous()
        self.pos = torch.arange(each).repeat(prompts)
        self.starts = [i * each for i in range(prompts + 1)]
        self.last = torch.tensor(self.starts[1:]) - 1  # the sampled rows
        self.ids = torch.randint(100, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(query_start_loc=self.starts, seq_lens=[self.tokens // self.prompts] * self.prompts,
                                 slot_mapping=self.slots, block_tables=self.tables, block_size=self.bs,
                                 num_prefills=self.prompts, kv_dtype=self.kv.dtype)

    def __call__(self) -> torch.Tensor:
        hidden = self.model(self.ids, self.pos, self.kv, self.meta())
        return argmax_rows(self.model.compute_logits(hidden[self.last]))


def layer_ops(model, step: Prefill) -> tuple[dict, dict, dict]:  # noqa: ANN001
    """(layer 0's ops, the step's other ops, the comparisons): closures on the
    step's tensors, each op as decoder_layer.cpp runs it."""
    import torch.nn.functional as F

    from kvferry.model import layer_op

    meta = step.meta()
    meta.prepare()
    args = layer_op.model_layer_args(model)
    assert args is not None, "the layer op does not apply to this model"
    a = args[0]  # layer_op.LayerArgs
    qkv_w, qkv_n, qkv_kind, o_w, o_n, o_kind = a.qkv_w, a.qkv_n, a.qkv_kind, a.o_w, a.o_n, a.o_kind
    post_w, post_eps, gu_w, gu_n, gu_kind = a.post_norm_w, a.post_eps, a.gate_up_w, a.gate_up_n, a.gate_up_kind
    down_w, down_n, down_kind, next_w, next_eps = a.down_w, a.down_n, a.down_kind, a.next_norm_w, a.next_eps
    H, KVH, scale, exact_rows, row_bucket = a.num_heads, a.num_kv_heads, a.scale, a.exact_rows, a.row_bucket
    T, D = step.tokens, model.config.head_dim
    gemm = _matmul(exact_rows, row_bucket)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(T, model.config.hidden_size, generator=g).to(model.dtype)
    x = torch.ops.kvferry_fused.rms_norm(h, model.layers[0].input_layernorm.weight, next_eps)
    cos, sin = model.rotary.rows(step.pos, model.dtype)
    qkv = gemm(x, qkv_w, qkv_n, qkv_kind)
    qk_in = qkv.narrow(1, 0, (H + KVH) * D).view(T, H + KVH, D)
    qk = torch.ops.kvferry_fused.rope_neox(qk_in, cos, sin)
    q, k = qk.narrow(1, 0, H), qk.narrow(1, H, KVH)
    v = qkv.narrow(1, (H + KVH) * D, KVH * D).view(T, KVH, D)
    kv = step.kv[0]
    k_cache, v_cache = kv[0], kv[1]
    attn = torch.empty(T, H, D, dtype=model.dtype)
    o = gemm(attn.view(T, H * D), o_w, o_n, o_kind)
    h1, x1 = torch.ops.kvferry_fused.add_rms_norm(o, h, post_w, post_eps)
    gate_up = gemm(x1, gu_w, gu_n, gu_kind)
    up = torch.ops.kvferry_fused.silu_and_mul(gate_up)
    down = gemm(up, down_w, down_n, down_kind)
    each = T // step.prompts
    # SDPA per prompt, as attention.py's torch path runs a fresh prompt (4-D inputs: the flash kernel)
    heads = [(q[s:s + each].transpose(0, 1)[None], k[s:s + each].transpose(0, 1)[None],
              v[s:s + each].transpose(0, 1)[None]) for s in step.starts[:-1]]
    hidden = torch.randn(T, model.config.hidden_size, generator=g).to(model.dtype)
    logits = model.compute_logits(hidden[step.last])
    return {
        "qkv": lambda: gemm(x, qkv_w, qkv_n, qkv_kind),
        "rope": lambda: torch.ops.kvferry_fused.rope_neox(qk_in, cos, sin),
        "write_kv": lambda: torch.ops.kvferry_fused.write_kv(k, v, k_cache.view(-1, KVH, D), v_cache.view(-1, KVH, D),
                                                             meta.slot_mapping),
        "attention": lambda: torch.ops.kvferry.paged_attention(
            q, k_cache, v_cache, meta.kernel_block_tables, meta.kernel_seq_lens, meta.kernel_query_starts,
            meta.kernel_query_lens, scale, attn),
        "o": lambda: gemm(attn.view(T, H * D), o_w, o_n, o_kind),
        "norms (2)": lambda: (torch.ops.kvferry_fused.add_rms_norm(o, h, post_w, post_eps),
                              torch.ops.kvferry_fused.add_rms_norm(down, h1, next_w, next_eps)),
        "gate_up": lambda: gemm(x1, gu_w, gu_n, gu_kind),
        "silu_and_mul": lambda: torch.ops.kvferry_fused.silu_and_mul(gate_up),
        "down": lambda: gemm(up, down_w, down_n, down_kind),
    }, {
        "embedding": lambda: model.embed(step.ids),
        "cos/sin rows": lambda: model.rotary.rows(step.pos, model.dtype),
        "lm_head (sampled rows)": lambda: model.compute_logits(hidden[step.last]),
        "sampling": lambda: argmax_rows(logits),
    }, {
        "sdpa (flash)": lambda: [F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                                enable_gqa=True) for qh, kh, vh in heads],
    }


def _matmul(exact_rows: int, row_bucket: int):  # noqa: ANN202
    """A matmul as decoder_layer.cpp's Matmul runs a plain packed weight."""
    from kvferry.model import linear as plain

    def gemm(x: torch.Tensor, w: torch.Tensor, n: int, kind: int) -> torch.Tensor:
        if kind == 1:
            return torch.ops.kvferry_gemm.linear(x, w, n)
        assert kind == 2, kind
        return plain.linear(x, None, None, plain.PackedWeight(w, None, n))
    return gemm


def cpu_ms(fn, inner: int = 1) -> float:  # noqa: ANN001
    c = time.process_time()
    for _ in range(inner):
        fn()
    return (time.process_time() - c) / inner * 1e3


def profiled(step) -> None:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="cpu_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 512])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=1, help="prompts the tokens are split into (8: 8 x 256 at 2048)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    from kvferry.engine.host_memory import tune_malloc
    tune_malloc()
    folder = random_checkpoint("llama-1b", LLAMA_1B, vocab_size=128256, num_hidden_layers=args.layers)
    model = load_model(str(folder), dtype="bfloat16").model
    results: dict = {"load_start": os.getloadavg(), "layers": args.layers, "prompts": args.prompts}
    with torch.inference_mode():
        for tokens in args.tokens:
            step = Prefill(model, tokens, args.prompts)
            step()  # packs the weights
            per_layer, rest, compare = layer_ops(model, step)
            ops = {"step": step, **per_layer, **rest, **compare}
            for t in args.threads:
                torch.set_num_threads(t)
                for fn in ops.values():
                    fn()  # warm: kernels built, primitives made, pages faulted
            samples = {t: {name: [] for name in ops} for t in args.threads}
            for _ in range(args.reps):
                for t in args.threads:
                    torch.set_num_threads(t)
                    for name, fn in ops.items():
                        samples[t][name].append(cpu_ms(fn, 1 if name == "step" else 3))
            for t in args.threads:
                med = {name: statistics.median(v) for name, v in samples[t].items()}
                layer_sum = sum(med[n] for n in per_layer)
                med["layers x layer ops + rest"] = args.layers * layer_sum + sum(med[n] for n in rest)
                med["load"] = os.getloadavg()[0]
                results[f"T={tokens} threads={t}"] = med
                print(f"T={tokens} prompts={args.prompts} threads={t}", json.dumps({k: round(v, 2) for k, v in med.items()}), flush=True)
                if args.profile:
                    torch.set_num_threads(t)
                    profiled(step)
            del step, ops, per_layer, rest, compare
    results["load_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
