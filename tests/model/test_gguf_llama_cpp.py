"""kvferry against llama.cpp on the same GGUF file: a Q8_0 file of the
embedded model's weights (llama-quantize from the embedded Q4_1 file), served
in its blocks by ``kvferry serve --quantization gguf`` and by llama.cpp's
``llama-server``, answers 10 chat prompts greedily with the same first 16
tokens on at least 8 of them (the issue's check), with kvferry's matmuls in
llama.cpp's arithmetic at every batch size (KVFERRY_QUANT_DOTS_ALWAYS=1).
Measured: 8 of 10; the comment above the test has what differs in the two.

llama.cpp is a dev tool, never a dependency: bench/llama_cpp_build.sh builds
it, and this test skips where ``llama-server`` or ``llama-quantize`` is not
found (``$KVFERRY_LLAMA_CPP_BIN``, /work/llama.cpp/bin, ``PATH``)."""
from __future__ import annotations

import openai
import pytest

from bench._llama_cpp import llama_server, missing_reason, quantize
from kvferry import envs
from kvferry.model.gguf_convert import embedded_gguf_path
from tests.serve.server_process import start_server

pytestmark = pytest.mark.skipif(missing_reason("llama-server", "llama-quantize") is not None,
                                reason=missing_reason("llama-server", "llama-quantize") or "")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in one sentence.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "What is 12 times 7?",
    "Give me a tip for staying focused while studying.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
]
TOKENS = 16
# The comparison's fair settings, both sides as close to float as each goes. llama-server's CPU
# flash attention (on by default: "-fa auto") keeps K and V in f16 whatever -ctk/-ctv say (measured:
# the same logprobs with and without "-ctk f32 -ctv f32"), so it is turned off for the f32 KV that
# kvferry's --dtype float32 holds. Checked to be the same elsewhere: the prompt's token ids
# (llama-server's /apply-template and /tokenize against kvferry's /tokenize: identical for all 10,
# the file's own template with its default system prompt, no BOS added: add_bos_token is false),
# rope (normal, theta 1e5), rms eps (1e-5), and greedy sampling (temperature 0 is argmax in both).
LLAMA_ARGS = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]


def _answers(base_url: str) -> list[str]:
    """Greedy answers (at most TOKENS tokens) to PROMPTS through the openai client."""
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as c:
        return [c.chat.completions.create(model="m", messages=[{"role": "user", "content": p}],
                                          max_tokens=TOKENS, temperature=0.0).choices[0].message.content
                for p in PROMPTS]


# What it takes (measured 2026-12-07, llama.cpp from llama-cpp-python 0.3.36, no AMX, Xeon
# AVX-512 VNNI). On an F32 file the two agree to 3 decimals. On the Q8_0 file llama.cpp quantizes
# every matmul's activations to Q8_0 (ggml's quantize_row_q8_0: 127/amax, an fp16 block scale,
# rounding to nearest even) and multiplies them by exact integer dot products, prefill included
# (tinyBLAS for 2+ rows, ggml_vec_dot_q8_0_q8_0 for one). kvferry's dots are that arithmetic to
# the bit (tests/model/quant/test_kernels.py), and KVFERRY_QUANT_DOTS_ALWAYS=1 takes them at every
# batch size; by default prefill multiplies bf16 tiles (faster), which agree on only 4 of 10.
# The matmuls then match bit for bit (layer 0's q/k/v, o, gate/up and down outputs, dumped from
# llama.cpp's eval callback for the first prompt), but the other ops do not: RMSNorm (ggml sums
# the squares in double), SiLU and softmax (ggml's own expf), the attention's sums (padded to 256
# positions, in tinyBLAS's order) each differ in the last bits, and this model's massive ffn_down
# activations (one value ~10^4x the rest of its 32-block) make any last-bit difference a chaos:
# one Q8_0 rounding flips in one row at layer 1, and by layer 2 the rows differ by 2e-3 (relative),
# by the last layer by a few hundredths of a nat. 8 of 10 agree, the two others part at a near tie
# after the same first tokens: "Write a haiku" at token 2 (llama.cpp " sea" -2.703 / " ocean"
# -2.729; kvferry " waves" -2.594 / " ocean" -2.677) and "Give me a tip" at token 14 (" that"
# -1.002 / " coined" -1.133; kvferry " coined" -0.990 / " that" -1.101). Agreement past 8 needs
# ggml's arithmetic for every op, not only the matmuls.
@pytest.mark.timeout(1800)  # two servers and 20 requests: past 600 s on a loaded 2-core machine
def test_greedy_agrees_with_llama_cpp(tmp_path):
    q8 = quantize(embedded_gguf_path(), tmp_path / "smollm2-q8_0.gguf", "Q8_0")
    with llama_server(q8, tmp_path / "llama-server.log", extra=LLAMA_ARGS) as url:
        theirs = _answers(f"{url}/v1")
    # llama.cpp's arithmetic for every matmul: 8-bit activations at every batch size, prefill included.
    srv = start_server(tmp_path / "kvferry.log", ["--model", str(q8), "--quantization", "gguf",
                                                   "--served-model-name", "m"], env={envs.QUANT_DOTS_ALWAYS: "1"})
    try:
        ours = _answers(srv.api_url)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    # The same vocabulary and at most TOKENS tokens each: the same text is the same tokens.
    agree = [a.strip() == b.strip() for a, b in zip(ours, theirs)]
    for p, a, b, ok in zip(PROMPTS, ours, theirs, agree):
        print(f"{'same' if ok else 'DIFF'} {p!r}:\n  kvferry   {a!r}\n  llama.cpp {b!r}")
    assert sum(agree) >= 8, f"{sum(agree)} of {len(PROMPTS)} agree on the first {TOKENS} tokens"
