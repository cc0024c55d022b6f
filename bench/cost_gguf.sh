#!/usr/bin/env bash
# The cost lens for a quantized file: one GGUF file profiled twice on the
# same hardware at the same price, in its blocks (the file's own format, e.g.
# Q4_K_M) and expanded to bf16 (`--quantization none --dtype bfloat16`), then
# `kvferry plan` prices each format's best layout at several rates and SLOs.
# plan never pairs pools of different formats: it ranks each format's
# layouts and prints their costs side by side.
# Run it on a quiet machine: a busy one gives poor fits (profile warns and
# records them in the JSON's quality).
#
# Usage: bench/cost_gguf.sh FILE.gguf [OUT_DIR] [THREADS]
#        (default OUT_DIR docs/benchmarks/cost-gguf, THREADS 2, price 0.08/h)
# "blocks" is the file's own format kept in memory (Q4_K/Q6_K as their
# packed panels by default, the same bits).
set -euo pipefail
cd "$(dirname "$0")/.."
FILE=${1:?a .gguf file}
OUT=${2:-docs/benchmarks/cost-gguf}
THREADS=${3:-2}
KV=.venv/bin/kvferry
mkdir -p "$OUT"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) ($(grep -o -w 'avx2\|avx512f\|avx512_vnni\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '))  $(date -u '+%Y-%m-%d %H:%M UTC')  load: $(cut -d' ' -f1-3 /proc/loadavg)"
GRID=(--threads "$THREADS" --new-tokens 64,128,256,512 --cached-tokens 0,256 --batch-sizes 1,2,4,8,16
      --context-lens 256 --decode-steps 4 --repeats 3 --kv-cache-memory-gb 1)
$KV profile --model "$FILE" "${GRID[@]}" --output "$OUT/profile-blocks.json"
$KV profile --model "$FILE" --quantization none --dtype bfloat16 "${GRID[@]}" --output "$OUT/profile-bf16.json"
echo "load after profiling: $(cut -d' ' -f1-3 /proc/loadavg)"
# rate, SLO, input and output tokens: a light load, a batch-1 TPOT bound
# (the blocks read fewer bytes a step), and a heavier load with longer prompts.
for case in "0.05 ttft:5000,tpot:150 256 64" "0.2 ttft:5000,tpot:100 256 64" "0.3 ttft:8000,tpot:200 512 128"; do
  set -- $case
  echo "### rate $1 req/s, SLO $2, $3 -> $4 tokens"
  $KV plan --hardware "blocks=$OUT/profile-blocks.json:0.08" --hardware "bf16=$OUT/profile-bf16.json:0.08" \
    --workload random --input-len "$3" --output-len "$4" --num-requests 40 --rate "$1" --slo "$2" --gpus 2 \
    --output "$OUT/plan-$1-${2//[:,]/-}-$3-$4" | tail -25
done
