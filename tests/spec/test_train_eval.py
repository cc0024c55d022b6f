"""``kvferry train-draft`` ends with the head's acceptance on held-out chat
conversations (never trained on), printed and saved in head.json."""
from __future__ import annotations

import json

import torch

from kvferry.cli import main
from kvferry.spec.head import EagleHead
from kvferry.train.draft_head import HELD_OUT_CHATS, corpus_prompts, features_of, head_loss, held_out_chats
from tests.tiny_models import make_tiny_checkpoint


def test_held_out_chats_are_never_trained_on():
    def texts(prompts: list) -> set[str]:  # long enough that two conversations do not share one by chance
        return {t for p in prompts if len(t := json.dumps(p)) > 150}

    held, trained = texts(held_out_chats(HELD_OUT_CHATS)), texts(corpus_prompts("chitchat", 2000, seed=0))
    assert len(held) > 80 and len(trained) > 600
    assert not held & trained
    # the same conversations every time: the figure is comparable across heads
    assert held_out_chats(8) == held_out_chats(8)


def test_train_draft_prints_the_held_out_acceptance_last(tmp_path, capsys):
    target = str(make_tiny_checkpoint(tmp_path, arch="llama", max_position_embeddings=1024))
    out = tmp_path / "head"
    assert main(["train-draft", "--target", target, "--corpus", "chitchat", "--out", str(out),
                 "--num-prompts", "4", "--max-tokens", "8", "--epochs", "1", "--batch-tokens", "16",
                 "--intermediate-size", "16", "--eval-prompts", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("held-out chat acceptance: ") and "k = 4" in lines[-1]
    report = json.loads((out / "head.json").read_text())
    assert 0.0 <= report["held_out_chat_acceptance"] <= 1.0 and report["held_out_chat_prompts"] == 4
    assert f"{100 * report['held_out_chat_acceptance']:.1f}%" in lines[-1]
    assert report["held_out_chat_mean_accepted_length"] >= 1.0


def _one_sequence(n: int = 8, hidden_size: int = 8, vocab: int = 16):
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (n,)).tolist()
    return features_of([(ids, 2)], [torch.randn(n, hidden_size)]), torch.randn(vocab, hidden_size)


def test_head_loss_unrolls_its_own_drafts_up_to_the_sequence_end():
    """Training-time test: each further step reads the head's own previous
    output, so a step-3 loss reaches the weights through three heads; a
    chain whose positions run past its sequence stops there."""
    feats, table = _one_sequence()
    head = EagleHead(8, 16)
    early, last = torch.tensor([2]), torch.tensor([6])  # answer positions 2..7; 6 is the second-to-last
    two, three = (head_loss(head, table, table, feats, early, steps) for steps in (2, 3))
    assert three > two  # the third step adds its own KL and smooth-L1
    # from position 6 a third step would read position 8: past the end, not scored
    assert torch.equal(head_loss(head, table, table, feats, last, 3), head_loss(head, table, table, feats, last, 2))
    soft = head_loss(head, table, table, feats, early, 3)
    assert head_loss(head, table, table, feats, early, 3, hard_weight=1.0) > soft  # the argmax cross-entropy


def test_train_draft_records_the_recipe(tmp_path):
    target = str(make_tiny_checkpoint(tmp_path, arch="llama", max_position_embeddings=1024))
    out = tmp_path / "head"
    assert main(["train-draft", "--target", target, "--corpus", "chitchat", "--out", str(out),
                 "--num-prompts", "4", "--max-tokens", "8", "--epochs", "1", "--batch-tokens", "16",
                 "--intermediate-size", "16", "--eval-prompts", "0", "--ttt-steps", "3",
                 "--hard-label-weight", "0.5"]) == 0
    report = json.loads((out / "head.json").read_text())
    assert report["ttt_steps"] == 3 and report["hard_label_weight"] == 0.5


def test_data_cache_generates_once_and_trains_as_the_whole_sequences(tmp_path, capsys):
    """--data-cache: the second run generates nothing and reads the replies
    and hidden states back; the cut-down cached sequences give the same
    training positions, inputs and targets as the whole ones."""
    from kvferry.engine.llm import LLM
    from kvferry.train.draft_head import build_features, self_distill

    target = str(make_tiny_checkpoint(tmp_path, arch="llama", max_position_embeddings=1024))
    args = ["train-draft", "--target", target, "--corpus", "chitchat", "--num-prompts", "3", "--max-tokens", "8",
            "--epochs", "1", "--batch-tokens", "16", "--intermediate-size", "16", "--eval-prompts", "0",
            "--data-cache", str(tmp_path / "cache")]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert "data cache: chunk-00000.safetensors (3 prompts) written" in capsys.readouterr().out
    (chunk,) = (tmp_path / "cache").glob("*/chunk-00000.safetensors")
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    assert "written" not in capsys.readouterr().out
    # the same data: both heads are trained identically (same seed)
    a, b = (EagleHead.load(tmp_path / x / "head.safetensors") for x in "ab")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))

    from kvferry.train.data_cache import DataCache  # what the cache holds vs the uncached path
    llm = LLM(model=target, max_num_seqs=4, kv_cache_memory_gb=0.05)
    prompts = corpus_prompts("chitchat", 3, 0)
    sequences = self_distill(llm, prompts, 8)
    whole = build_features(llm.engine.core.loaded.model, sequences)
    cache = DataCache.__new__(DataCache)
    cache.root = chunk.parent
    data = cache.load(3)
    assert data.sequences == sequences
    cut = features_of(data.trimmed, data.hidden)
    assert torch.equal(whole.hidden[whole.starts - 1], cut.hidden[cut.starts - 1])
    assert torch.equal(whole.hidden[whole.starts], cut.hidden[cut.starts])
    assert torch.equal(whole.tokens[whole.starts], cut.tokens[cut.starts])
    assert torch.equal(whole.ends[whole.starts] - whole.starts, cut.ends[cut.starts] - cut.starts)


def test_prompt_offset_gives_the_prompts_past_the_first(capsys):
    """--prompt-offset K: the prompts a run over the first K + num gives
    last (so disjoint from a run over the first K, and from the held-out
    conversations); a negative offset is refused."""
    import pytest

    first, more = corpus_prompts("chitchat", 300, seed=0), corpus_prompts("chitchat", 340, seed=0)
    past = corpus_prompts("chitchat", 40, seed=0, offset=300)
    assert len(past) == 40 and past == more[len(first):]
    def texts(prompts: list) -> set[str]:  # long enough that two conversations do not share one by chance
        return {t for p in prompts if len(t := json.dumps(p)) > 150}

    assert texts(past) and not texts(past) & texts(first)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        corpus_prompts("chitchat", 4, seed=0, offset=-1)
    with pytest.raises(SystemExit):
        main(["train-draft", "--out", "unused", "--prompt-offset", "-1"])
    assert "--prompt-offset: must be >= 0, got -1" in capsys.readouterr().err


def test_data_cache_at_an_offset_never_reads_the_replies_to_other_prompts(tmp_path, capsys):
    """A cache filled at offset 0 and one at offset 3 share --data-cache:
    the offset run generates its own replies (its chunk 0 holds other
    prompts than the offset-0 chunk 0), and a chunk read back for other
    prompts than it recorded is an error, not wrong training data."""
    import pytest

    from kvferry.train.data_cache import DataCache

    target = str(make_tiny_checkpoint(tmp_path, arch="llama", max_position_embeddings=1024))
    args = ["train-draft", "--target", target, "--corpus", "chitchat", "--num-prompts", "3", "--max-tokens", "8",
            "--epochs", "1", "--batch-tokens", "16", "--intermediate-size", "16", "--eval-prompts", "0",
            "--data-cache", str(tmp_path / "cache")]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "b"), "--prompt-offset", "3"]) == 0
    assert "data cache: chunk-00000.safetensors (3 prompts) written" in capsys.readouterr().out
    assert json.loads((tmp_path / "b" / "head.json").read_text())["prompt_offset"] == 3
    at0, at3 = sorted((tmp_path / "cache").glob("*/chunk-00000.safetensors"), key=lambda p: "-from3-" in p.parent.name)
    assert "-from3-" in at3.parent.name and at0.parent != at3.parent
    first, past = corpus_prompts("chitchat", 3, 0), corpus_prompts("chitchat", 3, 0, offset=3)
    for chunk, right, wrong in ((at0, first, past), (at3, past, first)):
        cache = DataCache.__new__(DataCache)
        cache.root = chunk.parent
        assert len(cache.load(3, right).sequences) == 3
        assert len(cache.load(2, right[:2]).sequences) == 2
        with pytest.raises(ValueError, match="other prompts than this run's"):
            cache.load(3, wrong)
    # the recorded replies are the target's to those prompts: the prompt ids differ
    a0, a3 = (DataCache.__new__(DataCache) for _ in range(2))
    a0.root, a3.root = at0.parent, at3.parent
    assert [s for s, _ in a0.load(3).sequences] != [s for s, _ in a3.load(3).sequences]
