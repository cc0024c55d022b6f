"""The recipe flags of ``kvferry train-draft`` (the plain head): the
learning-rate schedule (``--lr-schedule``: one-cycle, or a decay from --lr
with no warm-up for continuing a head), the weight of each unrolled step
(``--ttt-discount``), the weight of the hidden-state regression
(``--hidden-loss-weight``) and an average of the weights saved instead of
the last ones (``--ema``)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kvferry.cli import main
from kvferry.spec.head import EagleHead
from kvferry.train.draft_head import (TrainConfig, WeightAverage, features_of, head_loss, lr_scheduler,
                                      train)
from tests.tiny_models import make_tiny_checkpoint


def _rates(schedule: str, lr: float, total: int) -> list[float]:
    """The learning rate each of ``total`` optimizer steps runs at."""
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.0)
    sched = lr_scheduler(opt, schedule, lr, total)
    rates = []
    for _ in range(total):
        rates.append(opt.param_groups[0]["lr"])
        w.grad = torch.ones(2)
        opt.step()
        sched.step()
    return rates


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_schedules_start_at_the_given_rate_with_no_warm_up(schedule):
    rates = _rates(schedule, 1e-3, 20)
    assert rates[0] == pytest.approx(1e-3)  # the first step already at --lr
    assert all(b < a for a, b in zip(rates, rates[1:]))  # falling all the way
    assert 0.0 < rates[-1] <= 1e-3 / 20 + 1e-12  # down to about 0 by the last step
    expected = (0.5 * (1 + math.cos(math.pi * 10 / 20)) if schedule == "cosine" else 1 - 10 / 20) * 1e-3
    assert rates[10] == pytest.approx(expected)


def test_one_cycle_still_warms_up():
    rates = _rates("one-cycle", 1e-3, 20)
    assert rates[0] == pytest.approx(1e-3 / 25)
    assert max(rates) == pytest.approx(1e-3) and rates.index(max(rates)) == 5  # 30% of the way


def _one_sequence(n: int = 10, hidden_size: int = 8, vocab: int = 16):
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (n,)).tolist()
    return features_of([(ids, 2)], [torch.randn(n, hidden_size)]), torch.randn(vocab, hidden_size)


def test_ttt_discount_weights_step_i_by_its_power():
    feats, table = _one_sequence()
    head = EagleHead(8, 16)
    t = torch.tensor([2, 3, 4])
    with torch.no_grad():
        upto = [head_loss(head, table, table, feats, t, steps) for steps in (1, 2, 3)]
        steps = [upto[0], upto[1] - upto[0], upto[2] - upto[1]]  # each step's own loss
        discounted = head_loss(head, table, table, feats, t, 3, discount=0.8)
    assert all(s > 0 for s in steps)
    assert discounted == pytest.approx(float(steps[0] + 0.8 * steps[1] + 0.64 * steps[2]), rel=1e-5)
    assert discounted < upto[2]


def test_hidden_loss_weight_scales_the_smooth_l1_term():
    feats, table = _one_sequence()
    head = EagleHead(8, 16)
    t = torch.tensor([2, 5])
    with torch.no_grad():
        kl_only, default, double = (head_loss(head, table, table, feats, t, 3, hidden_weight=w)
                                    for w in (0.0, 0.1, 0.2))
        assert torch.equal(default, head_loss(head, table, table, feats, t, 3))  # 0.1 stays the default
    assert kl_only < default < double
    assert float(double - default) == pytest.approx(float(default - kl_only), rel=1e-4)


def test_weight_average_follows_its_decay_with_a_short_warm_up():
    module = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(0.0)
    avg = WeightAverage(module, 0.5)
    expected = 0.0
    for n, value in enumerate([1.0, 2.0, 4.0, -1.0, 3.0, 0.5, 2.0, 1.0, 5.0, 7.0, -2.0, 6.0]):
        with torch.no_grad():
            module.weight.fill_(value)
        avg.update(module)
        d = min(0.5, (1 + n) / (10 + n))  # 0.1 at first: the start is soon forgotten
        expected = d * expected + (1 - d) * value
        assert float(avg.params["weight"]) == pytest.approx(expected)
    assert module.weight.item() == 6.0  # the module itself is left alone
    with pytest.raises(ValueError, match="--ema must be in"):
        WeightAverage(module, 1.0)


def test_weight_average_head_keeps_the_draft_vocabulary():
    head = EagleHead(8, 16)
    head.draft_vocab = torch.arange(4)
    avg = WeightAverage(head, 0.9)
    start = {k: v.clone() for k, v in head.state_dict().items()}
    with torch.no_grad():
        for p in head.parameters():
            p.add_(1.0)
    averaged = avg.averaged(head)
    assert torch.equal(averaged.draft_vocab, head.draft_vocab)
    assert all(torch.equal(averaged.state_dict()[k], start[k]) for k in start)  # no update yet: the start
    avg.update(head)  # the first update weighs the weights 0.9 (its decay 0.1)
    assert all(torch.allclose(avg.averaged(head).state_dict()[k], start[k] + 0.9, atol=1e-6) for k in start)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target, a cache of its replies, and a head trained on them."""
    root = tmp_path_factory.mktemp("recipe")
    target = str(make_tiny_checkpoint(root, arch="llama", max_position_embeddings=1024))
    base = ["train-draft", "--target", target, "--corpus", "chitchat", "--max-tokens", "8",
            "--intermediate-size", "16", "--draft-vocab-size", "16", "--data-cache", str(root / "cache"),
            "--num-prompts", "3", "--epochs", "1", "--eval-prompts", "0"]
    assert main([*base, "--out", str(root / "first"), "--batch-tokens", "16"]) == 0
    return root, base, root / "first" / "head.safetensors"


def _weights(path) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return EagleHead.load(path).state_dict()


def test_continuing_with_a_decay_schedule_takes_a_full_first_step(tiny):
    """One optimizer step from the given head: Adam's first step moves each
    weight by about the step's learning rate, --lr itself under cosine,
    --lr / 25 under one-cycle (its warm-up)."""
    root, base, first = tiny
    start = _weights(first)
    moved = {}
    for schedule in ("cosine", "one-cycle"):
        out = root / schedule
        assert main([*base, "--out", str(out), "--batch-tokens", "4096", "--lr", "0.01", "--init-head", str(first),
                     "--lr-schedule", schedule]) == 0
        moved[schedule] = (_weights(out / "head.safetensors")["up.weight"] - start["up.weight"]).abs().median()
        assert json.loads((out / "head.json").read_text())["lr_schedule"] == schedule
    assert float(moved["cosine"]) == pytest.approx(0.01, rel=0.05)
    assert float(moved["one-cycle"]) < 0.001


def test_ema_saves_the_average_and_the_recipe_is_recorded(tiny):
    root, base, first = tiny
    common = [*base, "--batch-tokens", "4", "--lr", "0.01", "--init-head", str(first)]
    assert main([*common, "--out", str(root / "last")]) == 0
    assert main([*common, "--out", str(root / "ema"), "--ema", "0.9", "--ttt-discount", "0.8",
                 "--hidden-loss-weight", "0", "--lr-schedule", "linear"]) == 0
    last, ema = (_weights(root / x / "head.safetensors") for x in ("last", "ema"))
    assert not torch.equal(last["up.weight"], ema["up.weight"])
    report = json.loads((root / "ema" / "head.json").read_text())
    assert (report["ema"], report["ttt_discount"], report["hidden_loss_weight"], report["lr_schedule"]) == (
        0.9, 0.8, 0.0, "linear")
    default = json.loads((root / "last" / "head.json").read_text())
    assert (default["ema"], default["ttt_discount"], default["hidden_loss_weight"], default["lr_schedule"]) == (
        0.0, 1.0, 0.1, "one-cycle")


@pytest.mark.parametrize("flag", [["--ttt-discount", "0"], ["--ttt-discount", "1.5"], ["--ema", "1"],
                                  ["--ema", "-0.1"], ["--hidden-loss-weight", "-1"], ["--lr-schedule", "step"]])
def test_bad_recipe_flags_are_refused(tmp_path, flag, capsys):
    with pytest.raises(SystemExit):
        main(["train-draft", "--out", str(tmp_path / "x"), *flag])
    assert flag[0] in capsys.readouterr().err


def test_bad_recipe_values_are_refused_before_anything_loads(tmp_path):
    for change, message in ((dict(lr_schedule="step"), "--lr-schedule must be one of"),
                            (dict(ttt_discount=0.0), "--ttt-discount must be in"),
                            (dict(hidden_loss_weight=-0.1), "--hidden-loss-weight must be >= 0"),
                            (dict(ema=1.0), "--ema must be in")):
        cfg = TrainConfig(target="/nonexistent/model", corpus="chitchat", out=tmp_path / "x", **change)
        with pytest.raises(ValueError, match=message):
            train(cfg)


@pytest.mark.parametrize("flag", [["--ema", "0.99"], ["--ttt-discount", "0.8"], ["--hidden-loss-weight", "0"],
                                  ["--lr-schedule", "cosine"]])
def test_head_recipe_flags_are_refused_for_eagle3(tmp_path, flag):
    with pytest.raises(ValueError, match=f"{flag[0]} is for --arch head only"):
        main(["train-draft", "--arch", "eagle3", "--out", str(tmp_path / "e3"), *flag])
