#!/usr/bin/env bash
# A newcomer's first answer: `git clone`, `make serve` from nothing (a new
# .venv, an empty kernel and model cache), then the first completion.
# Prints each step of make serve's own announcements with its seconds.
#
# Usage: bench/fresh_clone.sh [REPO] [PORT]     (default: this checkout, 8765)
#        MAKE_ARGS="STRUCTURED=no" bench/fresh_clone.sh ...   (more make variables)
set -euo pipefail
REPO=${1:-$(cd "$(dirname "$0")/.." && pwd)}
PORT=${2:-8765}
WORK=$(mktemp -d /tmp/fresh-clone-XXXX)
export KVFERRY_CACHE_DIR=$WORK/cache
LOG=$WORK/make-serve.log
now() { date +%s.%N; }
echo "cpu: $(grep -o -w 'avx2\|avx512f\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ') load: $(cut -d' ' -f1-3 /proc/loadavg)  $(date -u '+%Y-%m-%d %H:%M UTC')"
T0=$(now)
git clone -q "$REPO" "$WORK/kvferry"
T_CLONE=$(now)
cd "$WORK/kvferry"
# Each output line stamped with the seconds since the clone ended.
( make serve PORT="$PORT" ${MAKE_ARGS:-} 2>&1 | while IFS= read -r line; do
    printf '%8.1f %s\n' "$(echo "$(now) - $T_CLONE" | bc)" "$line"; done ) > "$LOG" &
MAKE_PID=$!
until curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}' \
    -o "$WORK/answer.json" 2>/dev/null; do
  kill -0 $MAKE_PID 2>/dev/null || { echo "make serve ended before answering: $LOG" >&2; tail -30 "$LOG" >&2; exit 1; }
  sleep 1
done
T_ANSWER=$(now)
echo "git clone: $(echo "$T_CLONE - $T0" | bc) s"
grep -E '==> |kvferry serve: ready' "$LOG" | cut -c1-140
echo "first answer at: $(echo "$T_ANSWER - $T_CLONE" | bc) s after the clone"
echo "fresh clone to first answer: $(echo "$T_ANSWER - $T0" | bc) s"
cat "$WORK/answer.json"; echo
echo "venv: $(du -sh .venv | cut -f1) ($(du -s --block-size=1M .venv | cut -f1) MiB)"
# The server retitles itself ("kvferry: api-server"): found as make's
# descendant, not by its command line. SIGTERM is its clean stop.
descendants() { local c; for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done; }
for pid in $(descendants $MAKE_PID); do
  case "$(ps -o args= -p "$pid" 2>/dev/null)" in "kvferry: api-server"*) kill -TERM "$pid" ;; esac
done
wait $MAKE_PID 2>/dev/null || true
echo "work folder: $WORK (remove it when done)"
