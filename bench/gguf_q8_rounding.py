"""How much 8-bit activation rounding alone moves greedy answers: a float
reference forward (plain torch over a llama GGUF's dequantized tensors,
the file's own chat template) run three ways over the 10 chat prompts of
tests/model/test_gguf_llama_cpp.py: float activations, and every matmul's
activations quantized to Q8_0 (32 values, one fp16 scale) rounding ties to
even (ggml's AVX2 path) or away from zero (its scalar path). Prints the
first token's logprobs for the first prompt and how many prompts' first 16
greedy tokens agree between each pair. Slow (no KV cache): minutes.

    python bench/gguf_q8_rounding.py FILE.gguf     # e.g. a Q8_0 file of the embedded model

Measured on a Q8_0 file of the embedded model (llama-quantize from its Q4_1
file): the first token's "The" -1.848 (float), -2.032 (ties to even),
-2.254 (ties away, "L" leads); the two roundings agree on 4 of 10, with float
on 5 and 3; the float answers are kvferry's float model's, all 10.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from kvferry.model.gguf_convert import convert_gguf
from kvferry.model.tokenizer import Tokenizer
from tests.model.test_gguf_llama_cpp import PROMPTS, TOKENS


def _q8(x: torch.Tensor, ties_even: bool) -> torch.Tensor:
    b = x.reshape(-1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    # ggml's multiplier 127 / amax, a true division (torch's 127 / t is 127 * (1 / t))
    v = b * torch.where(amax == 0, torch.zeros_like(amax), torch.full_like(amax, 127) / amax)
    q = torch.round(v) if ties_even else torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (q * (amax / 127).to(torch.float16).float()).reshape(x.shape)


class Reference:
    def __init__(self, path: str) -> None:
        r = GGUFReader(path)
        self.w = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
                  .reshape(*[int(n) for n in t.shape[::-1]]) for t in r.tensors}
        meta = {k: f.parts[f.data[0]][0] for k, f in r.fields.items() if k.startswith("llama.") and f.data}
        self.layers, self.heads = int(meta["llama.block_count"]), int(meta["llama.attention.head_count"])
        self.kv_heads = int(meta["llama.attention.head_count_kv"])
        self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
        self.theta = float(meta["llama.rope.freq_base"])
        self.mode: bool | None = None  # None: float; True/False: Q8_0 with ties to even / away

    def lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return (x if self.mode is None else _q8(x, self.mode)) @ self.w[name].T

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def rope(self, x: torch.Tensor) -> torch.Tensor:  # llama.cpp's normal rope (pairs), on GGUF's permuted rows
        hd = x.shape[-1]
        inv = self.theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = (torch.arange(x.shape[0])[:, None].double() * inv[None]).float()
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        out = torch.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
        return out

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        t, h, kvh = len(ids), self.heads, self.kv_heads
        x = self.w["token_embd.weight"][ids]
        for i in range(self.layers):
            p = f"blk.{i}."
            a = self.rms(x, p + "attn_norm.weight")
            q = self.rope(self.lin(a, p + "attn_q.weight").view(t, h, -1))
            k = self.rope(self.lin(a, p + "attn_k.weight").view(t, kvh, -1)).repeat_interleave(h // kvh, 1)
            v = self.lin(a, p + "attn_v.weight").view(t, kvh, -1).repeat_interleave(h // kvh, 1)
            s = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
            s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf")).softmax(-1)
            x = x + self.lin(torch.einsum("hts,shd->thd", s, v).reshape(t, -1), p + "attn_output.weight")
            a = self.rms(x, p + "ffn_norm.weight")
            g, u = self.lin(a, p + "ffn_gate.weight"), self.lin(a, p + "ffn_up.weight")
            x = x + self.lin(torch.nn.functional.silu(g) * u, p + "ffn_down.weight")
        head = "output.weight" if "output.weight" in self.w else "token_embd.weight"
        return torch.log_softmax(self.lin(self.rms(x[-1:], "output_norm.weight"), head), -1)[0]


def main(path: str) -> None:
    ref, tok = Reference(path), Tokenizer(convert_gguf(path, weights=False))
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    answers: dict[str, list[list[int]]] = {}
    for name, mode in (("float", None), ("q8 ties-even", True), ("q8 ties-away", False)):
        ref.mode, answers[name] = mode, []
        first = ref.logprobs(prompts[0])
        top = first.topk(3)
        print(name, "first token:", {tok.decode([int(i)]): round(float(v), 3) for v, i in zip(*top)}, flush=True)
        for ids in prompts:
            out: list[int] = []
            while len(out) < TOKENS and (not out or out[-1] not in tok.eos_token_ids):
                out.append(int(ref.logprobs(ids + out).argmax()))
            answers[name].append(out)
    names = list(answers)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            print(f"{a} / {b}: {sum(x == y for x, y in zip(answers[a], answers[b]))} of {len(PROMPTS)} agree")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
