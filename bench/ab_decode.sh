#!/usr/bin/env bash
# Interleaved A/B of bench/decode_roofline.py: a baseline commit against this
# tree, same script, same threads, alternating runs so that both see the same
# machine load. Prints one JSON summary line per run.
#
# Usage: bench/ab_decode.sh [BASE_COMMIT] [RUNS] [DTYPES...]
#   e.g. bench/ab_decode.sh 118781e 3 bfloat16 float32
#   THREADS=1 EXTRA=--cpu-time bench/ab_decode.sh ...   # CPU seconds per step, for a busy machine
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:-HEAD~1}
RUNS=${2:-3}
shift $(( $# > 2 ? 2 : $# )) || true
DTYPES=${*:-bfloat16 float32}
THREADS=${THREADS:-2}
PY=${PY:-python}
BASE_DIR=$(mktemp -d)
trap 'rm -rf "$BASE_DIR"' EXIT
git archive "$BASE" src | tar -x -C "$BASE_DIR"
for run in $(seq 1 "$RUNS"); do
  for dtype in $DTYPES; do
    for tree in "$BASE_DIR" "$PWD"; do
      name=$([ "$tree" = "$PWD" ] && echo this || echo "$BASE")
      result=$(PYTHONPATH="$tree/src" OMP_NUM_THREADS=$THREADS "$PY" bench/decode_roofline.py --dtype "$dtype" \
        --threads "$THREADS" --repeats "${REPEATS:-8}" --prefill-tokens "${PREFILL_TOKENS:-1024}" ${EXTRA:-} | tr -d '\n ')
      echo "run $run $name $result"
    done
  done
done
