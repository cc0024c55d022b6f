"""Sampled first tokens on a real (tiny) model follow softmax(logits / T).

Test: Pearson chi-square goodness of fit of the observed counts of the first
sampled token, over 3000 seeded requests, against softmax(HF logits / T);
tokens with expected count < 5 are pooled into one bin. The test fails when
p < 1e-3 (a correct sampler fails about once in a thousand runs; the seeds
are fixed, so a given run is reproducible).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import load_hf
from tests.tiny_models import make_tiny_checkpoint

NUM_SAMPLES = 3000


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_first_token_frequencies_match_softmax(tmp_path, temperature):
    path = str(make_tiny_checkpoint(tmp_path, arch="llama"))
    prompt = [5, 17, 33, 2 + 40, 90, 11]
    hf = load_hf(path)
    # Sharpen the random model's near-uniform logits (scale its untied
    # lm_head) so that the test has power, and save it for both engines.
    assert not hf.config.tie_word_embeddings
    with torch.no_grad():
        hf.lm_head.weight.mul_(2.0)
    hf.save_pretrained(path, safe_serialization=True)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double()
    probs = torch.softmax(logits / temperature, -1).numpy()

    llm = LLM(model=path, dtype="float32", max_num_seqs=256, num_kv_blocks=512)
    params = [SamplingParams(max_tokens=1, temperature=temperature, seed=s) for s in range(NUM_SAMPLES)]
    outs = llm.generate([prompt] * NUM_SAMPLES, params)
    counts = np.bincount([o.token_ids[0] for o in outs], minlength=len(probs)).astype(float)

    expected = probs * NUM_SAMPLES
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    p = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert p > 1e-3, f"chi-square p={p:.2g} over {len(obs)} bins"
    assert len(obs) >= 10, "too few bins for a meaningful test"
