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
# JOBS (default 2), LCP_AMX=OFF to build without llama.cpp's AMX path (its
# tile code traps on some VMs that report AMX): then the ISA is listed from
# /proc/cpuinfo instead of -march=native, which would enable AMX whatever the
# GGML_AMX_* options say; WORK (the download and build folder).
# The build runs under `nice -n 19`: it takes long on a small shared machine.
set -euo pipefail

PREFIX=${1:-/work/llama.cpp}
JOBS=${JOBS:-2}
WORK=${WORK:-/tmp/lcp}
PY=${PYTHON:-python3}
AMX=${LCP_AMX:-native}

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

# GGML_NATIVE: the build machine's ISA (AVX-512, VNNI, AMX where present), as
# kvferry's kernels are built. LCP_AMX=OFF: the same ISA but AMX, named flag by flag.
if [ "$AMX" = OFF ]; then
  flags=$(grep -m1 '^flags' /proc/cpuinfo)
  isa=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
              avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if grep -qw "${pair%%:*}" <<<"$flags"; then isa+=("-DGGML_${pair##*:}=ON"); else isa+=("-DGGML_${pair##*:}=OFF"); fi
  done
else
  isa=(-DGGML_NATIVE=ON)
fi
nice -n 19 cmake -S "$llama" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  "${isa[@]}" -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
  -DCMAKE_INSTALL_PREFIX="$PREFIX"
nice -n 19 cmake --build "$WORK/build" -j "$JOBS" --target llama-server llama-bench llama-quantize
mkdir -p "$PREFIX/bin"
for t in llama-server llama-bench llama-quantize; do
  install -m 755 "$WORK/build/bin/$t" "$PREFIX/bin/$t"
done
"$PREFIX/bin/llama-server" --version 2>&1 | head -2 || true
echo "installed into $PREFIX/bin (export KVFERRY_LLAMA_CPP_BIN=$PREFIX/bin)"
