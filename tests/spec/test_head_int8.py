"""The draft head's int8 weights (``KVFERRY_DRAFT_HEAD_INT8``, on by default
on the CPU), with the committed head on the embedded SmolLM2-135M: greedy
output is plain decoding's, paths and trees alike; the int8 head's drafts
are the float head's nearly everywhere and its logits are close to them
(wrong scales, rows or activations would not be); ``KVFERRY_DRAFT_HEAD_INT8=0``
keeps the float head."""
from __future__ import annotations

import pytest
import torch

from kvferry import LLM, SamplingParams, envs
from kvferry.model import int8_gemm
from kvferry.spec.head import EMBEDDED_HEAD, EagleHead, HeadProposer
from kvferry.train.draft_head import hidden_states

pytestmark = pytest.mark.skipif(not EMBEDDED_HEAD.is_file() or not int8_gemm.available(),
                                reason="needs the committed head and the C++ int8 matmul")

CHATS = [[{"role": "user", "content": text}] for text in (
    "Hi! How are you doing today?",
    "What is your favourite season of the year, and why?",
    "Can you tell me a short story about a cat who learns to swim?",
    "I just got back from a long hike in the mountains. Any tips for sore legs?",
    "What should I cook for dinner tonight? I have rice, eggs and some vegetables.",
    "Do you like music? I have been learning the guitar for a month.",
)]
MAX_NEW = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
ENGINE = {"dtype": "float32", "warm_up": False, "kv_cache_memory_gb": 0.3}


@pytest.fixture(scope="module")
def plain():
    llm = LLM(**ENGINE)
    outs = llm.chat(CHATS, GREEDY)
    yield llm, [list(o.outputs[0].token_ids) for o in outs], [o.prompt_token_ids for o in outs]
    llm.engine.core.close()


@pytest.mark.parametrize("tree", [False, True], ids=["paths", "trees"])
def test_greedy_with_the_int8_head_is_plain_decoding(plain, tree, monkeypatch):
    monkeypatch.delenv(envs.DRAFT_HEAD_INT8, raising=False)
    spec = {"method": "head", "num_speculative_tokens": 4, "adaptive": False, "cost_aware": False,
            "batch_token_threshold": 10**6, "draft_tree": tree}
    llm = LLM(speculative=spec, **ENGINE)
    try:
        drafter = llm.engine.core.runner.drafter
        assert drafter.int8 and drafter.lm_head.weight.shape == (8192, 576)
        outs = llm.chat(CHATS, GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == plain[1]
        stats = llm.engine.stats()
        # The committed head's drafts are accepted about 40% of the time on chat (docs/speculative.md).
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0.2 * stats.num_draft_tokens, stats
    finally:
        llm.engine.core.close()


def test_the_int8_head_drafts_what_the_float_head_drafts(plain, monkeypatch):
    """At every position of plain decoding's replies, depth 1 (the target's
    hidden state) and depth 2 (the head's own prediction, the token after
    following the target's), the int8 head's logits over the draft
    vocabulary against the head's in float32: top-1 the same nearly
    everywhere, and close in norm."""
    llm, replies, prompts = plain
    model = llm.engine.core.runner.model
    head = EagleHead.load(EMBEDDED_HEAD)
    monkeypatch.delenv(envs.DRAFT_HEAD_INT8, raising=False)
    q = HeadProposer(head, model, tree=True)
    monkeypatch.setenv(envs.DRAFT_HEAD_INT8, "0")
    f = HeadProposer(head, model, tree=True)
    assert q.int8 and not f.int8 and not hasattr(f.lm_head.weight, "qweight")
    lm_head = model.lm_head.detach().float()[head.draft_vocab]  # [D, H]
    agree, total, errors = 0, 0, []
    with torch.inference_mode():
        for prompt, reply in zip(prompts, replies):
            tokens = torch.tensor(prompt + reply)
            pos = torch.arange(len(prompt) - 1, len(tokens) - 2)
            states = {"ref": hidden_states(model, tokens.tolist())[pos], "q": None}
            states["q"] = states["ref"]
            for depth in (1, 2):
                nxt = tokens[pos + depth]
                ref_state = head.float()(model.embed_tokens.detach().float()[nxt], states["ref"])
                ref = ref_state @ lm_head.t()
                q_state = q._step(nxt, states["q"])
                logits = q._logits(q_state)
                errors.append(float((logits - ref).norm() / ref.norm()))
                agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
                total += len(pos)
                states = {"ref": ref_state, "q": q_state}
    # Measured: 97% of top-1 drafts the same, logits within 1-3% (every
    # matmul int8, fc too: 87-91% and 9-19%; bf16: 98% and 0.4%).
    assert agree >= 0.93 * total, (agree, total)
    assert max(errors) < 0.06, errors
