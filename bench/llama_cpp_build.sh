#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-quantize from the
# llama-cpp-python sdist on PyPI (it vendors llama.cpp in vendor/llama.cpp),
# for kvferry's comparison tests and benches. A dev tool only: kvferry never
# needs llama.cpp to run, and the tests that do skip where it is absent.
#
#   bench/llama_cpp_build.sh [PREFIX]        # default PREFIX: /work/llama.cpp
#   export KVFERRY_LLAMA_CPP_BIN=PREFIX/bin  # where the tests and benches look
#
# Environment: PYTHON (one with pip, for the download; default python3),
# LCP_VERSION (a llama-cpp-python version, default: the newest),
# JOBS (default 2), LCP_AMX=ON to build llama.cpp's AMX path (off by default:
# it traps on some VMs that report AMX), WORK (the download and build folder).
# The build runs under `nice -n 19`: it takes long on a small shared machine.
set -euo pipefail

PREFIX=${1:-/work/llama.cpp}
JOBS=${JOBS:-2}
WORK=${WORK:-/tmp/lcp}
PY=${PYTHON:-python3}
AMX=${LCP_AMX:-OFF}

mkdir -p "$WORK"
spec="llama-cpp-python${LCP_VERSION:+==$LCP_VERSION}"
if ! ls "$WORK"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  "$PY" -m pip download "$spec" --no-binary :all: --no-deps -d "$WORK"
fi
sdist=$(ls -t "$WORK"/llama_cpp_python-*.tar.gz | head -1)
src="$WORK/$(basename "$sdist" .tar.gz)"
[ -d "$src" ] || tar -xzf "$sdist" -C "$WORK"
llama="$src/vendor/llama.cpp"
[ -f "$llama/CMakeLists.txt" ] || { echo "no vendored llama.cpp in $sdist" >&2; exit 1; }

# GGML_NATIVE: the build machine's ISA (AVX-512, VNNI), as kvferry's kernels
# are built. AMX off unless asked: its tile setup traps on VMs that hide it.
amx_flags=(-DGGML_AMX_TILE=$AMX -DGGML_AMX_INT8=$AMX -DGGML_AMX_BF16=$AMX)
nice -n 19 cmake -S "$llama" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON "${amx_flags[@]}" \
  -DCMAKE_INSTALL_PREFIX="$PREFIX"
nice -n 19 cmake --build "$WORK/build" -j "$JOBS" --target llama-server llama-bench llama-quantize
mkdir -p "$PREFIX/bin"
for t in llama-server llama-bench llama-quantize; do
  install -m 755 "$WORK/build/bin/$t" "$PREFIX/bin/$t"
done
"$PREFIX/bin/llama-server" --version 2>&1 | head -2 || true
echo "installed into $PREFIX/bin (export KVFERRY_LLAMA_CPP_BIN=$PREFIX/bin)"
