"""Ground truth: greedy continuations from Hugging Face transformers."""
from __future__ import annotations

import torch

TIE_TOLERANCE = 1e-4  # logits closer than this may legitimately flip under float error


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    ids = torch.tensor([prompt_ids])
    # eos_token_id=[]: run the full length like our ignore_eos, without
    # min_new_tokens (which would mask EOS and change the argmax).
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    generated = out[0, len(prompt_ids) :].tolist()
    assert len(generated) == max_new_tokens
    return generated


@torch.inference_mode()
def assert_greedy_match(model, prompt_ids: list[int], ours: list[int], theirs: list[int]) -> None:
    """Equal token for token, or diverging only where HF's own top-2 logits
    tie within TIE_TOLERANCE (then the rest cannot be compared)."""
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        logits = model(torch.tensor([prompt_ids + theirs[:i]])).logits[0, -1]
        gap = (logits[b] - logits[a]).abs().item()
        assert gap < TIE_TOLERANCE, f"diverged at token {i}: ours {a}, HF {b}, logit gap {gap:.3g}"
        return
