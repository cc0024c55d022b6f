"""Method "head" through the real engine (tiny checkpoints): greedy output is
HF-exact across batch mixes, chunked prefill and preemption whatever the
head proposes; ``kvferry train-draft`` trains a head whose drafts the target
accepts far more often than an untrained one's; the committed head fits the
embedded model; bad paths are ValueErrors naming the field."""
from __future__ import annotations

import json

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.cli import main
from kvferry.spec.head import EMBEDDED_HEAD, EagleHead
from tests.engine.hf_reference import assert_greedy_match, hf_greedy, load_hf
from tests.spec.test_engine import repetitive_prompts
from tests.tiny_models import make_tiny_checkpoint

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("head")
    target = str(make_tiny_checkpoint(root, arch="llama", max_position_embeddings=1024))
    hf = load_hf(target)
    torch.manual_seed(0)
    untrained = root / "untrained.safetensors"
    EagleHead(hf.config.hidden_size, 64).save(untrained, target="random")
    prompts = repetitive_prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return target, str(untrained), hf, prompts, expected, root


def run(target, head, prompts, params=GREEDY, **kwargs):
    # k fixed whatever the batch (see test_draft_model's seeded test)
    spec = {"method": "head", "model": head, "num_speculative_tokens": 3, "adaptive": False,
            "batch_token_threshold": 10**6}
    llm = LLM(model=target, dtype="float32", speculative=spec, **kwargs)
    return llm, llm.generate(prompts, params)


def check(hf, prompts, expected, results):
    for p, e, r in zip(prompts, expected, results):
        assert_greedy_match(hf, p, r.token_ids, e)


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 16},
                                    {"block_size": 8, "num_kv_blocks": 64, "enable_prefix_caching": False}],
                         ids=["batch", "chunked", "preempt"])
def test_greedy_is_hf_exact(case, kwargs):
    target, head, hf, prompts, expected, _ = case
    llm, results = run(target, head, prompts, **kwargs)
    check(hf, prompts, expected, results)
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > 0
    if "num_kv_blocks" in kwargs:
        assert stats.num_preemptions > 0
    llm.engine.check_integrity()


def test_steps_without_drafts_run_no_head_and_copy_nothing(case):
    """Where no request drafts (here the batch threshold allows none), the
    head never runs, and its state is each request's row index into the
    step's own sampled hidden states: one tensor per step, no copies."""
    target, head, hf, prompts, expected, _ = case
    spec = {"method": "head", "model": head, "num_speculative_tokens": 3, "batch_token_threshold": 1}
    llm = LLM(model=target, dtype="float32", speculative=spec)
    drafter = llm.engine.core.runner.drafter
    proposed, shared = [], []
    propose, record_step = drafter.propose, drafter.record_step
    drafter.propose = lambda *args: proposed.append(args) or propose(*args)

    def record_and_check(hidden, rows):
        record_step(hidden, rows)
        shared.append(all(drafter._hidden[rid][0] is hidden for rid in rows))

    drafter.record_step = record_and_check
    check(hf, prompts, expected, llm.generate(prompts, GREEDY))
    assert proposed == [] and llm.engine.stats().num_draft_tokens == 0
    assert shared and all(shared)


def test_seeded_sampling_is_plain_seeded_sampling(case):
    """A seeded request's drafts are coupled to the target's own noise
    (draft_model.draw_drafts): its tokens are those of plain seeded sampling,
    run after run, whatever k the adaptive, cost-aware controller picks from
    step timings (the default config here), and whatever the batch."""
    target, head, _, prompts, _, _ = case
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=s, ignore_eos=True) for s in range(len(prompts))]
    spec = {"method": "head", "model": head, "num_speculative_tokens": 3}
    llm = LLM(model=target, dtype="float32", speculative=spec)
    first = llm.generate(prompts, params)
    again = LLM(model=target, dtype="float32", speculative=spec).generate(prompts, params)
    alone = LLM(model=target, dtype="float32", speculative=spec).generate(prompts[-1:], params[-1:])
    plain = LLM(model=target, dtype="float32").generate(prompts, params)
    assert llm.engine.stats().num_draft_tokens > 0
    assert [r.token_ids for r in first] == [r.token_ids for r in plain]
    assert [r.token_ids for r in again] == [r.token_ids for r in plain]
    assert alone[0].token_ids == plain[-1].token_ids


def test_a_draft_vocabulary_keeps_outputs_exact(case, tmp_path):
    """A head whose file carries a draft vocabulary drafts only those ids;
    greedy stays HF-exact and seeded sampling stays plain seeded sampling."""
    target, _, hf, prompts, expected, _ = case
    torch.manual_seed(0)
    head = EagleHead(hf.config.hidden_size, 64)
    head.draft_vocab = torch.arange(0, hf.config.vocab_size, 2)  # the even ids
    path = tmp_path / "vocab.safetensors"
    head.save(path, target="random")
    assert torch.equal(EagleHead.load(path).draft_vocab, head.draft_vocab)
    llm, results = run(target, str(path), prompts)
    check(hf, prompts, expected, results)
    drafted = llm.engine.core.runner.drafter
    assert drafted.lm_head.weight.shape == (hf.config.vocab_size // 2, hf.config.hidden_size)
    assert llm.engine.stats().num_draft_tokens > 0
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=s, ignore_eos=True) for s in range(len(prompts))]
    _, sampled = run(target, str(path), prompts, params)
    plain = LLM(model=target, dtype="float32").generate(prompts, params)
    assert [r.token_ids for r in sampled] == [r.token_ids for r in plain]


def test_drafts_from_a_draft_vocabulary_are_its_ids_and_q_sums_to_one():
    from kvferry.spec.draft_model import DraftRequest, DraftVocab, draw_drafts

    vocab = DraftVocab(torch.tensor([3, 7, 11, 20]), size=32)
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0], [2.0, 0.0, 0.0, 1.0]])  # [A=2, D=4]
    greedy = [DraftRequest(f"r{j}", j, 10, 1, SamplingParams(temperature=0.0)) for j in range(2)]
    assert draw_drafts(logits, greedy, 0, vocab) == ([7, 3], None)
    sampled = [DraftRequest("s", 0, 10, 1, SamplingParams(temperature=1.0)),
               DraftRequest("t", 1, 10, 1, SamplingParams(temperature=1.0, seed=5), num_output_tokens=2)]
    ids, q = draw_drafts(logits, sampled, 0, vocab)
    assert set(ids) <= {3, 7, 11, 20}
    assert q.shape == (2, 32)
    assert torch.allclose(q.sum(dim=-1), torch.ones(2))
    outside = torch.ones(32, dtype=torch.bool)
    outside[vocab.ids] = False
    assert q[:, outside].abs().sum() == 0


def test_train_draft_makes_a_head_the_target_accepts(case, capsys):
    target, untrained, hf, prompts, expected, root = case
    out = root / "trained"
    assert main(["train-draft", "--target", target, "--corpus", "chitchat", "--out", str(out),
                 "--num-prompts", "24", "--max-tokens", "24", "--epochs", "4", "--batch-tokens", "64",
                 "--intermediate-size", "64"]) == 0
    report = json.loads((out / "head.json").read_text())
    assert report["corpus"] == "chitchat" and report["train_positions"] > 200
    # Self-distilled drafts: on the target's own chat answers (the training
    # distribution) the trained head's drafts are accepted far more often.
    chat = [[{"role": "user", "content": "Hello! How are you today?"}], [{"role": "user", "content": "hi there"}]]
    rates = {}
    for name, head in (("untrained", untrained), (("trained"), str(out))):
        llm = LLM(model=target, dtype="float32",
                  speculative={"method": "head", "model": head, "num_speculative_tokens": 3, "adaptive": False})
        llm.chat(chat, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        s = llm.engine.stats()
        rates[name] = s.num_accepted_tokens / max(s.num_draft_tokens, 1)
    print(rates)
    assert rates["trained"] > max(0.04, 2 * rates["untrained"])


def test_the_committed_head_fits_the_embedded_model():
    if not EMBEDDED_HEAD.is_file():
        pytest.skip("no head committed for the embedded model")
    head = EagleHead.load(EMBEDDED_HEAD)
    assert head.hidden_size == 576  # SmolLM2-135M
    assert EMBEDDED_HEAD.stat().st_size < 8 * 2**20


def test_bad_head_paths_are_value_errors(case, tmp_path):
    target = case[0]
    with pytest.raises(ValueError, match=r"speculative\.model"):
        LLM(model=target, dtype="float32", speculative={"method": "head", "model": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match=r"speculative\.model"):  # the embedded head is for the embedded model
        LLM(model=target, dtype="float32", speculative={"method": "head"})
    wrong = tmp_path / "wrong.safetensors"
    EagleHead(32, 16).save(wrong, target="random")
    with pytest.raises(ValueError, match=r"speculative\.model"):
        LLM(model=target, dtype="float32", speculative={"method": "head", "model": str(wrong)})
