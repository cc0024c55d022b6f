// GGUF block-quantized matmul, y[M, N] = x[M, K] @ W^T, W kept in its GGUF blocks.
//
// gemm(x, w, type, n) -> y
//   x: [M, K] float32 (rows quantized here, once per row and call)
//   w: [N, bytes_per_row] uint8, the rows' GGUF blocks back to back
//   type: the ggml type id (Q4_0=2 Q4_1=3 Q5_0=6 Q5_1=7 Q8_0=8 Q2_K=10 Q3_K=11
//         Q4_K=12 Q5_K=13 Q6_K=14); y: [M, N] float32
// dequant_into(w, type, out): w's rows as floats into out [rows, K] float32 or
//   bf16 (the prefill tiles, into one reused buffer); dequant(w, type, K) -> float32
// path() -> "avx512vnni" | "avxvnni" | "avx2" | "none" (gemm throws on "none")
//
// Every type's block is decoded by one function into 32-value groups of
// UNSIGNED integers in a ymm register (nibbles, 5/6-bit values, or |q| for
// Q8_0) plus integer per-16 scales and "min" terms; the same decoders feed
// the dot product (in registers) and dequant (stored, for prefill tiles).
// The activations are int8 (Q8_0-style per 32 values for the 32-blocks,
// Q8_K-style per 256 with per-16 sums for the K-quants), so each group is
// one u8 x s8 dot: vpdpbusd (AVX512-VNNI on 256-bit lanes, or AVX-VNNI), or
// vpmaddubsw + vpmaddwd on AVX2. Offsets (Q4_0's -8, Q6_K's -32, mins) never
// touch the vectors: they are applied once per block from the activations'
// block sums, which quantize_rows precomputes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define KVQ_SIMD 1
#endif

namespace {

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef KVQ_SIMD
  return _cvtsh_ss(h);
#else
  const uint32_t s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float f = e == 0 ? std::ldexp(float(m), -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(float(m | 0x400), int(e) - 25);
  return s ? -f : f;
#endif
}

struct TypeInfo { int block, bytes; };
inline TypeInfo info(int64_t t) {
  switch (t) {
    case 2: return {32, 18}; case 3: return {32, 20}; case 6: return {32, 22}; case 7: return {32, 24};
    case 8: return {32, 34}; case 10: return {256, 84}; case 11: return {256, 110}; case 12: return {256, 144};
    case 13: return {256, 176}; case 14: return {256, 210};
  }
  TORCH_CHECK(false, "quant_gemm: unsupported ggml type ", t);
}

// Q3_K: 16 six-bit scales in 12 bytes, biased by 32 (ggml's dequantize_row_q3_K).
inline void scales_q3k(const uint8_t* s, int8_t out[16]) {
  uint32_t aux[4];
  std::memcpy(aux, s, 12);
  const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
  aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
  aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
  aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
  std::memcpy(out, aux, 16);
  for (int i = 0; i < 16; ++i) out[i] = int8_t(out[i] - 32);
}

// A K-quant superblock's coefficients: value i = d * sc[i/16] * q_i - dm * mn[i/16].
struct KHead { float d, dm; int16_t sc[16], mn[16]; };

inline void khead(int64_t t, const uint8_t* b, KHead& h) {
  switch (t) {
    case 10:  // Q2_K: scales[16] qs[64] d dmin
      h.d = h2f(b + 80); h.dm = h2f(b + 82);
      for (int i = 0; i < 16; ++i) { h.sc[i] = int16_t(b[i] & 0xF); h.mn[i] = int16_t(b[i] >> 4); }
      break;
    case 11: {  // Q3_K: hmask[32] qs[64] scales[12] d; q - 4 in -4..3
      int8_t s[16];
      scales_q3k(b + 96, s);
      h.d = h.dm = h2f(b + 108);
      for (int i = 0; i < 16; ++i) { h.sc[i] = s[i]; h.mn[i] = int16_t(4 * s[i]); }
      break;
    }
    case 12: case 13:  // Q4_K / Q5_K: d dmin scales[12] (qh[32]) qs[128]
    {
      // The 12 bytes to 8 scales then 8 mins, four at a time (llama.cpp's kmask shuffle).
      uint32_t u[4];
      std::memcpy(u, b + 4, 12);
      const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
      u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
      const uint32_t aux = u[1] & k1;
      u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
      u[2] = aux;
      u[0] &= k1;
      const uint8_t* v = reinterpret_cast<const uint8_t*>(u);
      h.d = h2f(b); h.dm = h2f(b + 2);
#ifdef KVQ_SIMD
      // Each byte twice (one per 16-value half of its 32-value sub-block), widened to 16 bits.
      const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h.sc), _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sm, sm)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h.mn), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm)));
#else
      for (int j = 0; j < 8; ++j) { h.sc[2 * j] = h.sc[2 * j + 1] = v[j]; h.mn[2 * j] = h.mn[2 * j + 1] = v[8 + j]; }
#endif
      break;
    }
    case 14:  // Q6_K: ql[128] qh[64] scales[16] (int8) d; q - 32
      h.d = h.dm = h2f(b + 208);
      for (int i = 0; i < 16; ++i) { h.sc[i] = int8_t(b[192 + i]); h.mn[i] = int16_t(32 * h.sc[i]); }
      break;
  }
}

// Group g (32 values) of a K-quant superblock as unsigned integers, scalar (dequant).
inline void kgroup_scalar(int64_t t, const uint8_t* b, int g, uint8_t q[32]) {
  const int n = g / 4, j = g % 4;
  for (int l = 0; l < 32; ++l) {
    switch (t) {
      case 10: q[l] = (b[16 + 32 * n + l] >> (2 * j)) & 3; break;
      case 11: q[l] = ((b[32 + 32 * n + l] >> (2 * j)) & 3) | (((b[l] >> g) & 1) << 2); break;
      case 12: q[l] = (b[16 + 32 * (g / 2) + l] >> (4 * (g & 1))) & 0xF; break;
      case 13: q[l] = ((b[48 + 32 * (g / 2) + l] >> (4 * (g & 1))) & 0xF) | (((b[16 + l] >> g) & 1) << 4); break;
      case 14: q[l] = ((b[64 * n + 32 * (j & 1) + l] >> (4 * (j >> 1))) & 0xF) | (((b[128 + 32 * n + l] >> (2 * j)) & 3) << 4); break;
    }
  }
}

// A 32-block's values: value i = d * q_i + off (Q8_0: q signed, off = 0).
inline void block32_scalar(int64_t t, const uint8_t* b, float& d, float& off, int q[32]) {
  d = h2f(b);
  if (t == 8) { off = 0; for (int l = 0; l < 32; ++l) q[l] = int8_t(b[2 + l]); return; }
  const uint8_t* qs = b + (t == 2 ? 2 : t == 3 ? 4 : t == 6 ? 6 : 8);
  uint32_t qh = 0;
  if (t == 6 || t == 7) std::memcpy(&qh, b + (t == 6 ? 2 : 4), 4);
  for (int l = 0; l < 16; ++l) {
    q[l] = (qs[l] & 0xF) | (((qh >> l) & 1) << 4);
    q[l + 16] = (qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
  }
  off = t == 2 ? -8 * d : t == 6 ? -16 * d : h2f(b + 2);
}

[[maybe_unused]] void dequant_scalar(const uint8_t* W, int64_t t, int64_t row_bytes, int64_t r0, int64_t r1, float* Y, int64_t K) {
  const TypeInfo ti = info(t);
  const int64_t nb = K / ti.block;
  for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = W + r * row_bytes + i * ti.bytes;
        float* o = Y + r * K + i * ti.block;
        if (ti.block == 32) {
          float d, off; int q[32];
          block32_scalar(t, b, d, off, q);
          for (int l = 0; l < 32; ++l) o[l] = d * q[l] + off;
        } else {
          KHead h; uint8_t q[32];
          khead(t, b, h);
          for (int g = 0; g < 8; ++g) {
            kgroup_scalar(t, b, g, q);
            for (int l = 0; l < 32; ++l) o[32 * g + l] = h.d * h.sc[2 * g + l / 16] * q[l] - h.dm * h.mn[2 * g + l / 16];
          }
        }
      }
}

#ifdef KVQ_SIMD
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVQ_PATH "avx512vnni"
#define KVQ_VNNI 1
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define KVQ_PATH "avxvnni"
#define KVQ_VNNI 1
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define KVQ_PATH "avx2"
// u <= 63 (or |q8| <= 128) times |s| <= 127, pairs summed: within int16, so maddubs never saturates.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// Loops unrolled whole, so each row's accumulators live in registers
// (measured: 1.6x at 8-16 rows for Q4_K) and shift counts are constants.
#define KVQ_UNROLL _Pragma("GCC unroll 8")

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 32 bits -> 32 bytes, 0xFF where the bit is set (llama.cpp's bytes_from_bits_32).
inline __m256i bits_to_bytes(uint32_t x) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(x)), shuf);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

inline __m256i nibbles16(const uint8_t* p) {  // 16 bytes -> 32 values: low nibbles, then high
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// Group g of a K-quant superblock as unsigned bytes in a register.
template <int T>
inline __m256i kgroup(const uint8_t* b, int g) {
  const int n = g / 4, j = g % 4;
  const __m256i m2 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(0x0F);
  auto ld = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  auto shr = [](__m256i v, int s) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(s)); };
  if constexpr (T == 10) return _mm256_and_si256(shr(ld(b + 16 + 32 * n), 2 * j), m2);
  if constexpr (T == 11) {
    const __m256i lo = _mm256_and_si256(shr(ld(b + 32 + 32 * n), 2 * j), m2);
    const __m256i hi = _mm256_and_si256(shr(ld(b), g), _mm256_set1_epi8(1));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 2));
  }
  if constexpr (T == 12) return _mm256_and_si256(shr(ld(b + 16 + 32 * (g / 2)), 4 * (g & 1)), m4);
  if constexpr (T == 13) {
    const __m256i lo = _mm256_and_si256(shr(ld(b + 48 + 32 * (g / 2)), 4 * (g & 1)), m4);
    const __m256i hi = _mm256_and_si256(shr(ld(b + 16), g), _mm256_set1_epi8(1));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
  if constexpr (T == 14) {
    const __m256i lo = _mm256_and_si256(shr(ld(b + 64 * n + 32 * (j & 1)), 4 * (j >> 1)), m4);
    const __m256i hi = _mm256_and_si256(shr(ld(b + 128 + 32 * n), 2 * j), m2);
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
  return _mm256_setzero_si256();
}

// A 32-block: unsigned values (Q8_0: |q|, with the signs moved onto x's bytes by the caller).
template <int T>
inline __m256i block32(const uint8_t* b) {
  if constexpr (T == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  const uint8_t* qs = b + (T == 2 ? 2 : T == 3 ? 4 : T == 6 ? 6 : 8);
  __m256i q = nibbles16(qs);
  if constexpr (T == 6 || T == 7) {
    uint32_t qh;
    std::memcpy(&qh, b + (T == 6 ? 2 : 4), 4);
    q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
  }
  return q;
}

// 32 unsigned (or, for Q8_0, signed) bytes to floats: a0 * q + b0 for
// values 0-15, a1 * q + b1 for 16-31.
// 8 floats to o (float32) or to bf16, round to nearest even (finite values).
inline void put8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }
inline void put8(at::BFloat16* o, __m256 v) {
#ifdef __AVX512BF16__
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), (__m128i)_mm256_cvtneps_pbh(v));
  return;
#endif
  const __m256i u = _mm256_castps_si256(v);
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
  const __m256i h = _mm256_srli_epi32(r, 16);  // 8 x 16 bits in the low halves
  const __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), p);
}

// 32 unsigned (or, for Q8_0, signed) bytes to floats: a0 * q + b0 for
// values 0-15, a1 * q + b1 for 16-31.
template <bool Signed, typename O>
inline void store32(O* o, __m256i q, __m256 a0, __m256 b0, __m256 a1, __m256 b1) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  auto cv = [](__m128i v) { return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v)); };
  put8(o, _mm256_fmadd_ps(a0, cv(lo), b0));
  put8(o + 8, _mm256_fmadd_ps(a0, cv(_mm_srli_si128(lo, 8)), b0));
  put8(o + 16, _mm256_fmadd_ps(a1, cv(hi), b1));
  put8(o + 24, _mm256_fmadd_ps(a1, cv(_mm_srli_si128(hi, 8)), b1));
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The same into bf16, 16 lanes at a time (preferred by overload ordering): the
// prefill tiles' dequantization, half the instructions of the 8-lane form.
template <bool Signed>
inline void store32(at::BFloat16* o, __m256i q, __m256 a0, __m256 b0, __m256 a1, __m256 b1) {
  auto cv = [](__m128i v) { return _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v)); };
  auto wide = [](__m256 v) { return _mm512_broadcastss_ps(_mm256_castps256_ps128(v)); };
  const __m512 lo = _mm512_fmadd_ps(wide(a0), cv(_mm256_castsi256_si128(q)), wide(b0));
  const __m512 hi = _mm512_fmadd_ps(wide(a1), cv(_mm256_extracti128_si256(q, 1)), wide(b1));
  _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif

template <int T, typename O>
void dequant_simd(const uint8_t* W, int64_t row_bytes, int64_t r0, int64_t r1, O* Y, int64_t K) {
  const int64_t nb = K / info(T).block;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* b = W + r * row_bytes + i * info(T).bytes;
      // The weight streams in cold from memory: ask for the bytes 4 KiB ahead
      // (past r1 this reads at most a few lines of the next rows; prefetch never faults).
      _mm_prefetch(reinterpret_cast<const char*>(b) + 4096, _MM_HINT_T0);
      if constexpr (T < 10) {
        O* o = Y + r * K + i * 32;
        const __m256 d = _mm256_set1_ps(h2f(b));
        const __m256 off = _mm256_set1_ps(T == 2 ? -8 * h2f(b) : T == 6 ? -16 * h2f(b) : T == 8 ? 0.f : h2f(b + 2));
        store32<T == 8>(o, block32<T>(b), d, off, d, off);
      } else {
        O* o = Y + r * K + i * 256;
        KHead h;
        khead(T, b, h);
        // The 16 sub-block coefficients as floats, 8 at a time, then broadcast from L1.
        alignas(32) float fs[16], fm[16];
        for (int k = 0; k < 16; k += 8) {
          auto f8 = [](const int16_t* v) {
            return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))));
          };
          _mm256_store_ps(fs + k, _mm256_mul_ps(f8(h.sc + k), _mm256_set1_ps(h.d)));
          _mm256_store_ps(fm + k, _mm256_mul_ps(f8(h.mn + k), _mm256_set1_ps(-h.dm)));
        }
        KVQ_UNROLL for (int g = 0; g < 8; ++g)
          store32<false>(o + 32 * g, kgroup<T>(b, g), _mm256_broadcast_ss(fs + 2 * g), _mm256_broadcast_ss(fm + 2 * g),
                         _mm256_broadcast_ss(fs + 2 * g + 1), _mm256_broadcast_ss(fm + 2 * g + 1));
      }
    }
}

// The activations of M rows: per block of B values, int8 values, the scale,
// and block sums (32-blocks: scale * sum, as float; K: int sums per 16).
struct Acts {
  int64_t B, nb;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int16_t> bsum;  // [M * nb * 16] for B = 256 (|sum| <= 16 * 127)
};

Acts quantize_rows(const float* x, int64_t M, int64_t K, int64_t B) {
  Acts a{B, K / B, std::vector<int8_t>(M * K), std::vector<float>(M * (K / B)), std::vector<float>(M * (K / B)), {}};
  if (B == 256) a.bsum.resize(M * a.nb * 16);
  at::parallel_for(0, M * a.nb, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* xs = x + i * B;
      float amax = 0;
      for (int l = 0; l < B; ++l) amax = std::fmax(amax, std::fabs(xs[l]));
      const float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
      int8_t* q = a.q.data() + i * B;
      int sum = 0;
      for (int l = 0; l < B; ++l) { q[l] = int8_t(std::nearbyint(xs[l] * id)); sum += q[l]; }
      a.d[i] = d; a.s[i] = d * float(sum);
      if (B == 256)
        for (int k = 0; k < 16; ++k) {
          int s16 = 0;
          for (int l = 0; l < 16; ++l) s16 += q[16 * k + l];
          a.bsum[i * 16 + k] = int16_t(s16);
        }
    }
  });
  return a;
}

// Rows of x per pass over a weight row (its blocks stay in L1 between passes):
// each row keeps two accumulators, so 8 fit AVX-512's 32 registers, 4 AVX2's 16.
#ifdef __AVX512F__
#define MR_MAX 8
#else
#define MR_MAX 4
#endif
constexpr int MR = MR_MAX;

template <int T, int R>
void rows32(const uint8_t* w, const Acts& a, int64_t m0, int64_t bytes, float* y, int64_t ldy) {
  __m256 acc[R];
  float off[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); off[r] = 0; }
  for (int64_t i = 0; i < a.nb; ++i) {
    const uint8_t* b = w + i * bytes;
    const float d = h2f(b);
    __m256i q = block32<T>(b);
#ifdef KVQ_VNNI
    // vpdpbusd sums u8 x s8 into 32 bits with no saturation: Q8_0's q + 128
    // is unsigned, and its -128 * sum(x) joins the block offsets below.
    constexpr bool kSignTrick = false;
    if constexpr (T == 8) q = _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80)));
#else
    // vpmaddubsw would saturate (q + 128) * x pairs: |q| x sign(x, q) instead.
    constexpr bool kSignTrick = T == 8;
#endif
    const float o = T == 2 ? -8 * d : T == 6 ? -16 * d : (T == 3 || T == 7) ? h2f(b + 2) : -128 * d;
    const __m256i sgn = q;
    if constexpr (kSignTrick) q = _mm256_sign_epi8(q, q);
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      const int64_t ai = (m0 + r) * a.nb + i;
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + ai * 32));
      if constexpr (kSignTrick) x = _mm256_sign_epi8(x, sgn);
      const __m256i p = dot_u8s8(_mm256_setzero_si256(), q, x);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * a.d[ai]), acc[r]);
      if constexpr (!kSignTrick) off[r] += o * a.s[ai];
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]) + off[r];
}

template <int T, int R>
void rowsK(const uint8_t* w, const Acts& a, int64_t m0, int64_t bytes, float* y, int64_t ldy) {
  __m256 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
  KHead h;
  for (int64_t i = 0; i < a.nb; ++i) {
    const uint8_t* b = w + i * bytes;
    khead(T, b, h);
    __m256i iacc[R];
    KVQ_UNROLL for (int r = 0; r < R; ++r) iacc[r] = _mm256_setzero_si256();
    KVQ_UNROLL for (int g = 0; g < 8; ++g) {
      const __m256i q = kgroup<T>(b, g);
      // vpmaddubsw's 16-bit lanes 0-7 hold values 0-15 of the group (sub-block
      // 2g), lanes 8-15 values 16-31; vpmaddwd then applies the sub-block scales
      // (as llama.cpp's K-quant dots: |pair| <= 2 * 63 * 127 fits in 16 bits).
      const __m256i sc = _mm256_set_m128i(_mm_set1_epi16(h.sc[2 * g + 1]), _mm_set1_epi16(h.sc[2 * g]));
      KVQ_UNROLL for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.q.data() + ((m0 + r) * a.nb + i) * 256 + 32 * g;
        const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
        iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(p, sc));
      }
    }
    const __m256i mn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.mn));
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      const int64_t ai = (m0 + r) * a.nb + i;
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum.data() + ai * 16));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_set1_ps(h.d * a.d[ai]), acc[r]);
      macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mn, bs)), _mm256_set1_ps(h.dm * a.d[ai]), macc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(_mm256_sub_ps(acc[r], macc[r]));
}

template <int T, int R>
inline void rows(const uint8_t* w, const Acts& a, int64_t m0, float* y, int64_t ldy) {
  if constexpr (T >= 10) rowsK<T, R>(w, a, m0, info(T).bytes, y, ldy);
  else rows32<T, R>(w, a, m0, info(T).bytes, y, ldy);
}

// A tile of r < MR rows (the tail of M) in one pass, not r passes.
template <int T>
void tail(int r, const uint8_t* w, const Acts& a, int64_t m0, float* y, int64_t ldy) {
  switch (r) {
    case 1: return rows<T, 1>(w, a, m0, y, ldy);
    case 2: return rows<T, 2>(w, a, m0, y, ldy);
    case 3: return rows<T, 3>(w, a, m0, y, ldy);
#if MR_MAX > 4
    case 4: return rows<T, 4>(w, a, m0, y, ldy);
    case 5: return rows<T, 5>(w, a, m0, y, ldy);
    case 6: return rows<T, 6>(w, a, m0, y, ldy);
    case 7: return rows<T, 7>(w, a, m0, y, ldy);
#endif
  }
}

template <int T>
void gemm_type(const uint8_t* W, int64_t bytes, const Acts& a, int64_t M, int64_t N, float* Y) {
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = W + n * bytes;
      int64_t m = 0;
      for (; m + MR <= M; m += MR) rows<T, MR>(w, a, m, Y + m * N + n, N);
      if (m < M) tail<T>(int(M - m), w, a, m, Y + m * N + n, N);
    }
  });
}
#else
#define KVQ_PATH "none"
#endif

#define KVQ_TYPES(X) X(2) X(3) X(6) X(7) X(8) X(10) X(11) X(12) X(13) X(14)

at::Tensor dequant(const at::Tensor& w, int64_t t, int64_t K);

// Writes rows of w, dequantized, into out [rows, K] float32 or bf16 (contiguous):
// prefill reuses one tile buffer, so no float copy of the weight is allocated.
void dequant_into(const at::Tensor& w, int64_t t, const at::Tensor& out) {
  const TypeInfo ti = info(t);
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "dequant: w must be contiguous uint8 [N, bytes]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == w.size(0), "dequant: out must be contiguous [N, K]");
  const int64_t K = out.size(1), rb = w.size(1);
  TORCH_CHECK(K % ti.block == 0 && rb == K / ti.block * ti.bytes, "dequant: K does not match the row bytes");
  const uint8_t* W = w.data_ptr<uint8_t>();
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || out.scalar_type() == at::kFloat, "dequant: out must be float32 or bf16");
#ifdef KVQ_SIMD
  at::parallel_for(0, w.size(0), 8, [&](int64_t r0, int64_t r1) {
    switch (t) {
#define KVQ_DQ(T) case T: return bf16 ? dequant_simd<T>(W, rb, r0, r1, out.data_ptr<at::BFloat16>(), K) \
                                       : dequant_simd<T>(W, rb, r0, r1, out.data_ptr<float>(), K);
      KVQ_TYPES(KVQ_DQ)
    }
  });
#else
  if (bf16) { out.copy_(dequant(w, t, K)); return; }
  at::parallel_for(0, w.size(0), 8, [&](int64_t r0, int64_t r1) { dequant_scalar(W, t, rb, r0, r1, out.data_ptr<float>(), K); });
#endif
}

at::Tensor dequant(const at::Tensor& w, int64_t t, int64_t K) {
  at::Tensor y = at::empty({w.size(0), K}, at::kFloat);
  dequant_into(w, t, y);
  return y;
}

at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& w, int64_t t, int64_t n) {
  const TypeInfo ti = info(t);
  TORCH_CHECK(x_in.dim() == 2, "quant_gemm: x must be [M, K]");
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(0) == n,
              "quant_gemm: w must be contiguous uint8 [n, bytes]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % ti.block == 0 && w.size(1) == K / ti.block * ti.bytes, "quant_gemm: K does not match the row bytes");
  at::Tensor y = at::empty({M, n}, at::kFloat);
#ifdef KVQ_SIMD
  if (M == 0 || n == 0) return y;
  const Acts a = quantize_rows(x.data_ptr<float>(), M, K, ti.block);
  const uint8_t* W = w.data_ptr<uint8_t>();
  float* Y = y.data_ptr<float>();
  switch (t) {
#define KVQ_GEMM(T) case T: gemm_type<T>(W, w.size(1), a, M, n, Y); break;
    KVQ_TYPES(KVQ_GEMM)
  }
  return y;
#else
  TORCH_CHECK(false, "quant_gemm: built without AVX2");
#endif
}

std::string path() { return KVQ_PATH; }

}  // namespace

TORCH_LIBRARY(kvferry_quant, m) {
  m.def("gemm(Tensor x, Tensor w, int type, int n) -> Tensor", &gemm);
  m.def("dequant(Tensor w, int type, int K) -> Tensor", &dequant);
  m.def("dequant_into(Tensor w, int type, Tensor(a!) out) -> ()", &dequant_into);
  m.def("path() -> str", &path);
}
