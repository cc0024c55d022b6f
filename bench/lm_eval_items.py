"""Write the items of bench/lm_eval_task (lm-eval's local multiple-choice
task) as JSON Lines: the same items bench/loglikelihood.py scores, from the
same local corpus, so that lm-eval needs no dataset download.

    python bench/lm_eval_items.py --out bench/results/lm_eval/items.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loglikelihood import build_items, sentences  # noqa: E402  (bench/ is not a package)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--items", type=int, default=50)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    name, corpus = sentences()
    items = build_items(corpus, args.items, args.choices, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for context, choices, label in items:
            f.write(json.dumps({"context": context, "choices": choices, "label": label}) + "\n")
    print(f"{len(items)} items x {args.choices} choices from {name} -> {out}")


if __name__ == "__main__":
    main()
