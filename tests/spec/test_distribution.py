"""Speculation must not change what sampling draws from.

Over N seeded requests, the second output token (the first one a draft can
stand for) must follow the target's exact marginal
``m = sum_t0 p0(t0) p1(. | t0)`` (computed with HF). The bound is stated,
not tuned: for an empirical distribution of N draws,
``E[TV] <= 1/2 sum_i sqrt(m_i (1 - m_i) / N)`` (Jensen), and TV moves by at
most 1/N per draw, so by McDiarmid ``P(TV > E[TV] + t) <= exp(-2 N t^2)``;
t = 0.06 at N = 1200 gives 2e-4.

The same bound rejects a deliberately biased verifier, built here by hand
from the real ngram proposer: it accepts every draft it is given (a
verifier that forgot to compare against the target's sample), so drafted
tokens come out too often.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.spec.ngram import propose_ngram
from tests.engine.hf_reference import load_hf
from tests.tiny_models import make_tiny_checkpoint

NUM_SAMPLES = 1200
SLACK = 0.06
K, MAX_N, MIN_N = 3, 4, 1


def tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def tv_bound(probs: np.ndarray, n: int) -> float:
    return 0.5 * float(np.sqrt(probs * (1 - probs) / n).sum()) + SLACK


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("dist"), arch="llama"))
    hf = load_hf(path)
    with torch.no_grad():  # sharpen the near-uniform random logits so drafts have a real chance
        hf.lm_head.weight.mul_(10.0)
    hf.save_pretrained(path, safe_serialization=True)
    vocab = hf.config.vocab_size
    rng = np.random.default_rng(3)
    base = rng.integers(3, vocab, 6).tolist() * 2
    with torch.inference_mode():
        likely = torch.softmax(hf(torch.tensor([base])).logits[0, -1], -1).topk(24).indices.tolist()
    # The likely first tokens, each once, so prompt lookup finds most first
    # outputs in the prompt and drafts what followed them.
    prompt = likely + base
    with torch.inference_mode():
        p0 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1).numpy()  # [V]
        batch = torch.tensor([prompt + [t] for t in range(vocab)])  # [V, len + 1]
        p1 = torch.softmax(hf(batch).logits[:, -1].double(), -1).numpy()  # [V, V]: row t0
    return path, prompt, p0, p1


def biased_samples(prompt, p0, p1, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    vocab = len(p0)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        t0 = rng.choice(vocab, p=p0)
        drafts = propose_ngram(prompt + [int(t0)], K, MAX_N, MIN_N)
        # Bug on purpose: the draft is taken without looking at the target.
        out[i] = drafts[0] if drafts else rng.choice(vocab, p=p1[t0])
    return out


def test_speculative_sampling_matches_the_target_within_the_tv_bound(target):
    path, prompt, p0, p1 = target
    marginal = p0 @ p1  # [V]
    bound = tv_bound(marginal, NUM_SAMPLES)
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": MAX_N,
            "prompt_lookup_min": MIN_N, "adaptive": False, "batch_token_threshold": 10**6}
    llm = LLM(model=path, dtype="float32", speculative=spec, max_num_seqs=256, num_kv_blocks=1024)
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(NUM_SAMPLES)]
    outs = llm.generate([prompt] * NUM_SAMPLES, params)
    stats = llm.engine.stats()
    # Drafts were really verified at the measured position, and some accepted.
    assert stats.num_drafts >= NUM_SAMPLES // 5
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    counts = np.bincount([o.token_ids[1] for o in outs], minlength=len(marginal)).astype(float)
    spec_tv = tv(counts, marginal)

    biased = np.bincount(biased_samples(prompt, p0, p1, NUM_SAMPLES, seed=1), minlength=len(marginal)).astype(float)
    biased_tv = tv(biased, marginal)
    print(f"TV bound {bound:.3f}: speculative {spec_tv:.3f}, biased verifier {biased_tv:.3f}")
    assert spec_tv < bound, f"speculative TV {spec_tv:.3f} >= bound {bound:.3f}"
    assert biased_tv > bound, f"the bound cannot tell a biased verifier: TV {biased_tv:.3f} <= {bound:.3f}"
