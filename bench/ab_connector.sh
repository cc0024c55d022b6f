#!/usr/bin/env bash
# The A/B that guards a redesign with no change in behaviour: a baseline
# commit against this tree, interleaved run by run, on four paths:
#   1. offline throughput (bench/offline_throughput.py, kvferry only: the
#      baseline is a variant of the same run with PYTHONPATH at its sources);
#   2. `vllm bench serve` at concurrency 16, colocated (bench/ab_serve.sh);
#   3. the same, prefill/decode disaggregated 1+1, one CPU each;
#   4. KV tier resume and decode with write-down (each tree's own
#      bench/tiers_resume.py).
# Usage: bench/ab_connector.sh BASE_COMMIT [RUNS]     (RUNS default 3)
# Env:   OUT=bench/results/ab_connector, THREADS=2
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?usage: bench/ab_connector.sh BASE_COMMIT [RUNS]}
RUNS=${2:-3}
THREADS=${THREADS:-2}
OUT=${OUT:-bench/results/ab_connector}
PY=.venv/bin/python
mkdir -p "$OUT"
BASE_DIR=$(mktemp -d)
trap 'rm -rf "$BASE_DIR"' EXIT
git archive "$BASE" src bench | tar -x -C "$BASE_DIR"
echo "base=$BASE this=$(git rev-parse --short HEAD)$(git diff --quiet || echo +dirty) threads=$THREADS" \
     "cpu: $(grep -o -w 'avx2\|avx512f\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')" | tee "$OUT/header.txt"

echo "== 1. offline throughput"
PYTHONPATH="$PWD/src" $PY bench/offline_throughput.py --systems kvferry --runs "$RUNS" --threads "$THREADS" \
    --kvferry-env "base:PYTHONPATH=$BASE_DIR/src" 2>&1 | tee "$OUT/offline.txt" | grep -E "^run|tok_s|ratio" || true

echo "== 2. vllm bench serve, c16, colocated"
CONCURRENCY=16 OUT="$OUT/serve" THREADS=$THREADS bash bench/ab_serve.sh "$BASE" "$RUNS" | grep "^run"

echo "== 3. vllm bench serve, c16, disaggregated 1+1"
CONCURRENCY=16 OUT="$OUT/disagg" THREADS=1 \
  SERVE_ARGS="--mode disagg --prefill 1 --decode 1 --prefill-cpus 0 --decode-cpus 1" \
  bash bench/ab_serve.sh "$BASE" "$RUNS" | grep "^run"

echo "== 4. KV tiers: resume TTFT from DRAM, decode with write-down"
for run in $(seq 1 "$RUNS"); do
  for side in base this; do
    if [ "$side" = base ]; then dir=$BASE_DIR; else dir=$PWD; fi
    PYTHONPATH="$dir/src" OMP_NUM_THREADS=$THREADS $PY "$dir/bench/tiers_resume.py" --rounds 2 \
      > "$OUT/tiers_${side}_run$run.jsonl" 2> "$OUT/tiers_${side}_run$run.log" || echo "tiers $side run $run failed"
    echo "run $run $side: $(grep -h '"figure"' "$OUT/tiers_${side}_run$run.jsonl" | tr '\n' ' ')"
  done
done
