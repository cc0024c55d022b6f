// W8A8 int8 matmul, y[M, N] = x[M, K] @ W^T, W kept as int8 with one float scale per output row.
//
// gemm(x, w, w_scale, w_sum) -> y
//   x: [M, K] float32 or bf16; each row is quantized here, once per call, to
//      symmetric int8 with its own scale (dynamic per-token: d = max|x| / 127)
//   w: [N, K] int8 (symmetric, -127..127), w_scale: [N] float32, w_sum: [N] int32
//      (sum of each row's int8 values: the VNNI path's offset, see below)
//   y: [M, N] float32 = (sum_k xq[m, k] * w[n, k]) * d[m] * w_scale[n]
// path() -> "avx512vnni" | "avxvnni" | "avx2" | "none" (gemm throws on "none")
//
// One u8 x s8 integer dot product per 32 (AVX-512: 64) values:
// - VNNI (vpdpbusd, AVX512-VNNI on 512-bit registers or AVX-VNNI on 256):
//   x is stored as xq + 128 (unsigned, 1..255) and the dot sums u8 x s8 into
//   32 bits without saturation; the +128 adds 128 * sum_k w[n, k], which
//   w_sum takes off once per output.
// - AVX2 (vpmaddubsw + vpmaddwd): pairs of u8 x s8 products are summed into
//   16 bits and would saturate with x + 128, so the weight's |w| is the
//   unsigned operand and its sign moves onto x (vpsignb): |pair| <= 2 * 127 * 127
//   fits. No offset.
// The integer sum is exact (|sum| <= K * 255 * 127 < 2^31 for K <= 65536), so
// the result differs from the float product of the dequantized operands only
// by float32 rounding of the two scales' product.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVI8_PATH "avx512vnni"
#define KVI8_VNNI 1
constexpr int kStep = 64;
using Vec = __m512i;
inline Vec vzero() { return _mm512_setzero_si512(); }
inline Vec vload(const void* p) { return _mm512_loadu_si512(p); }
inline Vec vdot(Vec acc, Vec u, Vec s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline int32_t vsum(Vec v) { return _mm512_reduce_add_epi32(v); }
#elif defined(__AVX2__)
constexpr int kStep = 32;
using Vec = __m256i;
inline Vec vzero() { return _mm256_setzero_si256(); }
inline Vec vload(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline int32_t vsum(Vec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
#if defined(__AVXVNNI__)
#define KVI8_PATH "avxvnni"
#define KVI8_VNNI 1
inline Vec vdot(Vec acc, Vec u, Vec s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define KVI8_PATH "avx2"
inline Vec vdot(Vec acc, Vec u, Vec s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif
#else
#define KVI8_PATH "none"
#endif

#ifdef KVI8_VNNI
constexpr int kOffset = 128;  // x is stored unsigned, xq + 128
#else
constexpr int kOffset = 0;
#endif

// The activations: per row, K int8 values (stored as uint8 xq + kOffset) and the scale.
struct Acts {
  std::vector<uint8_t> q;
  std::vector<float> d;
};

Acts quantize_rows(const float* x, int64_t M, int64_t K) {
  Acts a{std::vector<uint8_t>(M * K), std::vector<float>(M)};
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xs = x + m * K;
      float amax = 0;
      for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(xs[k]));
      const float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
      uint8_t* q = a.q.data() + m * K;
      for (int64_t k = 0; k < K; ++k) q[k] = uint8_t(int(std::nearbyint(xs[k] * id)) + kOffset);
      a.d[m] = d;
    }
  });
  return a;
}

#define KVI8_UNROLL _Pragma("GCC unroll 4")

// A register tile: R rows of x against C weight rows, R * C accumulators.
// Each x vector is loaded once for C weight rows and each weight vector once
// for R rows, so a k-step moves R + C vectors for R * C dot products (one row
// of x against one weight row moved 2 for 1, and read all of x from L2 once
// per weight row: 10x slower at 64 rows). AVX-512 has 32 registers: 4 x 4;
// AVX2 / AVX-VNNI have 16 (and AVX2 keeps |w| beside w): 4 x 2.
constexpr int MR = 4;
#if defined(KVI8_VNNI) && defined(__AVX512F__)
constexpr int NR = 4;
#else
constexpr int NR = 2;
#endif

// The weight is one contiguous stream (blocks of NR rows, in order), read
// once per call at a few rows: the first pass over each block (m0 == 0)
// prefetches the stream kAhead bytes ahead of its loads, one line per 64
// bytes loaded (a block's row c, byte k prefetches the byte kAhead past it:
// every line once). Without it a few-row call read cold weights at about
// half the rate of small_gemm's prefetched bf16 stream and took as long
// for half the bytes. Measured on Zen 5 (one thread, 2 cores loaded, CPU ms
// of a draft head's four matmuls, 576 x 1152, 3072 x 576, 576 x 1536 and
// 8192 x 576, the caches flushed before each; bench/draft_head_matmuls.py,
// medians of interleaved calls):
//   rows                          1      2      4      8
//   no prefetch                 0.68   0.82   0.83   1.57
//   kAhead 2 KiB                0.50   0.61   0.61   0.85
//   kAhead 8 KiB                0.45   0.51   0.48   0.69
//   kAhead 32 KiB (a 2nd run)   0.50          0.51
//   bf16, small_gemm            0.70   0.72   0.72   0.75
// (prefetcht1 instead of prefetcht0: 0.56-0.63 at 1-4 rows.) The same bits either way.
constexpr int64_t kAhead = 8192;

#if defined(__AVX2__)
// y[m0 + r, n0 + c] for r < R, c < C (xq' = xq + kOffset, so the integer sums are exact).
template <int R, int C>
void tile(const int8_t* W, int64_t n0, const Acts& a, int64_t m0, int64_t K, const float* S, const int32_t* WS,
          float* Y, int64_t N) {
  Vec acc[R][C];
  KVI8_UNROLL for (int r = 0; r < R; ++r) KVI8_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const uint8_t* X = a.q.data() + m0 * K;
  const int8_t* Wn = W + n0 * K;
  const int64_t kv = K / kStep * kStep;
  const bool prefetch = m0 == 0;  // later passes over the block read it from L1
  for (int64_t k = 0; k < kv; k += kStep) {
    Vec wv[C];
    KVI8_UNROLL for (int c = 0; c < C; ++c) wv[c] = vload(Wn + c * K + k);
    if (prefetch && (k & 63) == 0) {  // past the weight's end a prefetch reads nothing and never faults
      KVI8_UNROLL for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(Wn + c * K + k) + kAhead,
                                                          _MM_HINT_T0);
    }
#ifdef KVI8_VNNI
    KVI8_UNROLL for (int r = 0; r < R; ++r) {
      const Vec xv = vload(X + r * K + k);
      KVI8_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = vdot(acc[r][c], xv, wv[c]);
    }
#else
    Vec wa[C];  // |w|, and w's sign moves onto x
    KVI8_UNROLL for (int c = 0; c < C; ++c) wa[c] = _mm256_sign_epi8(wv[c], wv[c]);
    KVI8_UNROLL for (int r = 0; r < R; ++r) {
      const Vec xv = vload(X + r * K + k);
      KVI8_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = vdot(acc[r][c], wa[c], _mm256_sign_epi8(xv, wv[c]));
    }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      int32_t s = vsum(acc[r][c]);
      for (int64_t k = kv; k < K; ++k) {  // K's tail (K % kStep); AVX2 keeps xq's int8 bits in the uint8
        const uint8_t xb = X[r * K + k];
        s += (kOffset ? int32_t(xb) : int32_t(int8_t(xb))) * Wn[c * K + k];
      }
      const int64_t n = n0 + c;
      Y[(m0 + r) * N + n] = float(int64_t(s) - int64_t(kOffset) * WS[n]) * (a.d[m0 + r] * S[n]);
    }
}

using TileFn = void (*)(const int8_t*, int64_t, const Acts&, int64_t, int64_t, const float*, const int32_t*, float*,
                        int64_t);
#define KVI8_ROW(R) {&tile<R, 1>, &tile<R, 2>, &tile<R, NR >= 3 ? 3 : 1>, &tile<R, NR >= 4 ? 4 : 1>}
// [rows - 1][weight rows - 1]: the full tile and every tail of M and N.
const TileFn kTiles[MR][4] = {KVI8_ROW(1), KVI8_ROW(2), KVI8_ROW(3), KVI8_ROW(4)};
#endif

at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& w_scale, const at::Tensor& w_sum) {
  TORCH_CHECK(x_in.dim() == 2, "int8_gemm: x must be [M, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(),
              "int8_gemm: w must be contiguous int8 [N, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "int8_gemm: x has ", K, " columns, w ", w.size(1));
  TORCH_CHECK(K <= 65536, "int8_gemm: K = ", K, " could overflow the int32 sums (at most 65536)");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == N,
              "int8_gemm: w_scale must be contiguous float32 [N]");
  TORCH_CHECK(w_sum.scalar_type() == at::kInt && w_sum.is_contiguous() && w_sum.numel() == N,
              "int8_gemm: w_sum must be contiguous int32 [N]");
  at::Tensor y = at::empty({M, N}, at::kFloat);
#if defined(__AVX2__)
  if (M == 0 || N == 0) return y;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const Acts a = quantize_rows(x.data_ptr<float>(), M, K);
  const int8_t* W = w.data_ptr<int8_t>();
  const float* S = w_scale.data_ptr<float>();
  const int32_t* WS = w_sum.data_ptr<int32_t>();
  float* Y = y.data_ptr<float>();
  const int64_t blocks = (N + NR - 1) / NR;
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NR, c = std::min<int64_t>(NR, N - n0);
      for (int64_t m = 0; m < M; m += MR) kTiles[std::min<int64_t>(MR, M - m) - 1][c - 1](W, n0, a, m, K, S, WS, Y, N);
    }
  });
  return y;
#else
  TORCH_CHECK(false, "int8_gemm: built without AVX2");
#endif
}

std::string path() { return KVI8_PATH; }

}  // namespace

TORCH_LIBRARY(kvferry_int8, m) {
  m.def("gemm(Tensor x, Tensor w, Tensor w_scale, Tensor w_sum) -> Tensor", &gemm);
  m.def("path() -> str", &path);
}
