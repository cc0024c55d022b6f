"""The ``train-draft`` subcommand's arguments (light: torch loads when it runs)."""
from __future__ import annotations

import argparse
from pathlib import Path

CORPORA = ("chitchat", "bible", "pydoc")


def add_train_parser(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    p = sub.add_parser("train-draft", help="train an EAGLE-style draft head by self-distillation")
    p.add_argument("--target", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--corpus", choices=CORPORA, default="chitchat",
                   help="chitchat (PyPI chitchat-dataset), bible (Debian bible-kjv), pydoc (Debian python3.11-doc)")
    p.add_argument("--out", required=True, type=Path, help="folder for head.safetensors and head.json")
    p.add_argument("--num-prompts", type=_positive, default=256)
    p.add_argument("--prompt-offset", type=_non_negative, default=0,
                   help="train on the corpus's prompts past its first N (chitchat: the conversations N .. N + "
                        "--num-prompts of the shuffled order), the same prompts a run of N + --num-prompts gives "
                        "last: more replies for a head trained on the first N without generating those again")
    p.add_argument("--max-tokens", type=_positive, default=96, help="answer length per prompt")
    p.add_argument("--epochs", type=_positive, default=3)
    p.add_argument("--batch-tokens", type=_positive, default=256, help="positions per optimizer step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--intermediate-size", type=_positive, default=576, help="the head's MLP width")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="draft over the N ids most frequent in the target's answers (0: the whole vocabulary)")
    p.add_argument("--eval-prompts", type=_non_negative, default=64,
                   help="held-out chat conversations (never trained on) the finished head drafts for; its "
                        "acceptance is printed last and saved in head.json (0: skip)")
    p.add_argument("--arch", choices=("head", "eagle3"), default="head",
                   help="head: the feature-regression head over the top hidden state; eagle3: an EAGLE-3 head "
                        "(low, middle and top layers fused, one attention layer, training-time test on the "
                        "target's own replies), saved as a folder in the format vLLM loads")
    p.add_argument("--ttt-steps", type=_positive, default=4,
                   help="draft steps unrolled in training, each after the first reading the head's own previous "
                        "output (training-time test)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="eagle3: temperature of the target's replies it learns from (0: greedy)")
    p.add_argument("--max-train-seconds", type=float, default=0.0,
                   help="eagle3: stop the optimizer after this many seconds (0: run every epoch)")
    p.add_argument("--pack-tokens", type=_positive, default=1024,
                   help="eagle3: positions per optimizer step (whole conversations packed together)")
    p.add_argument("--hard-label-weight", type=float, default=0.0,
                   help="weight of a cross-entropy on the target's argmax, added to the loss on its distribution "
                        "(what greedy verification keeps; helps where the target's distribution is flat)")
    p.add_argument("--data-cache", type=Path, default=None,
                   help="head: keep the target's replies and hidden states in this folder and reuse them "
                        "(generated once per target, corpus, seed and --max-tokens; a larger --num-prompts "
                        "generates only the missing replies)")
    p.add_argument("--init-head", type=Path, default=None,
                   help="head: start from this head file's weights and draft vocabulary instead of a random head "
                        "(more epochs or more replies without starting over; its sizes must match the target "
                        "and --intermediate-size)")
    p.add_argument("--eval-each-epoch", action="store_true",
                   help="head: save the head after every epoch (epoch-N.safetensors in --out) and print its "
                        "held-out chat acceptance (--eval-prompts conversations)")
    p.add_argument("--lr-schedule", choices=("one-cycle", "cosine", "linear"), default="one-cycle",
                   help="head: the learning rate over the run: one-cycle (a warm-up from --lr / 25 to --lr over "
                        "the first 30%%, then an anneal), or cosine or linear (from --lr on the first step down to "
                        "0, no warm-up: for continuing a head with --init-head)")
    p.add_argument("--ttt-discount", type=_number_in_unit_interval, default=1.0,
                   help="head: the loss of unrolled step i (0-based, of --ttt-steps) counts this to the power i "
                        "(below 1: the early draft steps, on which the later ones depend, weigh more)")
    p.add_argument("--hidden-loss-weight", type=_non_negative_number, default=0.1,
                   help="head: weight of the smooth-L1 pull of the head's output toward the target's hidden "
                        "state, added to the KL on its token distribution (0: the KL alone)")
    p.add_argument("--ema", type=_ema_decay_number, default=0.0,
                   help="head: save an exponential moving average of the weights with this decay per optimizer "
                        "step (e.g. 0.99) instead of the last weights (0: the last weights)")
    p.set_defaults(func=_cmd_train)


HEAD_RECIPE_DEFAULTS = {"lr_schedule": "one-cycle", "ttt_discount": 1.0, "hidden_loss_weight": 0.1, "ema": 0.0}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _number_in_unit_interval(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _non_negative_number(text: str) -> float:
    value = float(text)
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _ema_decay_number(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (0: off), got {value}")
    return value


def _cmd_train(args: argparse.Namespace) -> int:
    if args.arch == "eagle3":
        for flag, value in (("--init-head", args.init_head), ("--eval-each-epoch", args.eval_each_epoch)):
            if value:  # the EAGLE-3 trainer has neither: refused rather than silently ignored
                raise ValueError(f"{flag} is for --arch head only")
        for name, default in HEAD_RECIPE_DEFAULTS.items():
            if getattr(args, name) != default:
                raise ValueError(f"--{name.replace('_', '-')} is for --arch head only")
        from kvferry.train.eagle3 import run_from_args as run_eagle3  # lazy, as below

        return run_eagle3(args)
    from kvferry.train.draft_head import run_from_args  # lazy: torch (~1.5 s) loads only when training runs

    return run_from_args(args)
