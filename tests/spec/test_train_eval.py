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
