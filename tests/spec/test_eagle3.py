"""EAGLE-3 heads through the real engine (tiny checkpoints): a checkpoint in
the format vLLM loads (config.json naming LlamaForCausalLMEagle3, weights
midlayer.* / fc / norm / lm_head / d2t / t2d), written here with random
weights at the shape a real one has for its target, loads for
``{"method": "eagle3", "model": PATH}`` and keeps greedy output HF-exact
across batch mixes, chunked prefill and preemption; a checkpoint made for
another target is refused naming the tensor and both shapes; ``kvferry
train-draft --arch eagle3`` trains one the target accepts."""
from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import save_file

from kvferry import LLM, SamplingParams
from kvferry.cli import main
from kvferry.spec.eagle3 import Eagle3Head
from kvferry.train.draft_head import corpus_prompts
from tests.serve.server_process import SERVE_ARGS, start_server
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.spec.test_engine import repetitive_prompts
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def write_eagle3_checkpoint(folder: Path, target_hidden: int, vocab: int, *, hidden: int | None = None,
                            heads: int = 4, kv_heads: int = 2, intermediate: int = 96, draft_vocab: int | None = None,
                            layer_prefix: str = "midlayer", embed: bool = False, seed: int = 0) -> Path:
    """A checkpoint laid out as published EAGLE-3 heads are (e.g. the
    yuhuili/EAGLE3-LLaMA3.1-Instruct-8B folder vLLM loads), random weights."""
    hidden = hidden or target_hidden
    draft_vocab = draft_vocab or vocab // 2
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16)

    draft_ids = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    p = layer_prefix
    tensors = {
        f"{p}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        f"{p}.hidden_norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        f"{p}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        f"{p}.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        f"{p}.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        f"{p}.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        f"{p}.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        f"{p}.mlp.gate_proj.weight": w(intermediate, hidden),
        f"{p}.mlp.up_proj.weight": w(intermediate, hidden),
        f"{p}.mlp.down_proj.weight": w(hidden, intermediate),
        "fc.weight": w(hidden, 3 * target_hidden),
        "norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": w(draft_vocab, hidden),
        "d2t": draft_ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    if embed:
        tensors["embed_tokens.weight"] = w(vocab, hidden)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": vocab,
              "draft_vocab_size": draft_vocab, "target_hidden_size": target_hidden, "hidden_act": "silu",
              "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = str(make_tiny_checkpoint(root, arch="llama", max_position_embeddings=1024, num_hidden_layers=6))
    hf = load_hf(target)
    c = hf.config
    head = write_eagle3_checkpoint(root / "eagle3", c.hidden_size, c.vocab_size)
    prompts = repetitive_prompts(c.vocab_size)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return target, str(head), hf, prompts, expected, root


def run(target, head, prompts, params=GREEDY, method="eagle3", **kwargs):
    spec = {"method": method, "model": head, "num_speculative_tokens": 3, "adaptive": False,
            "batch_token_threshold": 10**6}
    llm = LLM(model=target, dtype="float32", speculative=spec, **kwargs)
    return llm, llm.generate(prompts, params)


def check(hf, prompts, expected, results):
    for p, e, r in zip(prompts, expected, results):
        assert_greedy_match(hf, p, r.token_ids, e)


def test_a_published_layout_loads_at_its_shapes(case):
    target, head, hf, *_ = case
    loaded = Eagle3Head.load(head)
    c = hf.config
    assert loaded.fc.weight.shape == (c.hidden_size, 3 * c.hidden_size)
    assert loaded.lm_head.weight.shape == (c.vocab_size // 2, c.hidden_size)
    ids = loaded.draft_ids()
    assert torch.equal(loaded.t2d.nonzero().flatten(), ids)  # d2t and t2d agree
    assert loaded.check_target(c.hidden_size, c.vocab_size, c.num_hidden_layers) == (2, 3, 3)


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 16},
                                    {"block_size": 8, "num_kv_blocks": 64, "enable_prefix_caching": False}],
                         ids=["batch", "chunked", "preempt"])
def test_greedy_is_hf_exact(case, kwargs):
    target, head, hf, prompts, expected, _ = case
    llm, results = run(target, head, prompts, **kwargs)
    check(hf, prompts, expected, results)
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > 0
    drafter = llm.engine.core.runner.drafter
    assert type(drafter).__name__ == "Eagle3Proposer"
    assert llm.engine.core.loaded.model.aux_layers == (2, 3, 3)
    if "num_kv_blocks" in kwargs:
        assert stats.num_preemptions > 0
    llm.engine.check_integrity()


def test_seeded_sampling_is_plain_seeded_sampling(case):
    """Sampling through an EAGLE-3 head's draft vocabulary keeps plain
    seeded sampling's tokens (drafts coupled to the target's noise)."""
    target, head, _, prompts, _, _ = case
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=s, ignore_eos=True) for s in range(len(prompts))]
    llm, sampled = run(target, head, prompts, params)
    plain = LLM(model=target, dtype="float32").generate(prompts, params)
    assert llm.engine.stats().num_draft_tokens > 0
    assert [r.token_ids for r in sampled] == [r.token_ids for r in plain]


def test_kvferry_serve_loads_it_by_vllms_flag(case, tmp_path):
    """``kvferry serve --speculative-config '{"method": "eagle3", "model":
    PATH}'`` (vLLM's spelling): the real server drafts with the checkpoint
    and answers the openai client with plain decoding's greedy tokens."""
    target, head, hf, prompts, expected, _ = case
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False, "cost_aware": False}
    srv = start_server(tmp_path / "server.log", ["--speculative-config", json.dumps(spec)],
                       serve_args=["--model", target, *SERVE_ARGS])
    try:
        with openai.OpenAI(base_url=srv.api_url, api_key="x", max_retries=0, timeout=300) as client:
            r = client.completions.create(model=client.models.list().data[0].id, prompt=prompts[0],
                                          max_tokens=MAX_NEW, temperature=0.0, extra_body={"ignore_eos": True})
        plain = LLM(model=target, dtype="float32", max_model_len=1024).generate([prompts[0]], GREEDY)[0]
        assert r.choices[0].text == plain.text
        assert_greedy_match(hf, prompts[0], plain.token_ids, expected[0])
        srv.wait_for_metric("kvferry:spec_decode_num_draft_tokens_total", lambda v: v > 0)
    finally:
        assert srv.stop() == 0, srv.log()[-5000:]


def test_speculators_layout_and_own_embedding_load(case, tmp_path):
    """``layers.0.*`` names (the speculators library's) and a head with its
    own embed_tokens: same engine path, output still exact."""
    target, _, hf, prompts, expected, _ = case
    c = hf.config
    head = write_eagle3_checkpoint(tmp_path / "spec", c.hidden_size, c.vocab_size, layer_prefix="layers.0",
                                   embed=True, draft_vocab=c.vocab_size, seed=1)
    llm, results = run(target, str(head), prompts[:2])
    check(hf, prompts[:2], expected[:2], results)
    assert llm.engine.core.runner.drafter.vocab is None  # the whole vocabulary


def test_a_head_for_another_target_is_refused_by_name(case, tmp_path):
    target, _, hf, *_ = case
    c = hf.config
    wrong = write_eagle3_checkpoint(tmp_path / "wide", 2 * c.hidden_size, c.vocab_size, hidden=c.hidden_size)
    with pytest.raises(ValueError, match=rf"fc\.weight has shape \[{c.hidden_size}, {6 * c.hidden_size}\].*"
                                         rf"needs \[{c.hidden_size}, {3 * c.hidden_size}\]"):
        LLM(model=target, dtype="float32", speculative={"method": "eagle3", "model": str(wrong)})
    vocab = write_eagle3_checkpoint(tmp_path / "vocab", c.hidden_size, c.vocab_size + 64)
    with pytest.raises(ValueError, match=rf"t2d has shape \[{c.vocab_size + 64}\].*needs \[{c.vocab_size}\]"):
        LLM(model=target, dtype="float32", speculative={"method": "eagle3", "model": str(vocab)})
    bad = write_eagle3_checkpoint(tmp_path / "bad", c.hidden_size, c.vocab_size)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 64  # the weights say 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"midlayer\.mlp\.\w+\.weight has shape \[(96, \d+|\d+, 96)\]; .*config\.json gives \[(64, \d+|\d+, 64)\]"):
        LLM(model=target, dtype="float32", speculative={"method": "eagle3", "model": str(bad)})
    # the engine keeps working after a refusal
    assert LLM(model=target, dtype="float32").generate([[1, 2, 3]], GREEDY)[0].token_ids


def test_train_draft_eagle3_makes_a_head_the_target_accepts(case, capsys):
    """Trained with training-time test on the target's own replies, the head
    drafts those replies (the text it was trained on: a random tiny target's
    text is learnt, not generalized) far better than an untrained one, which
    also shows the unrolled training computes what the engine drafts."""
    target, untrained, hf, prompts, expected, root = case
    out = root / "trained"
    assert main(["train-draft", "--arch", "eagle3", "--target", target, "--corpus", "chitchat", "--out", str(out),
                 "--num-prompts", "8", "--max-tokens", "24", "--epochs", "16", "--lr", "5e-3",
                 "--hard-label-weight", "1", "--intermediate-size", "64", "--draft-vocab-size", "0",
                 "--pack-tokens", "512", "--eval-prompts", "1"]) == 0
    printed = capsys.readouterr().out
    assert "held-out chat acceptance:" in printed and "mean accepted length" in printed
    report = json.loads((out / "head.json").read_text())
    assert report["arch"] == "eagle3" and report["ttt_steps"] == 4 and report["train_positions"] > 100
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    chats = corpus_prompts("chitchat", 8, 0)  # the training prompts (same seed)
    rates = {}
    for name, head in (("untrained", untrained), ("trained", str(out))):
        llm = LLM(model=target, dtype="float32",
                  speculative={"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False,
                               "cost_aware": False, "batch_token_threshold": 10**6})
        llm.chat(chats, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        s = llm.engine.stats()
        rates[name] = s.num_accepted_tokens / max(s.num_draft_tokens, 1)
    print(rates)
    assert rates["trained"] > max(0.2, 3 * rates["untrained"])
    # the trained head keeps greedy output exact, now with accepted drafts in the mix
    llm, results = run(target, str(out), prompts)
    check(hf, prompts, expected, results)
