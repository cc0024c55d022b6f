"""Compare two lm-eval runs of bench/lm_eval_task (``--log_samples``): the
accuracy of each and the per-choice loglikelihoods, item by item.

    python bench/lm_eval_compare.py OUT_DIR_A OUT_DIR_B

Each OUT_DIR is an lm-eval ``--output_path``; the newest
``samples_kvferry_local_mc_*.jsonl`` under it is read.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

TASK = "kvferry_local_mc"


def samples(out_dir: str) -> dict[int, dict]:
    files = sorted(Path(out_dir).rglob(f"samples_{TASK}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not files:
        sys.exit(f"no samples_{TASK}_*.jsonl under {out_dir} (run lm_eval with --log_samples)")
    rows = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
    return {row["doc_id"]: row for row in rows}


def loglikelihoods(row: dict) -> list[float]:
    """One (loglikelihood, is_greedy) response per choice."""
    return [float(resp[0]) for resp in row["filtered_resps"]]


def main() -> None:
    a_dir, b_dir = sys.argv[1:3]
    a, b = samples(a_dir), samples(b_dir)
    if a.keys() != b.keys():
        sys.exit(f"the runs scored different items: {len(a)} vs {len(b)}")
    diffs = [abs(x - y) for doc in a for x, y in zip(loglikelihoods(a[doc]), loglikelihoods(b[doc]), strict=True)]
    same_pick = sum(max(range(len(la := loglikelihoods(a[d]))), key=la.__getitem__)
                    == max(range(len(lb := loglikelihoods(b[d]))), key=lb.__getitem__) for d in a)
    for name, runs in ((a_dir, a), (b_dir, b)):
        print(f"{name}: accuracy {sum(r['acc'] for r in runs.values()) / len(runs):.4f} over {len(runs)} items")
    print(f"{len(diffs)} loglikelihoods: max |difference| {max(diffs):.2e}, mean {sum(diffs) / len(diffs):.2e}; "
          f"the same choice picked on {same_pick}/{len(a)} items")


if __name__ == "__main__":
    main()
