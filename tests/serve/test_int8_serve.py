"""``kvferry serve --quantization int8`` over the embedded SmolLM2-135M
(expanded to float, then its linear weights quantized to int8 at load)
against the same model in float32, through the openai client: the
teacher-forced log-probabilities of a fixed text (completions echo with
logprobs) stay within a bound, greedy answers start alike, and the int8
server's processes hold less memory."""
from __future__ import annotations

import numpy as np
import openai

from tests.serve.server_process import MODEL_NAME, start_server
from tests.serve.test_gguf_quantized_serve import _tree_rss_mb

TEXT = ("The capital of France is Paris, and the capital of Germany is Berlin. Water boils at one hundred "
        "degrees Celsius at sea level. The sun rises in the east and sets in the west. def add(a, b):\n"
        "    return a + b\n")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water is made of"]


def _serve(tmp_path, extra: list[str]) -> tuple[list[float], list[list[str]], float]:
    srv = start_server(tmp_path / f"server{len(extra)}.log", extra)
    try:
        with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=300) as c:
            r = c.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=1, echo=True, logprobs=1,
                                     temperature=0.0)
            lps = [x for x in r.choices[0].logprobs.token_logprobs if x is not None]
            greedy = []
            for p in PROMPTS:
                g = c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0.0, logprobs=0)
                greedy.append(g.choices[0].logprobs.tokens)
        return lps, greedy, _tree_rss_mb(srv.proc.pid)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_served_int8_against_float32(tmp_path):
    # float32 first: a first use of the embedded file expands it into the model cache, and
    # that server's RSS then holds the expansion's pages too.
    lpf, gf, rssf = _serve(tmp_path, [])
    lp8, g8, rss8 = _serve(tmp_path, ["--quantization", "int8"])
    a, b = np.array(lp8), np.array(lpf)
    assert len(a) == len(b) > 40
    agree = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(g8, gf)]
    print(f"int8 vs float32: mean logprob {a.mean():.3f} vs {b.mean():.3f}, mean |d| {np.abs(a - b).mean():.3f}, "
          f"max |d| {np.abs(a - b).max():.3f}; greedy tokens agreeing {agree}; RSS {rss8:.0f} vs {rssf:.0f} MB")
    # 8-bit weights per channel and 8-bit activations with ONE scale per token (576 values:
    # coarser than Q8_0's one per 32, and SmolLM2's activations have outlier channels) through
    # 30 layers. Measured on a 2-core Xeon (AVX512-VNNI), 47 tokens: mean logprob -2.289 (int8)
    # vs -2.345 (float32), mean |d| 0.169, max |d| 0.76; greedy agreeing for 5, 5, 3, 3, 1 tokens.
    assert abs(a.mean() - b.mean()) < 0.1
    assert np.abs(a - b).mean() < 0.25
    # Greedy: the first 3 tokens of 4 of the 5 prompts agree (a near-tie may flip a later one).
    assert sum(n >= 3 for n in agree) >= 4, agree
    # The 30 layers' linear weights, 106M parameters: 425 MB in float32, 106 MB in int8 (the
    # model's own storages: tests/model/test_int8.py). The serving processes' RSS fell by less,
    # 120 MB of the 319 (measured 1705 vs 1825 MB, twice): the rest is not yet accounted for.
    assert rss8 < rssf - 60
