"""Compare sittings of bench/validate_simulator.py run with the same
arguments (so the same request lists): how much the real runs themselves
move from one sitting to the next, and the simulator's error against that.

    python bench/validation_sittings.py runs/simval-a runs/simval-b [...] [--calibrated] [--output FILE.md]

For each (run, metric) measured in every sitting: the relative standard
deviation of the measured value over the sittings, and, per sitting, the
mean absolute error of its prediction against its own run, of its
prediction against the mean of all sittings' runs, and of that mean
against its own run (what a predictor that knew the real system's average
would score against one sitting). Sittings whose arguments differ are
refused.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvferry.plan.validate import sittings_comparison, sittings_table  # noqa: E402

# Arguments that change the request lists or the servers; the rest (paths, probe size) may differ.
SAME = ("configs", "rates_shared", "rates_random", "num_requests", "slo", "input_len", "output_len",
        "system_prompt_len", "question_len", "num_groups", "num_kv_blocks", "block_size",
        "max_num_batched_tokens", "max_num_seqs", "model")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", help="validate_simulator.py output folders (validation.json in each)")
    p.add_argument("--calibrated", action="store_true", help="compare the speed-calibrated rows instead")
    p.add_argument("--output", default=None, help="also write the tables to this markdown file")
    args = p.parse_args()
    sittings, first = {}, None
    for d in args.dirs:
        path = Path(d) / "validation.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
        same = {k: data["args"].get(k) for k in SAME}
        if first is not None and same != first[1]:
            diff = [k for k in SAME if same[k] != first[1][k]]
            print(f"error: {d} was run with other arguments than {first[0]} ({', '.join(diff)})", file=sys.stderr)
            return 2
        first = first or (d, same)
        sittings[Path(d).name] = data["calibrated_rows" if args.calibrated else "rows"]
    try:
        table = sittings_table(sittings_comparison(sittings))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table)
    if args.output:
        Path(args.output).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
