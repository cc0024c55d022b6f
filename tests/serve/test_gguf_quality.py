"""Quality of quantized GGUF files served in their blocks, and the default
that serves them so.

The embedded model's weights are written as an F32 GGUF (``llama-quantize``
from the embedded Q4_1 file: the float model), then quantized from it to
Q8_0 and Q4_K_M by ``llama-quantize``, as a llama.cpp user makes them. Each
file is served by a real ``kvferry serve`` without ``--quantization`` (the
.gguf's blocks are kept: the log says so), and the mean log-probability of a
fixed real text, through the openai client's completions with echo and
logprobs, is within 0.03 nats per token of the float model's for Q8_0 and
0.2 for Q4_K_M (the issue's bounds). An IQ4_NL file (no native kernel) is
dequantized at load, in one log line, and still answers: IQ4_NL in its
attention queries, Q8_0 elsewhere (llama-quantize's IQ4_NL search takes
many times Q8_0's time a weight; the queries are a tenth of a layer's).

llama.cpp is a dev tool, never a dependency: these tests skip where
``llama-quantize`` is not found (bench/llama_cpp_build.sh builds it)."""
from __future__ import annotations

import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from bench._llama_cpp import missing_reason, quantize
from kvferry.model.gguf_convert import embedded_gguf_path
from tests.model.own_cache import own_model_cache
from tests.serve.server_process import start_server

pytestmark = pytest.mark.skipif(missing_reason("llama-quantize") is not None,
                                reason=missing_reason("llama-quantize") or "")

# The opening of Jane Austen's Pride and Prejudice (1813, public domain): real prose the model has seen the like of.
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. However little known the feelings or views of such a man may be on his first entering "
        "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
        "considered the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said "
        "his lady to him one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied "
        "that he had not. \"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me all "
        "about it.\" Mr. Bennet made no answer. \"Do you not want to know who has taken it?\" cried his wife "
        "impatiently. \"You want to tell me, and I have no objection to hearing it.\" This was invitation enough.")
BOUNDS = {"Q8_0": 0.03, "Q4_K_M": 0.2}  # nats per token against the float model
KEPT = "kept in their blocks"  # the loader's log line for a .gguf served in its blocks


def _kept(log: str, path: Path) -> tuple[int, int, bool]:
    """(linear layers kept in blocks, linear layers, whether the token embedding is) from the loader's log."""
    m = re.search(rf"GGUF {re.escape(path.name)}: (\d+) of (\d+) linear layers(, the token embedding)? {KEPT}", log)
    assert m, log[-3000:]
    return int(m[1]), int(m[2]), bool(m[3])


# More llama-quantize options a file is made with: every linear tensor of
# the IQ4_NL file but the queries Q8_0 (its token embedding is Q8_0 in any
# case: llama-quantize's Q6_K for it needs rows of a multiple of 256).
FLAGS = {"IQ4_NL": tuple(arg for t in ("attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
                         for arg in ("--tensor-type", f"{t}=q8_0"))}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Future]:
    """F32 (the float model), Q8_0 and Q4_K_M from it, and IQ4_NL, each a
    future: made one after another in a thread of their own, while the
    servers of the files already made start (served). The module's own
    model cache (conversions land there, not in the user's)."""
    with own_model_cache(tmp_path_factory.mktemp("gguf-quality")) as tmp, ThreadPoolExecutor(1) as quantizer:
        f32 = quantizer.submit(quantize, embedded_gguf_path(), tmp / "smollm2-f32.gguf", "F32")
        yield {"F32": f32, **{q: quantizer.submit(lambda q=q: quantize(f32.result(), tmp / f"smollm2-{q.lower()}.gguf",
                                                                       q, flags=FLAGS.get(q, ())))
                              for q in ("Q8_0", "Q4_K_M", "IQ4_NL")}}


@pytest.fixture(scope="module")
def files(made) -> dict[str, Path]:
    return {q: future.result() for q, future in made.items()}


def _serve_text(path: Path, log: Path, *extra: str) -> tuple[float, str, str]:
    """(mean log-probability per token of TEXT, a greedy answer, the server's log)."""
    # A generous heartbeat: two servers share the cores, and a loaded machine must not make one look hung.
    srv = start_server(log, ["--model", str(path), "--served-model-name", "m", "--log-level", "info",
                             "--engine-heartbeat-timeout", "120", *extra])
    try:
        with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=600) as c:
            r = c.completions.create(model="m", prompt=TEXT, max_tokens=0, echo=True, logprobs=1)
            lps = r.choices[0].logprobs.token_logprobs[1:]  # the first token has no context
            answer = c.completions.create(model="m", prompt="The capital of France is", max_tokens=4,
                                          temperature=0.0).choices[0].text
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    assert len(lps) > 150 and all(lp is not None and lp <= 0 for lp in lps)
    return sum(lps) / len(lps), answer, log.read_text(errors="replace")


# Each case: (file, extra serve flags). Two servers start at a time: on two
# cores their start-ups (imports, loading: one core each) overlap, where one
# after another they were most of this module's time. In this order, each
# as soon as its file is made.
CASES = {"F32": ("F32", ()), "Q8_0": ("Q8_0", ()), "Q4_K_M": ("Q4_K_M", ()),
         "none": ("Q8_0", ("--quantization", "none")), "IQ4_NL": ("IQ4_NL", ())}


@pytest.fixture(scope="module")
def served(made, tmp_path_factory) -> dict[str, tuple[float, str, str]]:
    logs = tmp_path_factory.mktemp("logs")
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(lambda f=f, name=name, extra=extra:
                                     _serve_text(made[f].result(), logs / f"{name}.log", *extra))
                   for name, (f, extra) in CASES.items()}
        return {name: fut.result() for name, fut in futures.items()}


@pytest.fixture(scope="module")
def float_mean(files, served) -> float:
    mean, answer, log = served["F32"]
    assert "Paris" in answer
    assert _kept(log, files["F32"])[::2] == (0, False)  # F32 tensors are plain floats
    print(f"float model: {mean:.4f} nats per token")
    return mean


@pytest.mark.parametrize("qtype", list(BOUNDS))
def test_quantized_file_keeps_the_float_models_quality(files, served, float_mean, qtype):
    mean, answer, log = served[qtype]
    print(f"{qtype}: {mean:.4f} nats per token, float {float_mean:.4f}: {mean - float_mean:+.4f}")
    # No --quantization: the file's blocks are served (every linear layer and the tied vocabulary).
    kept, total, vocab = _kept(log, files[qtype])
    assert kept == total and vocab
    assert abs(mean - float_mean) <= BOUNDS[qtype]
    assert answer.strip()


def test_expanded_on_request(served, float_mean):
    """``--quantization none`` expands the same Q8_0 file to float: no blocks, the same text's quality."""
    mean, _, log = served["none"]
    assert KEPT not in log
    assert abs(mean - float_mean) <= BOUNDS["Q8_0"]


def test_iq_types_are_dequantized_at_load_in_one_line(served):
    _, answer, log = served["IQ4_NL"]
    lines = [line for line in log.splitlines() if "have no native kernel: dequantized at load" in line]
    assert len(lines) == 1 and "IQ4_NL" in lines[0], log[-3000:]
    assert answer.strip()
