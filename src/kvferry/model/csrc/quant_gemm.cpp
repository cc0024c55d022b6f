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
#include <algorithm>
#include <cstring>
#include <atomic>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
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

// Inlined always: the dots call it per superblock with t a constant, so its switch folds away
// (as a call it was a quarter of a Q4_K row's time at batch 1).
__attribute__((always_inline)) inline void khead(int64_t t, const uint8_t* b, KHead& h) {
  switch (t) {
    // The SIMD builds write sc and mn with one 256-bit store each: the dots
    // read them back 128 bits at a time, which a store that small values were
    // written by one at a time cannot forward (a stall per superblock, measured
    // 1.6x on Q6_K).
    case 10:  // Q2_K: scales[16] qs[64] d dmin
      h.d = h2f(b + 80); h.dm = h2f(b + 82);
#ifdef KVQ_SIMD
    {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), m4 = _mm_set1_epi8(0x0F);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h.sc), _mm256_cvtepu8_epi16(_mm_and_si128(v, m4)));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h.mn), _mm256_cvtepu8_epi16(hi));
    }
#else
      for (int i = 0; i < 16; ++i) { h.sc[i] = int16_t(b[i] & 0xF); h.mn[i] = int16_t(b[i] >> 4); }
#endif
      break;
    case 11: {  // Q3_K: hmask[32] qs[64] scales[12] d; q - 4 in -4..3
      int8_t s[16];
      scales_q3k(b + 96, s);
      h.d = h.dm = h2f(b + 108);
#ifdef KVQ_SIMD
      int32_t u[4];
      std::memcpy(u, s, 16);
      const __m256i v = _mm256_cvtepi8_epi16(_mm_setr_epi32(u[0], u[1], u[2], u[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h.sc), v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h.mn), _mm256_slli_epi16(v, 2));
#else
      for (int i = 0; i < 16; ++i) { h.sc[i] = s[i]; h.mn[i] = int16_t(4 * s[i]); }
#endif
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
#ifdef KVQ_SIMD
    {
      const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h.sc), v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h.mn), _mm256_slli_epi16(v, 5));
    }
#else
      for (int i = 0; i < 16; ++i) { h.sc[i] = int8_t(b[192 + i]); h.mn[i] = int16_t(32 * h.sc[i]); }
#endif
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

#define KVQ_TYPES(X) X(2) X(3) X(6) X(7) X(8) X(10) X(11) X(12) X(13) X(14)

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

// The weight bytes one thread's share of a dots call reads, in the order it
// reads them (its rows of each part in turn), prefetched kAhead bytes ahead of
// the reads. Before each row (or group of rows) gemm_rows takes the span of
// lines to prefetch while that row is read, and the kernel spreads them among
// its dots: prefetches issued as one burst per row filled the core's line fill
// buffers, the burst's last prefetch then held up retirement, and the core sat
// idle once the fills drained. At a stream's start, where nothing was
// prefetched, the spans run at twice the reads' pace until they are kAhead
// ahead; past the share's last byte nothing is prefetched (a span ends at its
// range's end; the next span starts the next range). Prefetches only: the
// results are the same bits with or without them.
struct Span { const char* p; int64_t bytes; };

struct Stream {
  static constexpr int kMaxRanges = 8;
  static constexpr int64_t kAhead = 8192;
  const char* begin[kMaxRanges];
  const char* end[kMaxRanges];
  int n = 0, cur = 0;
  const char* p = nullptr;  // the next line to prefetch; null: none left
  int64_t ahead = 0;        // bytes prefetched beyond the reads
  void add(const uint8_t* from, int64_t bytes) {
    if (n == kMaxRanges || bytes <= 0) return;  // more parts than ranges: the rest stream unprefetched
    begin[n] = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(from) & ~uintptr_t(63));
    end[n] = reinterpret_cast<const char*>(from) + bytes;
    if (n++ == 0) p = begin[0];
  }
  // The lines to prefetch while the next `bytes` are read.
  Span take(int64_t bytes) {
    ahead -= bytes;
    const int64_t want = std::min(kAhead - ahead, 2 * bytes);
    if (want <= 0 || !p) return {nullptr, 0};
    const Span s{p, std::min<int64_t>((want + 63) & ~int64_t(63), end[cur] - p)};
    ahead += s.bytes;
    if ((p += s.bytes) >= end[cur]) p = ++cur < n ? begin[cur] : nullptr;
    return s;
  }
};

// A kernel's loop spreads a span's lines over its steps: `steps` equal
// shares, one per next() (the share's size computed once per span, not
// divided per step), the rest by rest().
struct Spread {
  const char *at, *until, *end;
  int64_t step;
  Spread(const Span& s, int64_t steps)
      : at(s.p), until(s.p), end(s.p + s.bytes), step(steps > 0 ? (s.bytes + steps - 1) / steps : s.bytes) {}
  inline void next(int64_t k = 1) {
    until = std::min(end, until + k * step);
    for (; at < until; at += 64) _mm_prefetch(at, _MM_HINT_T0);
  }
  inline void rest() {
    for (; at < end; at += 64) _mm_prefetch(at, _MM_HINT_T0);
  }
};

// 32 bits -> 32 bytes, 0xFF where the bit is set (llama.cpp's bytes_from_bits_32).
inline __m256i bits_to_bytes(uint32_t x) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(x)), shuf);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

// 16 bytes -> 32 values: low nibbles, then high. The bytes are broadcast to
// both halves by the load itself and shifted by 0 and 4 per half: no shuffle
// (port 5 is the one the dots' other shuffles and broadcasts compete for).
inline __m256i nibbles16(const uint8_t* p) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
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
// The arrays live in the calling thread's scratch (kept between calls: a
// decode step makes ~120 of these calls, each a few microseconds of work).
struct Acts {
  int64_t B, nb;
  const int8_t* q;
  const float *d, *s;
  const int16_t* bsum;  // [M * nb * 16] for B = 256 (|sum| <= 16 * 127)
  // [M * nb * 8] for B = 32 on VNNI: -128 times each 4 values' sum, the
  // start of a Q8_0 dot's lanes (rows32).
  const int32_t* x4 = nullptr;
  // [M * nb * 8] for B = 256: the per-32 sums (bsum's pairs added, |sum| <= 32 * 127), which
  // the prefill dots' Q4_K / Q5_K mins (one per 32 values) take two at a time.
  const int16_t* bsum32 = nullptr;
};

struct ActsScratch {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int16_t> bsum, bsum32;
  std::vector<int32_t> x4;
};

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return float(v); }

// llama.cpp's activation quantization, to the bit (ggml-cpu's quantize_row_q8_0
// and quantize_row_q8_K_ref), so that greedy answers match its CPU backend's on
// the same file: a model with massive activations (SmolLM2's ffn_down inputs,
// one value 10^4x its block's others) turns any other rounding of the small
// values into a different answer at its near ties. The multiplier is 127 / amax
// (not 1 / d: they differ in the last bit, and so do some roundings), and the
// 32-block scale d is stored as fp16 (block_q8_0's ggml_fp16_t), so the dots
// multiply by its fp16 value. Q8_K keeps a float d, ggml's 1 / iscale. The
// rounding itself is to nearest even in both.
inline float act_id(float amax) { return amax != 0.f ? 127.f / amax : 0.f; }

inline float act_scale(float amax, float id, int64_t B) {
  if (B == 256) return id != 0.f ? 1.f / id : 0.f;
  const float d = amax / 127.f;
  // Past fp16's range ggml's scale would be inf; kvferry keeps the float.
  if (!(d < 65504.f)) return d;
#ifdef KVQ_SIMD
  return _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
#else
  int e;
  std::frexp(d, &e);  // d = m 2^e, 1/2 <= m < 1: fp16 keeps 11 bits, 2^-24 steps below 2^-14
  const float step = std::ldexp(1.f, std::max(e, -13) - 11);
  return std::nearbyint(d / step) * step;
#endif
}

// One scratch per block size: a call over weights of both sizes (a Q4_K_M
// layer's Q8_0 and K-quant parts never mix, but a fused layer of Q5_0 and Q4_K
// could) keeps both quantizations of x alive at once.
template <typename X>
Acts quantize_rows(const X* x, int64_t M, int64_t K, int64_t B) {
  thread_local ActsScratch scratch[2];
  ActsScratch& sc = scratch[B == 256];
  const int64_t nb = K / B;
  if (int64_t(sc.q.size()) < M * K) sc.q.resize(M * K);
  if (int64_t(sc.d.size()) < M * nb) { sc.d.resize(M * nb); sc.s.resize(M * nb); }
  if (B == 256 && int64_t(sc.bsum.size()) < M * nb * 16) sc.bsum.resize(M * nb * 16);
  if (B == 256 && int64_t(sc.bsum32.size()) < M * nb * 8) sc.bsum32.resize(M * nb * 8);
  if (B == 32 && int64_t(sc.x4.size()) < M * nb * 8) sc.x4.resize(M * nb * 8);
  int32_t* X4 = sc.x4.data();
  int8_t* Q = sc.q.data();
  float *D = sc.d.data(), *S = sc.s.data();
  int16_t* BS = sc.bsum.data();
  int16_t* BS32 = sc.bsum32.data();
  // A decode row's few blocks quantize faster inline than a parallel region starts.
  at::parallel_for(0, M * nb, 256 * 32 / B, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const X* xs = x + i * B;
#ifdef KVQ_SIMD
      // The scalar loop below, eight values at a time (it was a tenth of a
      // batch-1 Q4_K call): max|x| is exact in any order, x * id rounds once
      // either way and round-to-nearest-even is nearbyint's, so the bytes,
      // sums and scales are the scalar loop's.
      {
        auto ld8 = [&](int l) {
          if constexpr (std::is_same_v<X, float>) return _mm256_loadu_ps(xs + l);
          else return _mm256_castsi256_ps(_mm256_slli_epi32(
              _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xs + l))), 16));
        };
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 vmax = _mm256_setzero_ps();
        for (int l = 0; l < B; l += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(ld8(l), abs_mask));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        const float id = act_id(amax), d = act_scale(amax, id, B);
        const __m256 vid = _mm256_set1_ps(id);
        int8_t* q = Q + i * B;
        __m256i vsum = _mm256_setzero_si256();
        for (int l = 0; l < B; l += 16) {
          const __m256i a = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(ld8(l), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
          const __m256i c = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(ld8(l + 8), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
          // 16 int32 in -127..127 -> 16 int8 in order (packs work per 128-bit lane: fix the order after).
          const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);
          const __m128i b8 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + l), b8);
          const __m256i s16 = _mm256_cvtepi8_epi16(b8);
          if (B == 256) {  // the per-16 sum
            __m128i t = _mm_add_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
            t = _mm_hadd_epi16(t, t); t = _mm_hadd_epi16(t, t); t = _mm_hadd_epi16(t, t);
            BS[i * 16 + l / 16] = int16_t(_mm_extract_epi16(t, 0));
          }
          vsum = _mm256_add_epi32(vsum, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
        }
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(vsum), _mm256_extracti128_si256(vsum, 1));
        t = _mm_hadd_epi32(t, t); t = _mm_hadd_epi32(t, t);
        D[i] = d; S[i] = d * float(_mm_cvtsi128_si32(t));
        if (B == 256) {  // the per-32 sums: pairs of per-16 sums added
          const __m256i s32 = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(BS + i * 16)),
                                                _mm256_set1_epi16(1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(BS32 + i * 8),
                           _mm_packs_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1)));
        }
#ifdef KVQ_VNNI
        if (B == 32) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
          const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), qv), _mm256_set1_epi16(1));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(X4 + i * 8),
                              _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s4, 7)));
        }
#endif
        continue;
      }
#endif
      float amax = 0;
      for (int l = 0; l < B; ++l) amax = std::fmax(amax, std::fabs(to_f(xs[l])));
      const float id = act_id(amax), d = act_scale(amax, id, B);
      int8_t* q = Q + i * B;
      int sum = 0;
      for (int l = 0; l < B; ++l) { q[l] = int8_t(std::nearbyint(to_f(xs[l]) * id)); sum += q[l]; }
      D[i] = d; S[i] = d * float(sum);
      if (B == 256)
        for (int k = 0; k < 16; ++k) {
          int s16 = 0;
          for (int l = 0; l < 16; ++l) s16 += q[16 * k + l];
          BS[i * 16 + k] = int16_t(s16);
        }
      if (B == 256)
        for (int k = 0; k < 8; ++k) BS32[i * 8 + k] = int16_t(BS[i * 16 + 2 * k] + BS[i * 16 + 2 * k + 1]);
    }
  });
  return Acts{B, nb, Q, D, S, BS, B == 32 ? X4 : nullptr, B == 256 ? BS32 : nullptr};
}

// Rows of x per pass over a weight row (its blocks stay in L1 between passes):
// each row keeps two accumulators, so 8 fit AVX-512's 32 registers, 4 AVX2's 16.
#ifdef __AVX512F__
#define MR_MAX 8
#else
#define MR_MAX 4
#endif
constexpr int MR = MR_MAX;

// Where a Q8_0 dot's lanes start: -128 times x's 4-value sums (VNNI), see rows32.
inline __m256i lanes_start(const Acts& a, int64_t ai) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.x4 + ai * 8));
}

template <int T, int R>
void rows32(const uint8_t* w, const Acts& a, int64_t m0, int64_t bytes, float* y, int64_t ldy) {
  __m256 acc[R];
  float off[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); off[r] = 0; }
  const intptr_t x4_at = reinterpret_cast<intptr_t>(a.x4) - reinterpret_cast<intptr_t>(a.q);
  for (int64_t i = 0; i < a.nb; ++i) {
    const uint8_t* b = w + i * bytes;
    const float d = h2f(b);
    __m256i q = block32<T>(b);
    // Q8_0: each lane's integer sum is sum(q x) exactly, as ggml's (which takes
    // |q| x sign(x, q)), so the lanes, their multiply-adds by fp16 d_w x fp16
    // d_x block after block and the final reduction are llama.cpp's
    // (tinyBLAS_Q0_AVX, ggml_vec_dot_q8_0_q8_0) to the bit. vpdpbusd sums u8 x
    // s8 with no saturation: q + 128 is unsigned, and the lanes start at -128
    // times x's 4-value sums (quantize_rows), one load where the sign trick is
    // one more vector op per row and block (measured: 15-20% of 8-11 rows).
    // vpmaddubsw would saturate (q + 128) x pairs: |q| x sign(x, q) there.
#ifdef KVQ_VNNI
    constexpr bool kSignTrick = false;
    if constexpr (T == 8) q = _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80)));
#else
    constexpr bool kSignTrick = T == 8;
#endif
    const float o = T == 2 ? -8 * d : T == 6 ? -16 * d : h2f(b + 2);  // Q4_1 / Q5_1: m
    const __m256i sgn = q;
    if constexpr (kSignTrick) q = _mm256_sign_epi8(q, q);
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      const int64_t ai = (m0 + r) * a.nb + i;
      const int8_t* xp = a.q + ai * 32;
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
      if constexpr (kSignTrick) x = _mm256_sign_epi8(x, sgn);
      // The lanes' start lies x4_at bytes from x's block (8 int32 per 32 int8):
      // one pointer a row, not two (eight rows' two would spill registers).
      const __m256i p = dot_u8s8(T == 8 && !kSignTrick
                                     ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + x4_at))
                                     : _mm256_setzero_si256(), q, x);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * a.d[ai]), acc[r]);
      if constexpr (T != 8) off[r] += o * a.s[ai];
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
    // The 16 sub-block scales, 8 per register and in both halves of it: group
    // g's pair is one in-lane shuffle away (one instruction, where two
    // broadcasts and an insert per group were a third of a superblock's time).
    const __m256i s_lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h.sc)));
    const __m256i s_hi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h.sc + 8)));
    KVQ_UNROLL for (int g = 0; g < 8; ++g) {
      const __m256i q = kgroup<T>(b, g);
      // vpmaddubsw's 16-bit lanes 0-7 hold values 0-15 of the group (sub-block
      // 2g), lanes 8-15 values 16-31; vpmaddwd then applies the sub-block scales
      // (as llama.cpp's K-quant dots: |pair| <= 2 * 63 * 127 fits in 16 bits).
      const char k = char(4 * (g & 3));  // bytes of sc[2g] (low half) and sc[2g + 1] (high half) in their register
      const __m256i pick = _mm256_setr_epi8(k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1, k,
                                            k + 1, k + 2, k + 3, k + 2, k + 3, k + 2, k + 3, k + 2, k + 3, k + 2, k + 3,
                                            k + 2, k + 3, k + 2, k + 3, k + 2, k + 3);
      const __m256i sc = _mm256_shuffle_epi8(g < 4 ? s_lo : s_hi, pick);
      KVQ_UNROLL for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.q + ((m0 + r) * a.nb + i) * 256 + 32 * g;
        const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
        iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(p, sc));
      }
    }
    const __m256i mn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.mn));
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      const int64_t ai = (m0 + r) * a.nb + i;
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum + ai * 16));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_set1_ps(h.d * a.d[ai]), acc[r]);
      macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mn, bs)), _mm256_set1_ps(h.dm * a.d[ai]), macc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(_mm256_sub_ps(acc[r], macc[r]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVQ_K512 1
// A pair's vpmaddubsw sums times its sub-block scales, added to the pair's
// lanes: one vpdpwssd with AVX512-VNNI, else vpmaddwd and an add. The same
// integers either way (|pair sums x scales| fit in 32 bits, so neither wraps).
inline __m512i scale_add(__m512i acc, __m512i p, __m512i sc) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, p, sc);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, sc));
#endif
}

// A Q4_K superblock's 8 six-bit scales and 8 mins as bytes, 8 to a 64-bit
// word (khead's kmask shuffle without its widening and stores: the batch-1
// dots widen them in registers, one shuffle each where they are used).
inline void q4k_scales_mins(const uint8_t* b, uint64_t& sc8, uint64_t& mn8) {
  uint32_t u[3];
  std::memcpy(u, b + 4, 12);
  const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  const uint32_t s0 = u[0] & k1, s1 = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  const uint32_t m0 = u[1] & k1, m1 = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  sc8 = uint64_t(s0) | (uint64_t(s1) << 32);
  mn8 = uint64_t(m0) | (uint64_t(m1) << 32);
}

// rowsK for one row of x (decode at batch 1) on Q4_K / Q6_K, two groups per
// 512-bit register: half the instructions a superblock (one core's dots had
// been the bound at batch 1, not its reads: 1.3-1.4x the read time). Q4_K's
// groups 2p and 2p + 1 are the low and high nibbles of the same 32 bytes;
// Q6_K's 4n + j and 4n + j + 1 (j = 0, 2) lie in 64 bytes of ql with their
// high bits in one 32 bytes of qh. x's two groups are 64 bytes side by side.
// The 32-bit sums are rowsK's: lane l of group 2p's half plus lane l of group
// 2p + 1's, added as integers, so the result is rowsK<T, 1>'s to the bit.
// XPaired (Q4_K): a.q's row in paired_x's order, which lets a superblock's
// 64 bytes of nibbles be one load, two groups' low nibbles one and, and their
// high nibbles one shift and and (not a broadcast load and a shift and an
// and for each two groups).
template <int T, bool XPaired = false>
void rowsK1_512(const uint8_t* w, const Acts& a, int64_t m0, int64_t bytes, float* y, Span pf = {}) {
  static_assert(T == 12 || T == 14, "Q4_K and Q6_K only");
  __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  Spread spread(pf, a.nb);
  for (int64_t i = 0; i < a.nb; ++i) {
    const uint8_t* b = w + i * bytes;
    spread.next();
    const int8_t* xq = a.q + (m0 * a.nb + i) * 256;
    __m512i zacc = _mm512_setzero_si512();
    __m256i mn;
    float d, dm;
    if constexpr (T == 12) {
      // Q4_K: the scales and mins straight from their bytes. Pair p's 128-bit
      // lanes are its sub-blocks 4p..4p+3 (16 values each), whose 32-value
      // scales are bytes 2p, 2p, 2p + 1, 2p + 1: each zero-extended to 16 bits
      // by one in-lane shuffle of the broadcast bytes.
      uint64_t sc8, mn8;
      q4k_scales_mins(b, sc8, mn8);
      d = h2f(b);
      dm = h2f(b + 2);
      const __m512i s8 = _mm512_set1_epi64(int64_t(sc8));
      const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
      if constexpr (XPaired) {
        // 64 bytes of nibbles are groups 4c, 4c + 2 (low nibbles of their two
        // halves) and 4c + 1, 4c + 3 (high); x's 128 bytes for them lie in that
        // order. Each 256-bit half's lanes are one group's, as in the unpaired
        // form, so the integer sums are the same.
        KVQ_UNROLL for (int c = 0; c < 2; ++c) {
          const __m512i v = _mm512_loadu_si512(b + 16 + 64 * c);
          KVQ_UNROLL for (int hi = 0; hi < 2; ++hi) {
            const int64_t g0 = 4 * c + hi, g1 = 4 * c + 2 + hi;
            const int64_t k0 = 0x8000800080008000ll | (g0 * 0x0001000100010001ll);
            const int64_t k1 = 0x8000800080008000ll | (g1 * 0x0001000100010001ll);
            const __m512i sc = _mm512_shuffle_epi8(s8, _mm512_set_epi64(k1, k1, k1, k1, k0, k0, k0, k0));
            const __m512i q = _mm512_and_si512(hi ? _mm512_srli_epi16(v, 4) : v, m4);
            zacc = scale_add(zacc, _mm512_maddubs_epi16(q, _mm512_loadu_si512(xq + 128 * c + 64 * hi)), sc);
          }
        }
      } else {
        KVQ_UNROLL for (int p = 0; p < 4; ++p) {
          const int64_t lo = 0x8000800080008000ll | (int64_t(2 * p) * 0x0001000100010001ll);
          const int64_t hi = 0x8000800080008000ll | (int64_t(2 * p + 1) * 0x0001000100010001ll);
          const __m512i sc = _mm512_shuffle_epi8(s8, _mm512_set_epi64(hi, hi, hi, hi, lo, lo, lo, lo));
          const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * p)));
          const __m512i q = _mm512_and_si512(_mm512_srlv_epi64(v, shift), m4);
          zacc = scale_add(zacc, _mm512_maddubs_epi16(q, _mm512_loadu_si512(xq + 64 * p)), sc);
        }
      }
      // The 16 per-16 mins (each 32-value sub-block's twice) as 16-bit lanes.
      mn = _mm256_shuffle_epi8(_mm256_set1_epi64x(int64_t(mn8)),
                               _mm256_setr_epi8(0, -128, 0, -128, 1, -128, 1, -128, 2, -128, 2, -128, 3, -128, 3, -128,
                                                4, -128, 4, -128, 5, -128, 5, -128, 6, -128, 6, -128, 7, -128, 7, -128));
    } else {
      // Q6_K: the 16 int8 scales widened once, in a register; pair p's
      // 128-bit lane j takes scale 4p + j by one permute.
      const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
      d = dm = h2f(b + 208);
      KVQ_UNROLL for (int n = 0; n < 2; ++n) {
        const __m512i ql = _mm512_loadu_si512(b + 64 * n);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n)));
        KVQ_UNROLL for (int half = 0; half < 2; ++half) {  // j = 2 half, 2 half + 1
          const __m512i lo = _mm512_and_si512(half ? _mm512_srli_epi16(ql, 4) : ql, m4);
          // Group 4n + j's two high bits are qh's bits 2j, 2j + 1: moved to bits 4-5
          // of their own byte (left 4, 2 or right 0, 2), masked and or-ed onto
          // the low nibble by one ternary op: lo | (hs & 0x30).
          const __m512i hs = half ? _mm512_srlv_epi64(qh, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0))
                                  : _mm512_sllv_epi64(qh, _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4));
          const __m512i q = _mm512_ternarylogic_epi64(lo, hs, m30, 0xF8);
          const int p = 2 * n + half;
          const __m512i sc = _mm512_permutexvar_epi16(
              _mm512_set_epi64((4 * p + 3) * 0x0001000100010001ll,
                               (4 * p + 3) * 0x0001000100010001ll, (4 * p + 2) * 0x0001000100010001ll,
                               (4 * p + 2) * 0x0001000100010001ll, (4 * p + 1) * 0x0001000100010001ll,
                               (4 * p + 1) * 0x0001000100010001ll, (4 * p) * 0x0001000100010001ll,
                               (4 * p) * 0x0001000100010001ll),
              _mm512_castsi256_si512(s16));
          zacc = scale_add(zacc, _mm512_maddubs_epi16(q, _mm512_loadu_si512(xq + 64 * p)), sc);
        }
      }
      // The mins are 32 times the scales: their products with x's sums, times 32 (the same integers).
      mn = s16;
    }
    const __m256i iacc = _mm256_add_epi32(_mm512_castsi512_si256(zacc), _mm512_extracti64x4_epi64(zacc, 1));
    const int64_t ai = m0 * a.nb + i;
    const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum + ai * 16));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc), _mm256_set1_ps(d * a.d[ai]), acc);
    __m256i mins = _mm256_madd_epi16(mn, bs);
    if constexpr (T == 14) mins = _mm256_slli_epi32(mins, 5);
    macc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(dm * a.d[ai]), macc);
  }
  y[0] = hsum(_mm256_sub_ps(acc, macc));
}
#endif

#ifdef KVQ_K512

// rowsK for R rows of x (decode batches of 2 to ~32 rows), every K-quant, two
// groups per 512-bit register as rowsK1_512: the superblock's groups are
// decoded and its scales shuffled once for all R rows, then each row costs
// three multiplies per two pairs of groups with AVX512-VNNI (below), four
// without, where rowsK's ymm form took six instructions per pair (the dots are
// compute-bound from ~8 rows: measured 1.3-1.6x rowsK's speed at 8-32 rows, Q4_K
// and Q6_K). Each row's 32-bit sums are rowsK's (group 2p's lane l plus group
// 2p + 1's, added as integers) and its float steps are rowsK's, so a row's
// value is rowsK<T, 1>'s (and rowsK1_512's) to the bit, at any R.
template <int T, int R>
void rowsK_512(const uint8_t* w, const Acts& a, int64_t m0, int64_t bytes, float* y, int64_t ldy) {
  // The float accumulators of rows 2j and 2j + 1 share a register (their low
  // and high 8 lanes): the per-superblock steps (the halves' integer sum,
  // conversions, scales, multiply-adds) are one 512-bit instruction for two
  // rows, each lane's the same operation rowsK does on it (a ninth of the
  // instructions; measured 10-15% at 8-16 rows). An odd R's last row is alone.
  constexpr int P = (R + 1) / 2;
  __m512 acc[P], macc[P];
  for (int j = 0; j < P; ++j) acc[j] = macc[j] = _mm512_setzero_ps();
  KHead h;
  const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(3);
  const __m512i pick = _mm512_set_epi64(0x0706070607060706, 0x0706070607060706, 0x0504050405040504,
                                        0x0504050405040504, 0x0302030203020302, 0x0302030203020302,
                                        0x0100010001000100, 0x0100010001000100);
  for (int64_t i = 0; i < a.nb; ++i) {
    const uint8_t* b = w + i * bytes;
    khead(T, b, h);
    const int8_t* xq = a.q + (m0 * a.nb + i) * 256;
    const int64_t xstep = a.nb * 256;  // one row of x to the next
    __m512i zacc[R];
    KVQ_UNROLL for (int r = 0; r < R; ++r) zacc[r] = _mm512_setzero_si512();
    __m512i qs[4];  // the superblock's pairs of groups (2p, 2p + 1), unsigned bytes
    auto pair = [&](int p, __m512i q) { qs[p] = q; };
    if constexpr (T == 12) {
      const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
      KVQ_UNROLL for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * p)));
        pair(p, _mm512_and_si512(_mm512_srlv_epi64(v, shift), m4));
      }
    } else if constexpr (T == 14) {
      KVQ_UNROLL for (int n = 0; n < 2; ++n) {
        const __m512i ql = _mm512_loadu_si512(b + 64 * n);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n)));
        KVQ_UNROLL for (int half = 0; half < 2; ++half) {
          const __m512i lo = _mm512_and_si512(half ? _mm512_srli_epi16(ql, 4) : ql, m4);
          const __m512i hs = half ? _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4) : _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
          const __m512i hi = _mm512_and_si512(_mm512_srlv_epi64(qh, hs), m2);
          pair(2 * n + half, _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)));
        }
      }
    } else {  // Q2_K, Q3_K, Q5_K: rowsK's two groups side by side
      KVQ_UNROLL for (int p = 0; p < 4; ++p)
        pair(p, _mm512_inserti64x4(_mm512_castsi256_si512(kgroup<T>(b, 2 * p)), kgroup<T>(b, 2 * p + 1), 1));
    }
    // Pair p's scales: 128-bit lane k holds sub-block 4p + k's scale in every 16 bits.
    __m512i sc[4];
    KVQ_UNROLL for (int p = 0; p < 4; ++p) {
      int64_t s4;
      std::memcpy(&s4, h.sc + 4 * p, 8);
      sc[p] = _mm512_shuffle_epi8(_mm512_set1_epi64(s4), pick);
    }
#ifdef __AVX512VNNI__
    // With VNNI, vpdpbusd sums each 4 values' products (lane l of a pair is
    // rowsK's vpmaddwd lane l before its scale): |sum| <= 4 * 63 * 127 < 2^15,
    // so pairs p and p + 1's sums fit one register as 16-bit halves (p + 1's
    // moved up by one byte shuffle), and one vpdpwssd by [scale p | scale p + 1]
    // adds both scaled sums to the lane: the integers rowsK adds to lane l,
    // with three multiplies per two pairs where vpmaddubsw and vpdpwssd took four.
    // Each dword's bytes 0, 1 into its bytes 2, 3 (vpshufb indexes within 128-bit lanes).
    const __m512i up4 = _mm512_broadcast_i32x4(_mm_setr_epi32(0x01000000, 0x05040000, 0x09080000, 0x0D0C0000));
    const __m512i sc01 = _mm512_mask_blend_epi16(0xAAAAAAAA, sc[0], sc[1]);
    const __m512i sc23 = _mm512_mask_blend_epi16(0xAAAAAAAA, sc[2], sc[3]);
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * xstep;
      auto dot4 = [&](int p) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), qs[p], _mm512_loadu_si512(xr + 64 * p)); };
      const __m512i d01 = _mm512_mask_shuffle_epi8(dot4(0), 0xCCCCCCCCCCCCCCCCull, dot4(1), up4);
      zacc[r] = _mm512_dpwssd_epi32(zacc[r], d01, sc01);
      const __m512i d23 = _mm512_mask_shuffle_epi8(dot4(2), 0xCCCCCCCCCCCCCCCCull, dot4(3), up4);
      zacc[r] = _mm512_dpwssd_epi32(zacc[r], d23, sc23);
    }
#else
    KVQ_UNROLL for (int p = 0; p < 4; ++p)
      KVQ_UNROLL for (int r = 0; r < R; ++r)
        zacc[r] = scale_add(zacc[r], _mm512_maddubs_epi16(qs[p], _mm512_loadu_si512(xq + r * xstep + 64 * p)), sc[p]);
#endif
    const __m512i mn = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.mn)));
    const __m512 vd = _mm512_set1_ps(h.d), vdm = _mm512_set1_ps(h.dm);
    KVQ_UNROLL for (int j = 0; j < P; ++j) {
      const int r = 2 * j;
      const bool two = r + 1 < R;
      const int64_t ai = (m0 + r) * a.nb + i, aj = two ? ai + a.nb : ai;  // a lone row pairs with itself
      const __m512i z1 = two ? zacc[r + 1] : zacc[r];
      // [row r's groups 2p | row r + 1's] in 256-bit halves: the two rows' 8 integer lanes, as rowsK's iacc.
      const __m512i iacc = _mm512_add_epi32(_mm512_shuffle_i64x2(zacc[r], z1, 0x44), _mm512_shuffle_i64x2(zacc[r], z1, 0xEE));
      // d * d_x as a vector multiply (rowsK's scalar product, the same rounding).
      const __m512 xd = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(
          _mm256_broadcast_ss(a.d + ai))), _mm256_castps_pd(_mm256_broadcast_ss(a.d + aj)), 1));
      const __m512i bs = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum + ai * 16))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum + aj * 16)), 1);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), _mm512_mul_ps(vd, xd), acc[j]);
      macc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(mn, bs)), _mm512_mul_ps(vdm, xd), macc[j]);
    }
  }
  for (int j = 0; j < P; ++j) {
    const __m512 v = _mm512_sub_ps(acc[j], macc[j]);
    y[2 * j * ldy] = hsum(_mm512_castps512_ps256(v));
    if (2 * j + 1 < R) y[(2 * j + 1) * ldy] = hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
}
#endif

// The low (Hi = false) or high 16 bits of each 32-bit lane, packed into 8 x 16 bits.
template <bool Hi>
inline __m128i half16(__m256i v) {
  if constexpr (Hi) v = _mm256_srli_epi32(v, 16);
#if defined(__AVX512VL__)
  return _mm256_cvtepi32_epi16(v);
#else
  const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08));
#endif
}

// One row of x against NR weight rows of 32-blocks (decode at batch 1).
// Eight blocks at a time: their fp16 scales are copied to the stack and
// converted in one instruction, multiplied by x's block scales as a vector,
// and broadcast from memory (a load, not a shuffle); the offsets (m, or
// -8 d) times x's block sums are one multiply-add per eight blocks. NR rows
// at once (4): one row's chain of multiply-adds waits 4 cycles a block, and
// its final reduction waits on all of it (measured, one row at a time: 5-6
// cycles a block, 11 GB/s from L2); NR rows interleave NR chains and reduce
// together.
template <int T, int NR>
void row32xn(const uint8_t* w, int64_t ldw, const Acts& a, int64_t m, float* y, Span pf) {
  const int64_t bytes = info(T).bytes;
#ifdef KVQ_VNNI
  constexpr bool kSignTrick = false;  // Q8_0: q + 128 from -128 sum(x) (see rows32)
#else
  constexpr bool kSignTrick = T == 8;
#endif
  constexpr bool kOffset = T != 8;  // Q8_0's lanes are exact: no block offsets
  constexpr bool kMin = T == 3 || T == 7;
  const int8_t* xq = a.q + m * a.nb * 32;
  const float *xd = a.d + m * a.nb, *xs = a.s + m * a.nb;
  auto dot = [&](const uint8_t* b, __m256i x, __m256i start) {
    __m256i q = block32<T>(b);
    if constexpr (kSignTrick) {
      x = _mm256_sign_epi8(x, q);
      q = _mm256_sign_epi8(q, q);
    } else if constexpr (T == 8) {
      q = _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80)));  // q + 128, unsigned: see rows32
    }
    return _mm256_cvtepi32_ps(dot_u8s8(start, q, x));
  };
  auto start_of = [&](int64_t i) {
    if constexpr (T == 8 && !kSignTrick) return lanes_start(a, m * a.nb + i);
    else return _mm256_setzero_si256();
  };
  __m256 acc[NR], macc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
  alignas(32) float sc[NR][8];
  // Each block's first 4 bytes (d, and Q4_1 / Q5_1's m) for 8 blocks: eight
  // loads and inserts (a vpgatherdd was a third of the batch-1 Q4_1 dot's time).
  Spread spread(pf, a.nb);
  int64_t i = 0;
  for (; i + 8 <= a.nb; i += 8) {
    spread.next(8);
    KVQ_UNROLL for (int r = 0; r < NR; ++r) {
      const uint8_t* hb = w + r * ldw + i * bytes;
      auto head = [&](int j) { int32_t v; std::memcpy(&v, hb + j * bytes, 4); return v; };
      const __m256i h = _mm256_setr_epi32(head(0), head(1), head(2), head(3), head(4), head(5), head(6), head(7));
      const __m256 d = _mm256_cvtph_ps(half16<false>(h));
      _mm256_store_ps(sc[r], _mm256_mul_ps(d, _mm256_loadu_ps(xd + i)));
      if constexpr (kOffset) {
        const __m256 o = kMin ? _mm256_cvtph_ps(half16<true>(h))
                              : _mm256_mul_ps(d, _mm256_set1_ps(T == 2 ? -8.f : -16.f));
        macc[r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xs + i), macc[r]);
      }
    }
    KVQ_UNROLL for (int j = 0; j < 8; ++j) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (i + j) * 32));
      const __m256i start = start_of(i + j);
      KVQ_UNROLL for (int r = 0; r < NR; ++r)
        acc[r] = _mm256_fmadd_ps(dot(w + r * ldw + (i + j) * bytes, x, start), _mm256_broadcast_ss(sc[r] + j), acc[r]);
    }
  }
  float off[NR] = {};
  spread.rest();
  for (; i < a.nb; ++i) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * 32));
    const __m256i start = start_of(i);
    KVQ_UNROLL for (int r = 0; r < NR; ++r) {
      const uint8_t* b = w + r * ldw + i * bytes;
      const float d = h2f(b);
      acc[r] = _mm256_fmadd_ps(dot(b, x, start), _mm256_set1_ps(d * xd[i]), acc[r]);
      // An explicit fma (the compiler contracted some types' a * b + c and not
      // others'): rows32_512 takes the same step, to the bit.
      if constexpr (kOffset) off[r] = std::fma(T == 2 ? -8 * d : T == 6 ? -16 * d : h2f(b + 2), xs[i], off[r]);
    }
  }
  for (int r = 0; r < NR; ++r) y[r] = hsum(_mm256_add_ps(acc[r], macc[r])) + off[r];
}

#if defined(__AVX512F__) && defined(__AVX512VL__)
#define KVQ_ROWS32_512 1
// row32xn for R rows of x (decode batches of 2 to ~32 rows, passes of MR = 8
// rows), one weight row: each block is decoded once for all R rows, and the
// per-block scalar work rows32 did per row (d * d_x as a scalar multiply and
// broadcast, Q4_0 / Q4_1 / Q5's offset as a scalar multiply-add) is row32xn's
// eight-block vector form: per row and eight blocks, one multiply for the
// eight d * d_x (then broadcast from memory by the multiply-adds) and one
// multiply-add for the offsets. A row and block then costs the dot, its
// conversion and one multiply-add, where rows32 also took a scalar product
// and its broadcast, Q8_0 a load of x's sums and the others a scalar
// multiply-add (measured on Zen 4, one thread, Q8_0 and Q4_1: 1.35-1.5x
// rows32's speed at 8-32 rows in L2, 1.15-1.4x on cold 1B-sized weights).
// AVX-512VL's 32 registers hold eight rows' two accumulators. Each row's
// arithmetic is row32xn's, step for step (its integer lanes, multiply-adds
// in block order, offsets in eight-block lanes and the tail's scalar sum,
// the same final reduction), so a row's value is the one-row dot's to the
// bit at any R, and Q8_0's stays llama.cpp's (see rows32).
template <int T, int R>
void rows32_512(const uint8_t* w, const Acts& a, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t bytes = T == 2 ? 18 : T == 3 ? 20 : T == 6 ? 22 : T == 7 ? 24 : 34;
#ifdef KVQ_VNNI
  constexpr bool kSignTrick = false;  // Q8_0: x + 128 from -128 sum(q) (decode, below)
#else
  constexpr bool kSignTrick = T == 8;
#endif
  constexpr bool kOffset = T != 8;
  constexpr bool kMin = T == 3 || T == 7;
  const int64_t nb = a.nb;
  const int8_t* xq = a.q + m0 * nb * 32;  // row r's block i at xq + (r * nb + i) * 32
  const float *xd = a.d + m0 * nb, *xs = a.s + m0 * nb;
  __m256 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
  alignas(32) float sc[R][8];
  // A block for the dots: its bytes for vpdpbusd's signed operand (Q8_0 on
  // VNNI: q itself, x's bytes + 128 the unsigned one; elsewhere x is the
  // signed one) and where each lane starts. Q8_0 on VNNI: sum((x + 128) q)
  // from -128 times q's 4-value sums, the block's own, so once per block for
  // all rows, where rows32 loaded x's sums (a load per row and block). The
  // same integers as rows32's lanes: the exact sum(q x). With the sign trick
  // (AVX2's maddubs would saturate): |q| and x signed by q.
  struct Blk { __m256i q, start; };
  auto decode = [&](const uint8_t* b) {
    const __m256i q = block32<T>(b);
    if constexpr (kSignTrick) return Blk{_mm256_sign_epi8(q, q), q};
    if constexpr (T == 8) {
      const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
      return Blk{q, _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s4, 7))};
    }
    return Blk{q, _mm256_setzero_si256()};
  };
  auto dot = [&](int r, int64_t i, const Blk& k) {
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (r * nb + i) * 32));
    if constexpr (kSignTrick) return _mm256_cvtepi32_ps(dot_u8s8(_mm256_setzero_si256(), k.q, _mm256_sign_epi8(x, k.start)));
    if constexpr (T == 8) return _mm256_cvtepi32_ps(dot_u8s8(k.start, _mm256_xor_si256(x, _mm256_set1_epi8(char(0x80))), k.q));
    return _mm256_cvtepi32_ps(dot_u8s8(k.start, k.q, x));
  };
  int64_t i = 0;
  for (; i + 8 <= nb; i += 8) {
    const uint8_t* hb = w + i * bytes;
    auto head = [&](int j) { int32_t v; std::memcpy(&v, hb + j * bytes, 4); return v; };
    const __m256i h = _mm256_setr_epi32(head(0), head(1), head(2), head(3), head(4), head(5), head(6), head(7));
    const __m256 d = _mm256_cvtph_ps(half16<false>(h));
    __m256 o = _mm256_setzero_ps();
    if constexpr (kOffset)
      o = kMin ? _mm256_cvtph_ps(half16<true>(h)) : _mm256_mul_ps(d, _mm256_set1_ps(T == 2 ? -8.f : -16.f));
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      _mm256_store_ps(sc[r], _mm256_mul_ps(d, _mm256_loadu_ps(xd + r * nb + i)));
      if constexpr (kOffset) macc[r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xs + r * nb + i), macc[r]);
    }
    // sc to memory, read back by the multiply-adds' broadcasts (kept in
    // registers, each broadcast was two shuffles).
    asm("" : "+m"(sc));
    KVQ_UNROLL for (int j = 0; j < 8; ++j) {
      const Blk k = decode(hb + j * bytes);
      KVQ_UNROLL for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(dot(r, i + j, k), _mm256_set1_ps(sc[r][j]), acc[r]);
    }
  }
  float off[R] = {};
  for (; i < nb; ++i) {
    const uint8_t* b = w + i * bytes;
    const float d = h2f(b);
    const Blk k = decode(b);
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(dot(r, i, k), _mm256_set1_ps(d * xd[r * nb + i]), acc[r]);
      if constexpr (kOffset) off[r] = std::fma(T == 2 ? -8 * d : T == 6 ? -16 * d : h2f(b + 2), xs[r * nb + i], off[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(_mm256_add_ps(acc[r], macc[r])) + off[r];
}
#endif
#include "quant_prefill_dots.h"  // prefill_rows_of: every type's dots at prefill sizes

template <int T, int R>
inline void rows(const uint8_t* w, const Acts& a, int64_t m0, float* y, int64_t ldy) {
#ifdef KVQ_K512
  if constexpr (R == 1 && (T == 12 || T == 14)) return rowsK1_512<T>(w, a, m0, info(T).bytes, y);
#endif
#ifdef KVQ_K512
  if constexpr (T >= 10) return rowsK_512<T, R>(w, a, m0, info(T).bytes, y, ldy);
#endif
#ifdef KVQ_ROWS32_512
  if constexpr (T < 10) return rows32_512<T, R>(w, a, m0, y, ldy);
#endif
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

#ifdef KVQ_K512
// One row of Q8_K x with each 128 bytes' middle 32-byte quarters swapped
// (groups 0, 2, 1, 3, then 4, 6, 5, 7): rowsK1_512<12, true>'s order. Made
// once per call and thread (K bytes), read by every weight row.
inline Acts paired_x(const Acts& a, std::vector<int8_t>& buf) {
  buf.resize(a.nb * 256);
  for (int64_t i = 0; i < 2 * a.nb; ++i) {
    const int8_t* s = a.q + 128 * i;
    int8_t* d = buf.data() + 128 * i;
    const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    const __m256i q2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    const __m256i q3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), q0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 32), q2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 64), q1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 96), q3);
  }
  Acts p = a;
  p.q = buf.data();
  return p;
}
#endif

// Weight rows n0..n1 of one weight (bytes per row) against the M rows of a:
// y[m * ldy + n] for each. Row n's value depends on nothing but row n and a,
// so any split of the rows among threads gives the same bits.
constexpr int64_t kTileRows = 4;

template <int T, typename O>
void gemm_rows(const uint8_t* W, int64_t bytes, const Acts& a, int64_t M, int64_t n0, int64_t n1, O* Y, int64_t ldy,
               Stream& pf) {
  float y[MR > 4 ? MR : 4];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = W + n * bytes;
    if constexpr (T < 10) {
      if (M == 1) {  // decode at batch 1: four weight rows at a time
        if (n + 4 <= n1) {
          row32xn<T, 4>(w, bytes, a, 0, y, pf.take(4 * bytes));
          for (int k = 0; k < 4; ++k) Y[n + k] = O(y[k]);
          n += 3;
        } else {
          row32xn<T, 1>(w, bytes, a, 0, y, pf.take(bytes));
          Y[n] = O(y[0]);
        }
        continue;
      }
    }
#ifdef KVQ_K512
    if constexpr (T == 12) {
      if (M == 1) {
        thread_local std::vector<int8_t> buf;
        const Acts ap = paired_x(a, buf);
        for (; n < n1; ++n) {
          rowsK1_512<T, true>(W + n * bytes, ap, 0, info(T).bytes, y, pf.take(bytes));
          Y[n] = O(y[0]);
        }
        return;
      }
    }
    if constexpr (T == 14) {
      if (M == 1) {
        rowsK1_512<T>(w, a, 0, info(T).bytes, y, pf.take(bytes));
        Y[n] = O(y[0]);
        continue;
      }
    }
#endif
    // Past one pass of MR rows of x, kTileRows weight rows at a time: each
    // pass's MR rows of quantized x are read from L1 by all of them, where a
    // weight row's passes over all M rows had evicted them before their next
    // use (K = 4096 at 16 rows: 64 KiB of x; measured 1.2x at 8B's shapes).
    const int64_t nw = M > MR ? std::min<int64_t>(kTileRows, n1 - n) : 1;
    const Span span = pf.take(nw * bytes);
    for (const char* at = span.p; at < span.p + span.bytes; at += 64) _mm_prefetch(at, _MM_HINT_T0);
    for (int64_t m = 0; m < M; m += MR) {
      const int r = int(std::min<int64_t>(MR, M - m));
      for (int64_t j = 0; j < nw; ++j) {
        if (r == MR) rows<T, MR>(w + j * bytes, a, m, y, 1);
        else tail<T>(r, w + j * bytes, a, m, y, 1);
        for (int k = 0; k < r; ++k) Y[(m + k) * ldy + n + j] = O(y[k]);
      }
    }
    n += nw - 1;
  }
}

template <typename O>
void gemm_rows_of(int64_t t, const uint8_t* W, int64_t bytes, const Acts& a, int64_t M, int64_t n0, int64_t n1, O* Y,
                  int64_t ldy, Stream& pf) {
  switch (t) {
#define KVQ_ROWS(T) case T: return gemm_rows<T>(W, bytes, a, M, n0, n1, Y, ldy, pf);
    KVQ_TYPES(KVQ_ROWS)
  }
}
#else
#define KVQ_PATH "none"
#endif

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

// One weight of a dots call: its blocks [n, bytes] and ggml type, and its
// panels packed at load where it has them (packed_panels), else null.
struct Part { const uint8_t* w; int64_t t, n, bytes; const uint8_t* packed = nullptr; };

// The weights whose panels were packed at load (quant/panels.py): a weight
// (its blocks' address, rows and type) to its packed panels. The ops take
// the blocks as before, wherever they come from (the one-call decoder layer,
// the Python layers), and dots() finds the panels here. An entry holds a
// reference to the blocks, so no other weight can take their address while
// it lasts; Python removes it (unregister_panels) when the panels are freed.
struct PackedEntry { at::Tensor blocks; const uint8_t* panels; int64_t t, n; };
struct PackedRegistry {
  std::mutex mu;
  std::unordered_map<int64_t, PackedEntry> by_handle;
  std::unordered_multimap<const uint8_t*, int64_t> by_blocks;  // the blocks' address to handles
  std::atomic<int64_t> size{0};  // read without the lock: no packed weight, no lookup
  int64_t next = 1;
};
PackedRegistry& packed_registry() {
  static PackedRegistry r;
  return r;
}

const uint8_t* packed_panels(const uint8_t* w, int64_t t, int64_t n) {
  if (t != 12 && t != 14) return nullptr;
  PackedRegistry& r = packed_registry();
  if (r.size.load(std::memory_order_relaxed) == 0) return nullptr;
  std::lock_guard<std::mutex> lock(r.mu);
  const auto [lo, hi] = r.by_blocks.equal_range(w);
  for (auto it = lo; it != hi; ++it) {
    const PackedEntry& e = r.by_handle.at(it->second);
    if (e.t == t && e.n == n) return e.panels;
  }
  return nullptr;
}

#ifdef KVQ_SIMD
// A decode step multiplies its weights in the same order every step (a
// layer's qkv, o, gate_up and down, then the next layer's). Each calling
// thread remembers which call followed which (keyed by the first part's
// blocks), and each share of a call streams on into its share of the next
// call's weights: the next call's first rows arrive prefetched, not at the
// latency of their first reads (Stream stops kAhead past the share's reads).
// A wrong guess (the first step, a weight freed) costs a few prefetches.
struct Successor {
  const uint8_t* w[Stream::kMaxRanges];
  int64_t bytes[Stream::kMaxRanges];
  int n = 0;
  int64_t total = 0;
  // Adds share [j0, j1) of `tasks` of these bytes to pf.
  void add_share(Stream& pf, int64_t j0, int64_t j1, int64_t tasks) const {
    const int64_t b0 = total * j0 / tasks, b1 = total * j1 / tasks;
    int64_t at = 0;
    for (int k = 0; k < n; at += bytes[k++]) {
      const int64_t lo = std::max(b0, at), hi = std::min(b1, at + bytes[k]);
      if (lo < hi) pf.add(w[k] + (lo - at), hi - lo);
    }
  }
};

// The successor learned for this call (n == 0: none yet), after recording this call as the previous one's.
Successor learn_successor(const std::vector<Part>& parts) {
  thread_local std::unordered_map<const uint8_t*, Successor> next;
  thread_local const uint8_t* previous = nullptr;
  const uint8_t* key = parts[0].w;
  if (previous != nullptr && previous != key) {
    if (next.size() > 4096) next.clear();  // weights come and go (models loaded and freed): stay small
    Successor& s = next[previous];
    s.n = 0;
    s.total = 0;
    for (const Part& p : parts) {
      if (s.n == Stream::kMaxRanges) break;
      int64_t bytes = p.n * p.bytes;
      s.w[s.n] = p.w;
#ifdef KVQ_PREFILL_DOTS
      if (p.packed != nullptr) {  // what its dots read (its blocks' pages may be gone)
        s.w[s.n] = p.packed;
        bytes = packed_bytes_of(p.t) * (p.bytes / info(p.t).bytes) * ((p.n + kPanel - 1) / kPanel);
      }
#endif
      s.bytes[s.n++] = bytes;
      s.total += bytes;
    }
  }
  previous = key;
  const auto it = next.find(key);
  return it == next.end() ? Successor{} : it->second;
}
#endif

// y [M, sum n] = x @ [W_0; W_1; ...]^T by the integer dot products, in
// out_dtype (float32, or x's bf16: each value rounded once, as float32's
// .to(bf16) rounds it). The parts are the shards of a fused layer (q, k, v;
// gate, up), of one type or several (Q4_K_M's q/k in Q4_K, v in Q6_K): x is
// quantized once per block size, and all parts' rows are one parallel region,
// each thread an equal share of the weight bytes (the work at decode sizes),
// not of the rows, so a Q6_K part's heavier rows do not leave a thread idle.
// into: y's buffer (contiguous [M, sum n] of out_dtype; the one-call decoder
// layer's workspace), or undefined to allocate it.
at::Tensor dots(const at::Tensor& x_in, const std::vector<Part>& parts, at::ScalarType out_dtype,
                const at::Tensor& into = {}) {
  TORCH_CHECK(x_in.dim() == 2, "quant_gemm: x must be [M, K]");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "quant_gemm: out must be float32 or bf16");
  const bool bf16_in = x_in.scalar_type() == at::kBFloat16;
  const at::Tensor x = bf16_in ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  int64_t N = 0, total = 0;
  bool has32 = false, has256 = false;
  for (const Part& p : parts) {
    const TypeInfo ti = info(p.t);
    TORCH_CHECK(K % ti.block == 0 && p.bytes == K / ti.block * ti.bytes, "quant_gemm: K does not match the row bytes");
    (ti.block == 32 ? has32 : has256) = true;
    N += p.n;
    total += p.n * p.bytes;
  }
  TORCH_CHECK(!into.defined() || (into.dim() == 2 && into.size(0) == M && into.size(1) == N && into.is_contiguous() &&
                                  into.scalar_type() == out_dtype),
              "quant_gemm: out must be contiguous [M, N] of the output dtype");
  at::Tensor y = into.defined() ? into : at::empty({M, N}, out_dtype);
#ifdef KVQ_SIMD
  if (M == 0 || N == 0) return y;
  auto quantize = [&](int64_t B) {
    return bf16_in ? quantize_rows(x.data_ptr<at::BFloat16>(), M, K, B) : quantize_rows(x.data_ptr<float>(), M, K, B);
  };
  const Acts a32 = has32 ? quantize(32) : Acts{}, a256 = has256 ? quantize(256) : Acts{};
  const bool bf16_out = out_dtype == at::kBFloat16;
  // Thread j takes the rows whose bytes start in [j * total / tasks, (j + 1) * total / tasks),
  // boundaries rounded to 16 rows (the one-row dot's groups of four stay whole, and so
  // do packed panels).
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (N + 7) / 8));
  struct Share { int64_t n0, n1, col; };
  // Part k's rows in the share of bytes [b0, b1) (last: the last share) and its first output column.
  auto share_of = [&](size_t k, int64_t b0, int64_t b1, bool last) {
    int64_t col = 0, at_byte = 0;
    for (size_t i = 0; i < k; ++i) col += parts[i].n, at_byte += parts[i].n * parts[i].bytes;
    const Part& p = parts[k];
    auto row_at = [&](int64_t b) {  // the first row of p whose bytes start at or after byte b, to 8 rows
      if (b <= at_byte) return int64_t(0);
      if (b >= at_byte + p.n * p.bytes) return p.n;
      return std::min(p.n, ((b - at_byte + p.bytes - 1) / p.bytes + 15) / 16 * 16);
    };
    return Share{row_at(b0), last ? p.n : row_at(b1), col};
  };
  const Successor successor = learn_successor(parts);
  auto run = [&](int64_t j0, int64_t j1) {
    const int64_t b0 = total * j0 / tasks, b1 = total * j1 / tasks;
    Stream pf;  // this share's bytes, all parts, in the order it reads them, then its share of the next call's
    for (size_t k = 0; k < parts.size(); ++k) {
      const Share sh = share_of(k, b0, b1, j1 == tasks);
#ifdef KVQ_PREFILL_DOTS
      if (parts[k].packed != nullptr) {  // the packed panels are what the dots read
        const int64_t pb = packed_bytes_of(parts[k].t) * (K / 256);  // a panel's
        pf.add(parts[k].packed + sh.n0 / kPanel * pb, (sh.n1 - sh.n0 + kPanel - 1) / kPanel * pb);
        continue;
      }
#endif
      pf.add(parts[k].w + sh.n0 * parts[k].bytes, (sh.n1 - sh.n0) * parts[k].bytes);
    }
    successor.add_share(pf, j0, j1, tasks);
    for (size_t k = 0; k < parts.size(); ++k) {
      const Part& p = parts[k];
      const Share sh = share_of(k, b0, b1, j1 == tasks);
      if (sh.n0 < sh.n1) {
        const Acts& a = info(p.t).block == 32 ? a32 : a256;
#ifdef KVQ_PREFILL_DOTS
        if (M < prefill_dots_min_rows(info(p.t).block) && p.packed != nullptr) {
          if (bf16_out) packed_rows_of(p.t, p.packed, a, M, sh.n0, sh.n1, y.data_ptr<at::BFloat16>() + sh.col, N, pf);
          else packed_rows_of(p.t, p.packed, a, M, sh.n0, sh.n1, y.data_ptr<float>() + sh.col, N, pf);
          continue;
        }
        if (M >= prefill_dots_min_rows(info(p.t).block) && p.packed != nullptr) {
          if (bf16_out) prefill_rows_packed_of(p.t, p.packed, a, M, sh.n0, sh.n1, y.data_ptr<at::BFloat16>() + sh.col, N);
          else prefill_rows_packed_of(p.t, p.packed, a, M, sh.n0, sh.n1, y.data_ptr<float>() + sh.col, N);
          continue;
        }
        if (M >= prefill_dots_min_rows(info(p.t).block) && has_prefill_rows(p.t)) {
          if (bf16_out) prefill_rows_of(p.t, p.w, p.bytes, a, M, sh.n0, sh.n1, y.data_ptr<at::BFloat16>() + sh.col, N);
          else prefill_rows_of(p.t, p.w, p.bytes, a, M, sh.n0, sh.n1, y.data_ptr<float>() + sh.col, N);
          continue;
        }
#endif
        if (bf16_out) gemm_rows_of(p.t, p.w, p.bytes, a, M, sh.n0, sh.n1, y.data_ptr<at::BFloat16>() + sh.col, N, pf);
        else gemm_rows_of(p.t, p.w, p.bytes, a, M, sh.n0, sh.n1, y.data_ptr<float>() + sh.col, N, pf);
      }
    }
  };
  // One thread's share runs inline: no parallel region to start or to wait on.
  if (tasks == 1) run(0, 1);
  else at::parallel_for(0, tasks, 1, run);
  return y;
#else
  TORCH_CHECK(false, "quant_gemm: built without AVX2");
#endif
}

Part part_of(const at::Tensor& w, int64_t t, int64_t n) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(0) == n,
              "quant_gemm: w must be contiguous uint8 [n, bytes]");
  return Part{w.data_ptr<uint8_t>(), t, n, w.size(1), packed_panels(w.data_ptr<uint8_t>(), t, n)};
}

// Bytes of w's packed panels (quant_prefill_dots.h's pack_panels): 0 where
// this build or type t has none (only Q4_K and Q6_K are packed).
int64_t packed_panel_bytes(int64_t t, int64_t n, int64_t K) {
  info(t);
#ifdef KVQ_PREFILL_DOTS
  return packed_bytes_of(t) * ((n + kPanel - 1) / kPanel) * (K / 256);
#else
  return 0;
#endif
}

// w's [n, bytes] blocks packed into out (uint8, packed_panel_bytes of them).
void pack_panels_into(const at::Tensor& w, int64_t t, at::Tensor out) {
  const int64_t n = w.size(0), K = w.size(1) / info(t).bytes * info(t).block;
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "quant_gemm: w must be contiguous uint8 [n, bytes]");
  const int64_t want = packed_panel_bytes(t, n, K);
  TORCH_CHECK(want > 0, "quant_gemm: type ", t, " has no packed panels in this build");
  TORCH_CHECK(out.dtype() == at::kByte && out.is_contiguous() && out.numel() == want,
              "quant_gemm: packed panels need ", want, " contiguous bytes");
#ifdef KVQ_PREFILL_DOTS
  const uint8_t* W = w.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  if (t == 12) pack_panels<12>(W, w.size(1), n, K / 256, o);
  else pack_panels<14>(W, w.size(1), n, K / 256, o);
#endif
}

// Rows ids of w dequantized from its registered packed panels into out
// [len(ids), K] float32 or bf16 (dequant_into's values from the blocks);
// false (nothing written) where w has none.
bool dequant_packed_rows(const at::Tensor& w, int64_t t, const at::Tensor& ids, const at::Tensor& out) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == at::kByte, "quant_gemm: w must be uint8 [n, bytes]");
  const int64_t n = w.size(0);
  const uint8_t* packed = packed_panels(w.data_ptr<uint8_t>(), t, n);
  if (packed == nullptr) return false;
#ifdef KVQ_PREFILL_DOTS
  const int64_t nb = w.size(1) / info(t).bytes, K = nb * 256;
  const at::Tensor idx = ids.to(at::kLong).contiguous().reshape({-1});
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == idx.numel() && out.size(1) == K &&
                  (bf16 || out.scalar_type() == at::kFloat),
              "quant_gemm: out must be contiguous [len(ids), K] float32 or bf16");
  const int64_t* r = idx.data_ptr<int64_t>();
  for (int64_t k = 0; k < idx.numel(); ++k) {
    TORCH_CHECK(r[k] >= 0 && r[k] < n, "quant_gemm: row id ", r[k], " is outside [0, ", n, ")");
    if (bf16) {
      at::BFloat16* o = out.data_ptr<at::BFloat16>() + k * K;
      t == 12 ? dequant_packed_row<12>(packed, r[k], nb, o) : dequant_packed_row<14>(packed, r[k], nb, o);
    } else {
      float* o = out.data_ptr<float>() + k * K;
      t == 12 ? dequant_packed_row<12>(packed, r[k], nb, o) : dequant_packed_row<14>(packed, r[k], nb, o);
    }
  }
  return true;
#else
  return false;
#endif
}

// From now on dots() over w (its blocks, type t) read these packed panels
// where it takes the prefill kernels. A handle for unregister_panels.
int64_t register_panels(const at::Tensor& w, int64_t t, const at::Tensor& panels) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == at::kByte && w.is_contiguous(), "quant_gemm: w must be contiguous uint8 [n, bytes]");
  const int64_t K = w.size(1) / info(t).bytes * info(t).block;
  TORCH_CHECK(panels.dtype() == at::kByte && panels.is_contiguous() && packed_panel_bytes(t, w.size(0), K) > 0 &&
                  panels.numel() == packed_panel_bytes(t, w.size(0), K),
              "quant_gemm: panels do not fit w");
  PackedRegistry& r = packed_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const int64_t h = r.next++;
  r.by_handle[h] = PackedEntry{w, panels.data_ptr<uint8_t>(), t, w.size(0)};
  r.by_blocks.emplace(w.data_ptr<uint8_t>(), h);
  r.size = int64_t(r.by_handle.size());
  return h;
}

void unregister_panels(int64_t handle) {
  PackedRegistry& r = packed_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto it = r.by_handle.find(handle);
  if (it == r.by_handle.end()) return;
  const auto [lo, hi] = r.by_blocks.equal_range(it->second.blocks.data_ptr<uint8_t>());
  for (auto b = lo; b != hi; ++b)
    if (b->second == handle) { r.by_blocks.erase(b); break; }
  r.by_handle.erase(it);
  r.size = int64_t(r.by_handle.size());
}

at::Tensor gemm_dots(const at::Tensor& x, const at::Tensor& w, int64_t t, int64_t n, at::ScalarType out_dtype) {
  info(t);  // an unknown type is refused before anything else
  return dots(x, {part_of(w, t, n)}, out_dtype);
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& w, int64_t t, int64_t n) {
  return gemm_dots(x, w, t, n, at::kFloat);
}

// The tile path's buffer, one per calling thread, kept between calls (a fresh
// 4 MiB buffer costs ~1000 page faults, as long as dequantizing a tile).
at::Tensor tile_buffer(int64_t numel) {
  thread_local at::Tensor buf;
  if (!buf.defined() || buf.numel() < numel) buf = at::empty({numel}, at::kBFloat16);
  return buf;
}

// quant/kernels.py's linear(x, w) (its constants are the arguments): y = x @ W^T
// in x's dtype; M below dots_max_rows by the integer dots, else through bf16
// tiles of weight rows (tile_bytes, small_tile_bytes up to small_max_rows rows
// of x) multiplied by oneDNN, as w @ x^T up to transposed_max_rows rows. The
// one-call decoder layer calls this for a GGUF weight; the Python layer calls
// the same.
at::Tensor tiles(const at::Tensor& x, const at::Tensor& w, int64_t t, int64_t n, int64_t tile_bytes,
                 int64_t small_tile_bytes, int64_t small_max_rows, int64_t transposed_max_rows) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.size(0) == n, "quant_gemm: w must be uint8 [n, bytes]");
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor xd = x.to(at::kBFloat16);
  const int64_t bytes = M > small_max_rows ? tile_bytes : std::min(tile_bytes, small_tile_bytes);
  const int64_t rows = std::max<int64_t>(16, bytes / (K * 2));
  const at::Tensor tile = tile_buffer(std::min(rows, n) * K);
  at::Tensor y = at::empty({M, n}, x.scalar_type());
  const bool transposed = M <= transposed_max_rows;
  for (int64_t start = 0; start < n; start += rows) {
    const int64_t stop = std::min(start + rows, n);
    const at::Tensor wt = tile.narrow(0, 0, (stop - start) * K).view({stop - start, K});
    // A packed weight's blocks may be handed back: its tiles from its panels (dequant's bits).
    if (!dequant_packed_rows(w, t, at::arange(start, stop, at::kLong), wt)) dequant_into(w.narrow(0, start, stop - start), t, wt);
    y.narrow(1, start, stop - start).copy_(transposed ? at::matmul(wt, xd.t()).t() : at::matmul(xd, wt.t()));
  }
  return y;
}

bool simd() { return std::string(KVQ_PATH) != "none"; }

at::Tensor dots_in(const at::Tensor& x, const std::vector<Part>& parts) {
  const at::ScalarType dtype = x.scalar_type();
  return dtype == at::kFloat || dtype == at::kBFloat16 ? dots(x, parts, dtype) : dots(x, parts, at::kFloat).to(dtype);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t t, int64_t n, int64_t dots_max_rows,
                  int64_t tile_bytes, int64_t small_tile_bytes, int64_t small_max_rows, int64_t transposed_max_rows) {
  TORCH_CHECK(x.dim() == 2, "quant_gemm: x must be [M, K]");
  info(t);
  if (x.size(0) < dots_max_rows && simd()) return dots_in(x, {part_of(w, t, n)});
  return tiles(x, w, t, n, tile_bytes, small_tile_bytes, small_max_rows, transposed_max_rows);
}

// linear's path constants as kernels.py last set them (configure, at load),
// for layer_linear: the one-call decoder layer's matmul of a GGUF weight.
struct LinearConfig { int64_t dots_max_32 = 12, dots_max_256 = 20, tile_bytes = 4 << 20, small_tile_bytes = 1 << 20,
                      small_max_rows = 16, transposed_max_rows = 64; };
LinearConfig& linear_config() {
  static LinearConfig c;
  return c;
}

void configure(int64_t dots_max_32, int64_t dots_max_256, int64_t tile_bytes, int64_t small_tile_bytes,
               int64_t small_max_rows, int64_t transposed_max_rows, int64_t prefill_dots_from_32,
               int64_t prefill_dots_from_256, int64_t panel_far_ahead) {
  TORCH_CHECK(panel_far_ahead >= 0, "quant_gemm: panel_far_ahead must be >= 0");
  linear_config() = {dots_max_32, dots_max_256, tile_bytes, small_tile_bytes, small_max_rows, transposed_max_rows};
#ifdef KVQ_PREFILL_DOTS
  prefill_dots_min_rows(32) = prefill_dots_from_32;
  prefill_dots_min_rows(256) = prefill_dots_from_256;
  far_ahead_bytes = panel_far_ahead / 64 * 64;
#endif
}

// Whether this build has prefill-sized dots (quant_prefill_dots.h) for type t.
bool prefill_dots(int64_t t) {
  info(t);
#ifdef KVQ_PREFILL_DOTS
  return has_prefill_rows(t);
#else
  return false;
#endif
}

// From how many rows of x a weight of type t takes the tiles.
int64_t dots_max(const LinearConfig& c, int64_t t) { return info(t).block == 32 ? c.dots_max_32 : c.dots_max_256; }

at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& w, int64_t t, int64_t n) {
  const LinearConfig& c = linear_config();
  return linear(x, w, t, n, dots_max(c, t), c.tile_bytes, c.small_tile_bytes, c.small_max_rows,
                c.transposed_max_rows);
}

// A fused layer kept as several weights (its shards, of one type or mixed:
// layers/gguf.py), x @ [W_0; W_1; ...]^T in x's dtype with the configured
// paths: where every part takes the dots at x's rows, one dots call (x
// quantized once per block size, one parallel region); else each part by
// layer_linear, concatenated. Each output column is the value layer_linear
// gives for its part alone, to the bit.
at::Tensor layer_linear_parts(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types) {
  TORCH_CHECK(x.dim() == 2, "quant_gemm: x must be [M, K]");
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "quant_gemm: one type per part");
  const LinearConfig& c = linear_config();
  bool all_dots = simd();
  std::vector<Part> parts;
  for (size_t i = 0; i < ws.size(); ++i) {
    all_dots = all_dots && x.size(0) < dots_max(c, types[i]);
    parts.push_back(part_of(ws[i], types[i], ws[i].size(0)));
  }
  if (all_dots) return dots_in(x, parts);
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < ws.size(); ++i) ys.push_back(layer_linear(x, ws[i], types[i], ws[i].size(0)));
  return ys.size() == 1 ? ys[0] : at::cat(ys, 1);
}

// layer_linear and layer_linear_parts into out [M, sum n] of x's dtype (the
// one-call decoder layer's workspace): the dots write there directly; the
// other paths' result is copied in (the same bits either way).
void layer_linear_parts_out(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2, "quant_gemm: x must be [M, K]");
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "quant_gemm: one type per part");
  const LinearConfig& c = linear_config();
  const at::ScalarType dtype = x.scalar_type();
  bool all_dots = simd() && (dtype == at::kFloat || dtype == at::kBFloat16);
  std::vector<Part> parts;
  for (size_t i = 0; i < ws.size(); ++i) {
    all_dots = all_dots && x.size(0) < dots_max(c, types[i]);
    parts.push_back(part_of(ws[i], types[i], ws[i].size(0)));
  }
  if (all_dots) dots(x, parts, dtype, out);
  else out.copy_(layer_linear_parts(x, ws, types));
}

void layer_linear_out(const at::Tensor& x, const at::Tensor& w, int64_t t, int64_t n, at::Tensor out) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == n, "quant_gemm: w must be uint8 [n, bytes]");
  layer_linear_parts_out(x, {w}, {t}, out);
}

std::string path() { return KVQ_PATH; }

}  // namespace

TORCH_LIBRARY(kvferry_quant, m) {
  m.def("gemm(Tensor x, Tensor w, int type, int n) -> Tensor", &gemm);
  m.def("linear(Tensor x, Tensor w, int type, int n, int dots_max_rows, int tile_bytes, int small_tile_bytes, "
        "int small_max_rows, int transposed_max_rows) -> Tensor", &linear);
  m.def("configure(int dots_max_32, int dots_max_256, int tile_bytes, int small_tile_bytes, int small_max_rows, "
        "int transposed_max_rows, int prefill_dots_from_32, int prefill_dots_from_256, int panel_far_ahead) -> ()", &configure);
  m.def("prefill_dots(int type) -> bool", &prefill_dots);
  m.def("layer_linear(Tensor x, Tensor w, int type, int n) -> Tensor", &layer_linear);
  m.def("layer_linear_parts(Tensor x, Tensor[] ws, int[] types) -> Tensor", &layer_linear_parts);
  m.def("layer_linear_out(Tensor x, Tensor w, int type, int n, Tensor(a!) out) -> ()", &layer_linear_out);
  m.def("layer_linear_parts_out(Tensor x, Tensor[] ws, int[] types, Tensor(a!) out) -> ()", &layer_linear_parts_out);
  m.def("dequant(Tensor w, int type, int K) -> Tensor", &dequant);
  m.def("dequant_into(Tensor w, int type, Tensor(a!) out) -> ()", &dequant_into);
  m.def("path() -> str", &path);
  m.def("packed_panel_bytes(int type, int n, int K) -> int", &packed_panel_bytes);
  m.def("pack_panels_into(Tensor w, int type, Tensor(a!) out) -> ()", &pack_panels_into);
  m.def("register_panels(Tensor w, int type, Tensor panels) -> int", &register_panels);
  m.def("dequant_packed_rows(Tensor w, int type, Tensor ids, Tensor(a!) out) -> bool", &dequant_packed_rows);
  m.def("unregister_panels(int handle) -> ()", &unregister_panels);
}
