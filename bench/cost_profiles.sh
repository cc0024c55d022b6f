#!/usr/bin/env bash
# Cost per useful token from this machine's own profiles: two "hardware"
# (an engine with 1 torch thread at 0.04/h, one with 2 at 0.08/h: price
# linear in vCPUs), each profiled in process, then `kvferry plan` prices
# colocated, disagg and mixed-hardware layouts at several rates, SLOs and lengths.
# Run it on a quiet machine: a busy one gives poor fits (plan refuses them).
#
# Usage: bench/cost_profiles.sh [OUT_DIR]     (default docs/benchmarks/cost)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/benchmarks/cost}
KV=.venv/bin/kvferry
mkdir -p "$OUT"
echo "cpu: $(grep -o -w 'avx2\|avx512f\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')  $(date -u '+%Y-%m-%d %H:%M UTC')  load: $(cut -d' ' -f1-3 /proc/loadavg)"
for threads in 1 2; do
  name=$([ "$threads" = 1 ] && echo profile-1-thread.json || echo profile-2-threads.json)
  $KV profile --threads "$threads" --new-tokens 32,64,128,256 --cached-tokens 0,128 --batch-sizes 1,2,4,8 \
    --context-lens 128 --decode-steps 4 --repeats 3 --output "$OUT/$name"
done
echo "load after profiling: $(cut -d' ' -f1-3 /proc/loadavg)"
# rate, SLO, input and output tokens: light loads (every layout holds them:
# the cheapest wins), a tight TPOT (prefill steps delay a colocated core's
# decode), long prompts (prefill wants threads, decode hardly gains from them).
for case in "0.25 ttft:2000,tpot:150 256 32" "1 ttft:2000,tpot:150 256 32" "2 ttft:1000,tpot:20 256 128" \
            "4 ttft:1000,tpot:20 256 128" "1.5 ttft:1500,tpot:25 1024 128" "1 ttft:1000,tpot:25 1024 256"; do
  set -- $case
  echo "### rate $1 req/s, SLO $2, $3 -> $4 tokens"
  $KV plan --hardware "cpu1=$OUT/profile-1-thread.json:0.04" --hardware "cpu2=$OUT/profile-2-threads.json:0.08" \
    --workload random --input-len "$3" --output-len "$4" --num-requests 60 --rate "$1" --slo "$2" --gpus 3 \
    --output "$OUT/plan-$1-${2//[:,]/-}-$3-$4" | tail -25
done
