"""``kvferry train-draft --init-head PATH`` continues from a saved head (its
weights and its draft vocabulary) instead of a random one, so more epochs
or more replies do not start over; a head of other sizes is refused with
an error naming the flag. ``--eval-each-epoch`` saves and measures the
head after every epoch."""
from __future__ import annotations

import json

import pytest
import torch

from kvferry.cli import main
from kvferry.spec.head import EagleHead
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target, a cache of its replies, and a head trained on them
    (16 draft ids, MLP width 16)."""
    root = tmp_path_factory.mktemp("init_head")
    target = str(make_tiny_checkpoint(root, arch="llama", max_position_embeddings=1024))
    base = ["train-draft", "--target", target, "--corpus", "chitchat", "--max-tokens", "8", "--batch-tokens", "16",
            "--intermediate-size", "16", "--draft-vocab-size", "16", "--data-cache", str(root / "cache")]
    assert main([*base, "--out", str(root / "first"), "--num-prompts", "3", "--epochs", "1",
                 "--eval-prompts", "0"]) == 0
    return root, base, root / "first" / "head.safetensors"


def _weights(path) -> dict[str, torch.Tensor]:  # noqa: ANN001
    head = EagleHead.load(path)
    return {**head.state_dict(), "draft_vocab": head.draft_vocab}


def test_init_head_continues_from_the_head_and_keeps_its_vocabulary(tiny):
    root, base, first = tiny
    # At learning rate 0 the optimizer moves nothing: the result is the
    # starting head itself, and its draft vocabulary is the starting
    # head's, not the one this run's replies (more of them) would give.
    still = root / "still"
    assert main([*base, "--out", str(still), "--num-prompts", "6", "--epochs", "1", "--eval-prompts", "0",
                 "--lr", "0", "--init-head", str(first)]) == 0
    start, kept = _weights(first), _weights(still / "head.safetensors")
    assert all(torch.equal(start[k], kept[k]) for k in start)
    fresh = root / "fresh"
    assert main([*base, "--out", str(fresh), "--num-prompts", "6", "--epochs", "1", "--eval-prompts", "0",
                 "--lr", "0"]) == 0
    assert not torch.equal(_weights(fresh / "head.safetensors")["up.weight"], start["up.weight"])
    report = json.loads((still / "head.json").read_text())
    assert report["init_head"] == str(first) and report["num_prompts"] == 6
    # and it trains from there: more steps move the weights (a one-step
    # one-cycle schedule would run at its floor, 1e-4 of the top rate)
    more = root / "more"
    assert main([*base, "--out", str(more), "--num-prompts", "3", "--epochs", "2", "--eval-prompts", "0",
                 "--batch-tokens", "4", "--init-head", str(first)]) == 0
    moved = _weights(more / "head.safetensors")
    assert torch.equal(moved["draft_vocab"], start["draft_vocab"])
    assert not torch.equal(moved["up.weight"], start["up.weight"])


@pytest.mark.parametrize("change, expected", [
    (["--intermediate-size", "32"], "has MLP width 16, but --intermediate-size is 32"),
    (["--draft-vocab-size", "32"], "drafts over 16 ids (kept), but --draft-vocab-size is 32"),
])
def test_init_head_of_other_sizes_is_refused_naming_the_flag(tiny, change, expected):
    root, base, first = tiny
    with pytest.raises(ValueError, match="--init-head") as err:
        main([*base, "--out", str(root / "bad"), "--num-prompts", "3", "--eval-prompts", "0",
              "--init-head", str(first), *change])
    assert expected in str(err.value)


def test_init_head_for_another_hidden_size_or_not_a_head_is_refused(tiny):
    root, base, _ = tiny
    other = root / "other.safetensors"
    wide = EagleHead(128, 16)  # the tiny target's hidden size is not 128
    wide.draft_vocab = torch.arange(16)
    wide.save(other, target="another model")
    with pytest.raises(ValueError, match=r"--init-head .*other.safetensors has hidden size 128, but the target"):
        main([*base, "--out", str(root / "bad"), "--num-prompts", "3", "--eval-prompts", "0",
              "--init-head", str(other)])
    for path in (root / "missing.safetensors", root / "cache"):  # no file; a folder that is no head
        with pytest.raises(ValueError, match=f"--init-head {path}"):
            main([*base, "--out", str(root / "bad"), "--num-prompts", "3", "--eval-prompts", "0",
                  "--init-head", str(path)])


def test_eval_each_epoch_saves_and_measures_every_epoch(tiny, capsys):
    root, base, _ = tiny
    out = root / "each"
    assert main([*base, "--out", str(out), "--num-prompts", "3", "--epochs", "2", "--eval-prompts", "2",
                 "--eval-each-epoch"]) == 0
    printed = capsys.readouterr().out
    assert "after epoch 1: held-out chat acceptance: " in printed
    assert (out / "epoch-1.safetensors").is_file()
    per_epoch = json.loads((out / "head.json").read_text())["held_out_chat_per_epoch"]
    assert [e["epoch"] for e in per_epoch] == [1, 2]
    assert all(0.0 <= e["acceptance"] <= 1.0 and e["mean_accepted_length"] >= 1.0 for e in per_epoch)


@pytest.mark.parametrize("flag", [["--init-head", "/nonexistent/head.safetensors"], ["--eval-each-epoch"]])
def test_head_only_flags_are_refused_for_eagle3(tmp_path, flag):
    with pytest.raises(ValueError, match=f"{flag[0]} is for --arch head only"):
        main(["train-draft", "--arch", "eagle3", "--out", str(tmp_path / "e3"), *flag])
