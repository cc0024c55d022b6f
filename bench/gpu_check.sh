#!/usr/bin/env bash
# The CUDA checks, as one run on a GPU machine (from the repo root):
#   bash bench/gpu_check.sh [OUT_DIR]
# - the GPU tests: Triton kernels against the torch path, HF greedy
#   equivalence with CUDA graphs, eagerly and on torch's ops; the server
#   with its core on the GPU through the openai client;
# - bench/gpu_offline.py: kvferry against HF generate on the same GPU.
# A machine without the project's Python dependencies gets them from wheels
# in .whl/ (installed into /tmp/site), where that folder exists. A GPU machine
# with its own torch, Triton and transformers but no registry needed these
# (Python 3.12), fetched here with `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 ... -d .whl` at the
# versions of the project's venv: msgspec pyzmq pydantic pydantic-core
# annotated-types typing-inspection typing-extensions xgrammar apache-tvm-ffi
# setproctitle fastapi starlette uvicorn openai httpx2 httpcore2 jiter sniffio
# jsonschema referencing rpds-py jsonschema-specifications opentelemetry-api
# annotated-doc prometheus-client truststore anyio attrs click h11 idna.
set -u
OUT=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
else
  export PYTHONPATH=$PWD/src:$PWD
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  nproc; } 2>&1 | tee "$OUT/machine.txt"
timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -p no:cacheprovider --timeout 240 -rf \
  tests/model/test_triton_attention.py tests/engine/test_triton_backend.py tests/engine/test_cuda.py tests/serve/test_cuda_serve.py 2>&1 | tee "$OUT/tests.log"
timeout ${BENCH_TIMEOUT:-300} $PY bench/gpu_offline.py --budget-s ${BENCH_BUDGET:-200} ${BENCH_ARGS:-} \
  --json "$OUT/gpu_offline.json" 2>&1 | tee "$OUT/bench.log"
