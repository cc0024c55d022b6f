#!/usr/bin/env bash
# Interleaved A/B of `kvferry serve` under vLLM's own client (`vllm bench
# serve`): a baseline commit against this tree, same model folder, dtype and
# threads, servers alternating run by run so that both see the same machine
# load. The client comes from the vLLM venv (see bench/vllm_bench_serve.sh
# for its install); only kvferry servers run here.
#
# Usage: bench/ab_serve.sh [BASE_COMMIT] [RUNS]
# Env:   THREADS=2, CONCURRENCY="16 64", NUM_PROMPTS=64, INPUT_LEN=256,
#        OUTPUT_LEN=64, VLLM_VENV=/work/vllm-venv, OUT=bench/results/ab_serve,
#        SERVE_ARGS="" (more `kvferry serve` flags for both, e.g. a disagg layout)
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:-HEAD~1}
RUNS=${2:-2}
THREADS=${THREADS:-2}
CONCURRENCY=${CONCURRENCY:-"16 64"}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-64}
VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
OUT=${OUT:-bench/results/ab_serve}
SERVE_ARGS=${SERVE_ARGS:-}
PY=.venv/bin/python
mkdir -p "$OUT"
BASE_DIR=$(mktemp -d)
trap 'rm -rf "$BASE_DIR"' EXIT
git archive "$BASE" src | tar -x -C "$BASE_DIR"
MODEL_DIR=$($PY -c "from kvferry.model.loader import load_model; print(load_model(None).model_path)")
DTYPE=${DTYPE:-$($PY -c "from kvferry.model.cpu_features import auto_cpu_dtype; print(str(auto_cpu_dtype()).removeprefix('torch.'))")}
echo "base=$BASE dtype=$DTYPE threads=$THREADS cpu: $(grep -o -w 'avx2\|avx512f\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"

serve_and_bench() {  # name, source tree, run
  PYTHONPATH="$2/src" OMP_NUM_THREADS=$THREADS $PY -m kvferry.cli serve --model "$MODEL_DIR" --dtype "$DTYPE" \
    --served-model-name smollm2 --port 8300 $SERVE_ARGS > "$OUT/$1_run$3_server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do
    curl -sf http://127.0.0.1:8300/health >/dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || { echo "server died: $OUT/$1_run$3_server.log" >&2; return 1; }
    sleep 1
  done
  for c in $CONCURRENCY; do
    "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url http://127.0.0.1:8300 --endpoint /v1/completions \
      --model smollm2 --tokenizer "$MODEL_DIR" --dataset-name random \
      --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --ignore-eos \
      --num-prompts "$NUM_PROMPTS" --max-concurrency "$c" --seed "$(( $3 * 1000 + c ))" \
      --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
      --save-result --result-dir "$OUT" --result-filename "$1_c${c}_run$3.json" > "$OUT/$1_c${c}_run$3.txt" 2>&1
    $PY - "$OUT/$1_c${c}_run$3.json" "$1" "$c" "$3" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"run {sys.argv[4]} {sys.argv[2]:>5} c{sys.argv[3]}: {r['output_throughput']:.1f} tok/s, "
      f"TTFT p50/p99 {r['p50_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} ms, TPOT p50/p99 {r['p50_tpot_ms']:.1f}/{r['p99_tpot_ms']:.1f} ms")
EOF
  done
  kill -TERM $pid; wait $pid || true
}

for run in $(seq 1 "$RUNS"); do
  serve_and_bench base "$BASE_DIR" "$run"
  serve_and_bench this "$PWD" "$run"
done
