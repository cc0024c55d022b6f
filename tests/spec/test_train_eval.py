"""``kvferry train-draft`` ends with the head's acceptance on held-out chat
conversations (never trained on), printed and saved in head.json."""
from __future__ import annotations

import json

from kvferry.cli import main
from kvferry.train.draft_head import HELD_OUT_CHATS, corpus_prompts, held_out_chats
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
