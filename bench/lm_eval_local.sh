#!/usr/bin/env bash
# lm-eval itself against kvferry, offline: a local multiple-choice
# loglikelihood task (bench/lm_eval_task, items from the local corpus of
# bench/loglikelihood.py) through lm-eval's `local-completions` model
# (token-id prompts in batches, echo + logprobs) on `kvferry serve` of the
# embedded model, then lm-eval's `hf` model on the same HF folder (the
# embedded GGUF's converted folder), both float32; prints both accuracies
# and the largest per-choice loglikelihood difference.
#
#   bench/lm_eval_local.sh        (PORT=18124, LMEVAL_VENV=/work/lmeval-venv)
#
# lm-eval lives in its own venv, never a kvferry dependency:
#   python3 -m venv /work/lmeval-venv && /work/lmeval-venv/bin/pip install "lm-eval[hf,api]"
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-18124}
LMEVAL=${LMEVAL_VENV:-/work/lmeval-venv}/bin/lm_eval
PY=${PYTHON:-.venv/bin/python}
BATCH=${BATCH:-16}  # prompts per completions request (lm-eval batches loglikelihood requests)
OUT=bench/results/lm_eval
TASK=kvferry_local_mc
MODEL_NAME=SmolLM2-135M-Instruct  # the embedded model's served name
# Offline: the task reads a local file, both models a local folder.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_CACHE=$PWD/$OUT/hf_datasets_cache
export TQDM_DISABLE=1  # no progress bars in the log

mkdir -p "$OUT"
rm -rf "$OUT/kvferry" "$OUT/hf"
MODEL_DIR=$("$PY" -c "from kvferry.model.gguf_convert import convert_gguf, embedded_gguf_path; print(convert_gguf(embedded_gguf_path()))")
"$PY" bench/lm_eval_items.py --out "$OUT/items.jsonl"

"$PY" -m kvferry.cli serve --dtype float32 --port "$PORT" --no-warm-up --disable-uvicorn-access-log \
    > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
until "$PY" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
    sleep 1
done

start=$(date +%s)
"$LMEVAL" --model local-completions \
    --model_args "model=$MODEL_NAME,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$MODEL_DIR,num_concurrent=1,max_retries=1" \
    --batch_size "$BATCH" --tasks "$TASK" --include_path bench/lm_eval_task --log_samples --output_path "$OUT/kvferry"
echo "kvferry (local-completions): $(( $(date +%s) - start )) s"

start=$(date +%s)
"$LMEVAL" --model hf --model_args "pretrained=$MODEL_DIR,dtype=float32" --device cpu --batch_size 1 \
    --tasks "$TASK" --include_path bench/lm_eval_task --log_samples --output_path "$OUT/hf"
echo "transformers (hf): $(( $(date +%s) - start )) s"

"$PY" bench/lm_eval_compare.py "$OUT/kvferry" "$OUT/hf"
