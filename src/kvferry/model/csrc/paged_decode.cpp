// Paged attention over one request's paged KV cache for each of its query
// tokens: single-token decode, speculative verify windows (k+1 tokens) and
// prefill chunks, fresh or over a cached context. CPU only; built at first use by
// paged_kernel.py.
//
// Layout (see attention.py): k_cache, v_cache [num_blocks, block_size, KVH, D];
// token p of sequence s lives in block block_tables[s][p / block_size] at
// offset p % block_size. Sequence s owns q rows query_starts[s] ..
// query_starts[s] + query_lens[s] - 1; they are its last query_lens[s]
// positions, so query token j (0-based) sits at position
// seq_lens[s] - query_lens[s] + j and sees positions 0 .. that one (causal
// inside the chunk). Nothing past seq_lens[s] is read, so unwritten
// (possibly NaN) slots never reach the output. paged_attention_tree takes
// draft trees too: a tree's chunk (up to 64 tokens) sees its cached
// context and, of its own tokens, those its row of ancestor bits names
// (tree_masks; run_tree).
//
// Work item = (sequence, block of up to 32 query tokens, kv_head): its
// M = tokens * G query vectors (G = H / KVH heads share the KV head) stream
// over the sequence's blocks once, a tile of up to 16 tokens (or a stripe of
// such tiles, run_staged) at a time; its K/V rows stay in cache while the M
// queries use them, so the context is read once per work item, not once per
// head or per query token. Splitting
// long chunks into query blocks lets one long prompt use every thread. Per tile and query: scores
// [<=16] = q . k * scale, an online softmax update in float32 (running max m,
// sum l, accumulator acc [D] rescaled once per tile), acc += p . V.
// Items are handed out longest first from a shared counter, so one thread
// never ends up with all the long sequences. A step of few items (decode at
// small batch) cuts long contexts into parts that run as items of their
// own and are merged after (split items: attend_all). A decode batch with
// enough sequences runs each sequence as one item over all its KV heads
// (float32: run_rows_f32_avx2 in the AVX2 build, run_rows_f32 in the
// AVX-512 one; a bf16 query over a bf16 or fp8 cache with AVX512-BF16:
// run_rows_bf16): the heads' tiles of a
// block run back to back, so the block is read as whole rows, contiguous,
// not as one head's slice of each row (see attend_all).
//
// Builds, chosen at compile time (-march=native, or -mno-avx512f when
// KVFERRY_KERNEL_ISA=avx2):
//   AVX-512 (head_dim % 16 == 0): cache rows read in place and widened in
//     registers; 16 token dot products reduced together by one transpose.
//     With AVX512-BF16, a bf16 query and bf16 cache (head_dim % 32 == 0) take
//     vdpbf16ps: bf16 pairs multiplied exactly, summed in float32. Items of
//     kStageMinQueries or more query vectors stage a stripe of tiles at a
//     time (K as dim pairs, V as token pairs: run_staged) and run each group
//     of queries over the whole stripe, its accumulators in registers where
//     they fit (staged_group, software pipelined across tiles); smaller
//     items read rows in place, tile by tile (run_inplace; decode items of
//     1-3 query vectors at head_dim 32/64, 1-2 at 128, take its compile-time
//     specialization run_inplace_fast). Both run up to 4
//     queries interleaved with a lazily rescaled online softmax.
//     A float32 query over a float32 cache (CPUs without bf16 run float32)
//     stages its items of kStageMinQueries or more query vectors likewise:
//     K transposed so that lane = token (a query's 16 scores are D FMAs with
//     q[d] broadcast, no horizontal sum), V rows copied (stage_tile_f32), 4
//     query groups over the stripe with accumulators in registers
//     (staged_group_f32); float32 FMAs throughout. Its decode items of 1-3
//     query vectors at head_dim 32/64 (1-2 at 128) take run_inplace_f32,
//     run_inplace_fast's float32 counterpart. Other items, and other dtype
//     pairs, take the per-query loop of run().
//   otherwise AVX2 (8 lanes; rows of other dtypes first converted into a
//     per-thread float buffer) or portable loops; float32 decode items of
//     1-3 query vectors at head_dim 32/64/128 take run_inplace_f32_avx2;
//     float32 items of 8 or more (prompt chunks, verify windows) stage
//     their tiles, K transposed as in staged_group_f32 (run_staged_avx2).
//   A float8_e5m2 or float8_e4m3fn cache (--kv-cache-dtype fp8_e5m2 /
//   fp8_e4m3; every value of either is exact in bf16 and in float) is
//   dequantized in registers as its rows are read, and attention is exactly that over the
//   K/V as float: under a bf16 query (head_dim % 32 == 0, AVX512-BF16 and
//   VBMI) the rows' bytes become the very bf16 vectors the bf16 kernels
//   build (fp8_to_bf16: vpermt2b table lookups), in place (run_inplace_fast)
//   or as tiles are staged (stage_tile_fp8), the kernels after that the
//   bf16 ones; other queries take the float32 kernels (staged_group_f32,
//   run_inplace_f32; run_inplace_f32_avx2 in the AVX2 build), rows widened
//   to float by vcvtph2ps (load8, load16). Half the bytes of a bf16 cache: decode, reading
//   scattered blocks from memory, takes ~0.5x the time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVFERRY_AVX512 1
constexpr bool kHaveAvx512 = true;
#else
constexpr bool kHaveAvx512 = false;
#endif
#if defined(KVFERRY_AVX512) && defined(__AVX512BF16__)
#define KVFERRY_AVX512_BF16 1
constexpr bool kHaveDpbf16 = true;
#else
constexpr bool kHaveDpbf16 = false;
#endif
// An fp8 cache under a bf16 query takes vdpbf16ps too where the CPU
// has AVX512-VBMI (vpermt2b: the rows' bytes converted to bf16 by a table
// lookup, see fp8_to_bf16); AVX512-BF16 CPUs without it (Cooper Lake) widen
// the rows to float instead (kWiden).
#if defined(KVFERRY_AVX512_BF16) && defined(__AVX512VBMI__)
#define KVFERRY_FP8_DPBF16 1
constexpr bool kHaveFp8Dpbf16 = true;
#else
constexpr bool kHaveFp8Dpbf16 = false;
#endif

// The fp8 KV caches (--kv-cache-dtype): one byte per element, no scale.
// float8_e5m2 (sign, 5 exponent bits, 2 mantissa bits) is the top byte of
// an IEEE fp16, so (uint16_t)byte << 8 read as fp16 is its exact value.
// float8_e4m3fn (sign, 4 exponent bits with bias 7, 3 mantissa bits, no
// inf, NaN only at 0x7F / 0xFF) is, shifted into an fp16's bits below its
// top exponent bit, its value times 2^-8 (subnormals too), so widening
// multiplies by 256 once (exact); its NaN bytes widen to 480 there (never
// written from finite K/V: the write saturates at 448). Rows are
// dequantized in registers as they are read; attention is exactly that
// over K/V as float (bf16 holds every value of both formats too).
template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, at::Float8_e5m2> || std::is_same_v<T, at::Float8_e4m3fn>;
// Cache / query dtype pairs whose AVX-512 (kWiden) items take the float32
// kernels (run_staged's stage_tile_f32, run_inplace_f32; the AVX2 build's
// run_inplace_f32_avx2): float32 over float32, and a query over an fp8
// cache, whose rows are widened to float as they are read (the query is
// float in Scratch::qf). Not bf16 where it takes vdpbf16ps over fp8: those
// kernels would be compiled once more (~7 s of the build) for the head_dims
// it leaves to kWiden (not a multiple of 32), which run()'s loop serves.
template <typename S, typename Q>
constexpr bool kWidenF32 = (std::is_same_v<S, float> && std::is_same_v<Q, float>) ||
                           (kIsFp8<S> && !(kHaveFp8Dpbf16 && std::is_same_v<Q, at::BFloat16>));

constexpr int64_t kTile = 16;  // tokens per tile (one AVX-512 register of scores)

// A cache line requested ahead of its use: into L1 (kL2Only false,
// prefetcht0) or into L2 only (prefetcht1, for lines wanted later). Written
// as asm because with __builtin_prefetch GCC 12 (-O3) left no prefetch
// instruction in this kernel's object code.
template <bool kL2Only>
inline void prefetch_line(const void* p) {
#if defined(__x86_64__)
  if constexpr (kL2Only) {
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  }
#else
  __builtin_prefetch(p, 0, kL2Only ? 2 : 3);
#endif
}

namespace {

// ---- three primitives over one block's rows (row t at base + t * stride) ----
//   block_scores:     s[t] = (q . k_t) * scale                      t < n
//   exp_sum:          p[t] = exp(s[t] - m) in place; returns sum_t p[t]
//   block_accumulate: acc += sum_t p[t] * v_t
// The AVX2 versions work on 8 tokens x 8 dims at a time; the portable ones
// are plain loops (also used for the tails).

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)

// [a0..a7] (8 vectors) -> one vector of their 8 horizontal sums.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // lanes: a0..a3 lo | a0..a3 hi
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The sum of a vector's 8 lanes, added in lane order (the softmax sums' last step).
inline float sum_lanes(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float total = 0.f;
  for (int j = 0; j < 8; ++j) total += lanes[j];
  return total;
}

// The largest of a vector's 8 lanes, in every lane.
inline __m256 max_lanes(__m256 v) {
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 0x01));
  v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  return _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
}

void block_scores(const float* __restrict q, const float* __restrict k, int64_t stride, int64_t n, int64_t dim,
                  float scale, float* __restrict s) {
  const int64_t dim8 = dim & ~int64_t{7};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const float* kt = k + t * stride;
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim8; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(kt + j * stride + d), qv, acc[j]);
    }
    _mm256_storeu_ps(s + t, hsum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]));
    for (int j = 0; j < 8; ++j) s[t + j] = (s[t + j] + dot(q + dim8, kt + j * stride + dim8, dim - dim8)) * scale;
  }
  for (; t < n; ++t) s[t] = dot(q, k + t * stride, dim) * scale;
}

// 8 consecutive cache elements as 8 floats (run_inplace_f32_avx2). An
// e5m2 byte is the top byte of an IEEE fp16: zero-extended to 16 bits,
// shifted up 8 and widened by F16C's vcvtph2ps, exactly. An e4m3 byte,
// sign-extended to 16 bits and shifted up 7, is S1EEEEMMM0000000: with
// the 1 (bit 14, the fp16's top exponent bit) cleared it is the fp16 of
// the value / 256.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Float8_e5m2* p) {
#if defined(__F16C__)
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}
inline __m256 load8(const at::Float8_e4m3fn* p) {
#if defined(__F16C__)
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(raw), 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}

// exp for x <= 0 (Cephes expf: range reduction to [-ln2/2, ln2/2], degree-5
// polynomial, scale by 2^n); within ~2 ulp of expf, 0 below -87.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

float exp_sum(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, p);
    sum = _mm256_add_ps(sum, p);
  }
  float total = sum_lanes(sum);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    total += s[t];
  }
  return total;
}

void block_accumulate(float* __restrict acc, const float* __restrict p, const float* __restrict v, int64_t stride,
                      int64_t n, int64_t dim) {
  int64_t d = 0;
  // 32 dims (4 registers) of acc stay in registers across the block's tokens.
  for (; d + 32 <= dim; d += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
    __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = v + t * stride + d;
      const __m256 pt = _mm256_set1_ps(p[t]);
      a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt), a0);
      a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8), a1);
      a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 16), a2);
      a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 24), a3);
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2);
    _mm256_storeu_ps(acc + d + 24, a3);
  }
  for (; d + 8 <= dim; d += 8) {
    __m256 a0 = _mm256_loadu_ps(acc + d);
    for (int64_t t = 0; t < n; ++t) a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(v + t * stride + d), a0);
    _mm256_storeu_ps(acc + d, a0);
  }
  for (; d < dim; ++d) {
    for (int64_t t = 0; t < n; ++t) acc[d] += p[t] * v[t * stride + d];
  }
}

// ---- The staged float32 group of the AVX2 build (prompt chunks, verify windows) ----
// The AVX2 counterpart of stage_tile_f32 / staged_group_f32: items of
// kStageMinQueriesAvx2 or more float32 query vectors (a float32 query over
// a float32 or fp8 cache) stage a tile of 16 tokens once for all of them,
// and groups of up to 4 queries run over it with every product a float32 FMA.

// 8 rows of 8 floats -> 8 vectors, vector i holding element i of each row.
inline void transpose8x8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// One staged tile of 16 tokens, dim % 8 == 0: kt [dim][2], lane j of
// kt[d][half] token 8 * half + j's dim d (8x8 transposes of the rows), so a
// query's 16 scores are dim x 2 FMAs with q[d] broadcast and no horizontal
// sum. K rows past n are zero, never read from the cache (an unwritten slot
// may hold NaN, and 0 * NaN would reach a score). Rows of an fp8 cache (T)
// are widened to float as they are staged (load8), V's too: vt [16][dim /
// 8] (kCopyV); a float32 cache's V rows are read in place.
template <bool kFull, bool kCopyV, typename T>
inline void stage_tile_f32_avx2(const T* const* krows, const T* const* vrows, int64_t n, int64_t dim,
                                __m256* __restrict kt, __m256* __restrict vt) {
  const __m256 zero = _mm256_setzero_ps();
  auto row = [&](const T* const* rows, int64_t t, int64_t c) __attribute__((always_inline)) {
    return kFull || t < n ? load8(rows[t] + 8 * c) : zero;
  };
  const int64_t chunks = dim / 8;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t half = 0; half < 2; ++half) {
      __m256 r[8];
      for (int64_t j = 0; j < 8; ++j) r[j] = row(krows, 8 * half + j, c);
      transpose8x8(r);
      for (int64_t i = 0; i < 8; ++i) kt[(8 * c + i) * 2 + half] = r[i];
    }
    if constexpr (kCopyV) {
      for (int64_t t = 0; t < kTile; ++t) vt[t * chunks + c] = row(vrows, t, c);
    }
  }
}

// Lazy rescaling as lazy_softmax's (kLazyRescale, AVX-512 builds), for the
// AVX2 kernels (staged_group_f32_avx2, run_inplace_f32_avx2): the running
// max m moves only when a score passes it by more than this.
constexpr float kLazyRescaleAvx2 = 8.f;
// Dims per score chain before it is restarted and summed: with runs of 32
// the error against a float64 softmax (fp8 e4m3 cache, peaked scores)
// measured 3.6x the tests' 1e-4 tolerance; runs of 16 pass, at the same speed.
constexpr int64_t kScoreRun = 16;

// Q float32 queries (q[k] [dim], scores scaled by `scale`) over `tiles`
// staged tiles (stage_tile_f32_avx2; tile t's K at kt + t * 2 * dim, its
// token j's V row at vrows[16 * t + j]): the online softmax (m[k], l[k])
// and acc[k] [dim] (natural order) updated in place. visible[k]: the
// positions of the stripe query k sees (visible[0] the most); tokens past
// them weigh 0, and V rows past every query's view are never read.
template <int Q>
__attribute__((flatten)) inline void staged_group_f32_avx2(const float* const* q, float* const* acc, float* m,
                                                           float* l, const int64_t* visible,
                                                           const __m256* __restrict kt,
                                                           const float* const* __restrict vrows, int64_t tiles,
                                                           int64_t dim, float scale) {
  const int64_t chunks = dim / 8;
  tiles = std::min(tiles, (visible[0] + kTile - 1) / kTile);
  const __m256 lane_lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 lane_hi = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 lsum[Q];  // per-lane partial sums of l; lane 0 starts with l[k]
  for (int k = 0; k < Q; ++k) lsum[k] = _mm256_setr_ps(l[k], 0, 0, 0, 0, 0, 0, 0);
  alignas(32) float pf[Q][kTile];  // this tile's weights; zero past the visible tokens
  for (int64_t t = 0; t < tiles; ++t) {
    const __m256* tk = kt + t * 2 * dim;
    const float* const* tv = vrows + t * kTile;
    // Scores: 2 x Q independent FMA chains, restarted every kScoreRun dims
    // and summed (as staged_group_f32: one chain over a long head_dim rounds worse).
    __m256 s[Q][2];
    for (int64_t d0 = 0; d0 < dim; d0 += kScoreRun) {
      __m256 c[Q][2];
      for (int k = 0; k < Q; ++k) c[k][0] = c[k][1] = _mm256_setzero_ps();
      const int64_t d1 = std::min(dim, d0 + kScoreRun);
      for (int64_t d = d0; d < d1; ++d) {
        const __m256 k0 = tk[2 * d], k1 = tk[2 * d + 1];
        for (int k = 0; k < Q; ++k) {
          const __m256 b = _mm256_broadcast_ss(q[k] + d);
          c[k][0] = _mm256_fmadd_ps(b, k0, c[k][0]);
          c[k][1] = _mm256_fmadd_ps(b, k1, c[k][1]);
        }
      }
      for (int k = 0; k < Q; ++k) {
        for (int i = 0; i < 2; ++i) s[k][i] = d0 == 0 ? c[k][i] : _mm256_add_ps(s[k][i], c[k][i]);
      }
    }
    // Softmax: p = exp(s - m) over the visible lanes.
    float alpha[Q];
    int64_t n_max = 0;
    for (int k = 0; k < Q; ++k) {
      const int64_t n = std::min(kTile, visible[k] - t * kTile);
      alpha[k] = 1.f;
      if (n <= 0) {
        _mm256_store_ps(pf[k], _mm256_setzero_ps());
        _mm256_store_ps(pf[k] + 8, _mm256_setzero_ps());
        continue;
      }
      n_max = std::max(n_max, n);
      const __m256 nv = _mm256_set1_ps(static_cast<float>(n));
      const __m256 valid0 = _mm256_cmp_ps(lane_lo, nv, _CMP_LT_OQ), valid1 = _mm256_cmp_ps(lane_hi, nv, _CMP_LT_OQ);
      const __m256 sc = _mm256_set1_ps(scale);
      const __m256 s0 = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(s[k][0], sc), valid0);
      const __m256 s1 = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(s[k][1], sc), valid1);
      const __m256 bound = _mm256_set1_ps(m[k] + kLazyRescaleAvx2);
      const __m256 over = _mm256_or_ps(_mm256_cmp_ps(s0, bound, _CMP_GT_OQ), _mm256_cmp_ps(s1, bound, _CMP_GT_OQ));
      if (_mm256_movemask_ps(over)) {
        const float tile_max = _mm256_cvtss_f32(max_lanes(_mm256_max_ps(s0, s1)));
        alpha[k] = std::exp(m[k] - tile_max);  // exp(-inf) = 0 on the first tile
        lsum[k] = _mm256_mul_ps(lsum[k], _mm256_set1_ps(alpha[k]));
        m[k] = tile_max;
      }
      const __m256 mv = _mm256_set1_ps(m[k]);
      // exp256 of -inf lanes is clamped, not 0: the mask zeroes them.
      const __m256 p0 = _mm256_and_ps(exp256(_mm256_sub_ps(s0, mv)), valid0);
      const __m256 p1 = _mm256_and_ps(exp256(_mm256_sub_ps(s1, mv)), valid1);
      lsum[k] = _mm256_add_ps(lsum[k], _mm256_add_ps(p0, p1));
      _mm256_store_ps(pf[k], p0);
      _mm256_store_ps(pf[k] + 8, p1);
    }
    // P . V: acc = acc * alpha + p . V in passes of 16 dims (2 registers) per
    // query, Q x 2 accumulators; tokens past every query's view are skipped.
    __m256 av[Q];
    for (int k = 0; k < Q; ++k) av[k] = _mm256_set1_ps(alpha[k]);
    int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) {
      __m256 o[Q][2];
      for (int k = 0; k < Q; ++k) {
        o[k][0] = _mm256_mul_ps(_mm256_loadu_ps(acc[k] + 8 * c), av[k]);
        o[k][1] = _mm256_mul_ps(_mm256_loadu_ps(acc[k] + 8 * c + 8), av[k]);
      }
      for (int64_t j = 0; j < n_max; ++j) {
        const __m256 v0 = _mm256_loadu_ps(tv[j] + 8 * c), v1 = _mm256_loadu_ps(tv[j] + 8 * c + 8);
        for (int k = 0; k < Q; ++k) {
          const __m256 p = _mm256_broadcast_ss(pf[k] + j);
          o[k][0] = _mm256_fmadd_ps(p, v0, o[k][0]);
          o[k][1] = _mm256_fmadd_ps(p, v1, o[k][1]);
        }
      }
      for (int k = 0; k < Q; ++k) {
        _mm256_storeu_ps(acc[k] + 8 * c, o[k][0]);
        _mm256_storeu_ps(acc[k] + 8 * c + 8, o[k][1]);
      }
    }
    if (c < chunks) {  // dim % 16 == 8
      __m256 o[Q];
      for (int k = 0; k < Q; ++k) o[k] = _mm256_mul_ps(_mm256_loadu_ps(acc[k] + 8 * c), av[k]);
      for (int64_t j = 0; j < n_max; ++j) {
        const __m256 v0 = _mm256_loadu_ps(tv[j] + 8 * c);
        for (int k = 0; k < Q; ++k) o[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(pf[k] + j), v0, o[k]);
      }
      for (int k = 0; k < Q; ++k) _mm256_storeu_ps(acc[k] + 8 * c, o[k]);
    }
  }
  for (int k = 0; k < Q; ++k) l[k] = sum_lanes(lsum[k]);
}

#else  // portable

void block_scores(const float* __restrict q, const float* __restrict k, int64_t stride, int64_t n, int64_t dim,
                  float scale, float* __restrict s) {
  for (int64_t t = 0; t < n; ++t) s[t] = dot(q, k + t * stride, dim) * scale;
}

float exp_sum(float* s, int64_t n, float m) {
  float total = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    total += s[t];
  }
  return total;
}

void block_accumulate(float* __restrict acc, const float* __restrict p, const float* __restrict v, int64_t stride,
                      int64_t n, int64_t dim) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t d = 0; d < dim; ++d) acc[d] += p[t] * v[t * stride + d];
  }
}

#endif

#ifdef KVFERRY_AVX512

// 16 consecutive cache elements as 16 floats.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  // bf16 is the high half of a float32: widen to 32 bits, shift up 16.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::Float8_e5m2* p) {  // bytes -> fp16 (<< 8) -> float, exact
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8));
}
inline __m512 load16(const at::Float8_e4m3fn* p) {  // bytes -> fp16 of value / 256 (see load8) -> float * 256, exact
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 7),
                                     _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

// v[0..15] -> one vector whose lane t is the horizontal sum of v[t].
// Three rounds of interleave-and-add (45 instructions for 16 sums, against
// about 8 per sum for one reduction at a time).
inline __m512 transpose_sum16(__m512 v[16]) {
  __m512 x[8], y[4];
  // Round 1, per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for a = v[2k], b = v[2k+1].
  for (int k = 0; k < 8; ++k) {
    x[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  }
  // Round 2, per 128-bit lane: the lane's sums of v[4k], v[4k+1], v[4k+2], v[4k+3].
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(x[2 * k]), b = _mm512_castps_pd(x[2 * k + 1]);
    // Shuffled as 64-bit pairs, added as floats.
    y[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Round 3: add the four 128-bit lanes of y[k] into lane k of the result.
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x44), _mm512_shuffle_f32x4(y[0], y[1], 0xEE));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x44), _mm512_shuffle_f32x4(y[2], y[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// s[t] = (q . k_t) * scale for t < n <= 16; float q [dim], dim % 16 == 0.
template <typename scalar_t>
__m512 tile_scores16(const float* __restrict q, const scalar_t* __restrict k, int64_t stride, int64_t n,
                     int64_t dim, float scale) {
  __m512 acc[kTile];
  for (int64_t t = 0; t < kTile; ++t) acc[t] = _mm512_setzero_ps();
  // A full tile (the common case) with a constant trip count, so that acc stays in registers.
  auto body = [&](const int64_t nn) __attribute__((always_inline)) {
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      for (int64_t t = 0; t < nn; ++t) acc[t] = _mm512_fmadd_ps(load16(k + t * stride + d), qv, acc[t]);
    }
  };
  if (n == kTile) body(kTile); else body(n);
  return _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
}

#ifdef KVFERRY_AVX512_BF16
// The same for a bf16 query and bf16 rows, dim % 32 == 0: vdpbf16ps adds
// q[2i] k[2i] + q[2i+1] k[2i+1] (exact products) into each float32 lane.
__m512 tile_scores_dpbf16(const at::BFloat16* __restrict q, const at::BFloat16* __restrict k, int64_t stride,
                          int64_t n, int64_t dim, float scale) {
  __m512 acc[kTile];
  for (int64_t t = 0; t < kTile; ++t) acc[t] = _mm512_setzero_ps();
  auto body = [&](const int64_t nn) __attribute__((always_inline)) {
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
      for (int64_t t = 0; t < nn; ++t) {
        acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_loadu_si512(k + t * stride + d), qv);
      }
    }
  };
  if (n == kTile) body(kTile); else body(n);
  return _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
}

// P @ V with vdpbf16ps over pairs of tokens (see inplace_pv and staged_pv):
// interleaving rows t and t+1 (unpack, within 128-bit lanes) leaves acc in a
// permuted order: in each 32-dim chunk, position e holds dimension
// pair_dim(e); alpha and the final division act elementwise, and the output
// is un-permuted once per work item (finish).
inline int64_t pair_dim(int64_t e) {  // e in [0, 32)
  const int64_t hi = e / 16, lane = (e % 16) / 4, j = e % 4;
  return 8 * lane + 4 * hi + j;
}
#endif

#ifdef KVFERRY_FP8_DPBF16
// ---- fp8 rows as bf16 pairs, for vdpbf16ps ----
//
// A byte's bf16 is exact (every e5m2 and e4m3 value, subnormals included,
// is a bf16 normal; inf and NaN stay so) and is a lookup on the byte's 7 low bits:
// vpermt2b with a 128-entry table in two registers gives the bf16's low
// byte, another its high byte, the sign bit is ORed back into that (one
// vpternlogd), and unpacking the two interleaves them into words, within
// 128-bit lanes: bytes 0-7 of each lane into one register, 8-15 into
// another: 5 instructions per 64 elements, about half of what the way by
// float (vcvtph2ps, vcvtne2ps2bf16) or an exponent rebias (with fix-ups for
// zero, subnormals, inf and NaN) takes. Before the lookup one vpermb / vpermt2b arranges
// the bytes (of two tokens' rows at once for the in-place kernels) so that
// the words come out exactly as the bf16 kernels' unpacks of bf16 rows
// leave them (fp8_pair, fp8_row): every kernel after that is the bf16 one,
// accumulators in pair_dim order included, so the results are bit for bit
// those over the cache converted to bf16. Measured against widening the
// rows to float under the query as float (kWiden's run_inplace_f32; decode,
// batch 32, context 384, G = 3, head_dim 64, two threads): 0.7x the time
// warm, 0.8x with K/V from memory.
constexpr uint16_t fp8e5m2_bf16_bits(int i) {  // i: the byte without its sign bit
  const int e = i >> 2, m = i & 3;
  if (e == 31) return static_cast<uint16_t>(0x7F80 | (m << 5));                 // inf (m == 0), NaN
  if (e == 0) return m == 0 ? 0 : m == 1 ? 0x3780 : m == 2 ? 0x3800 : 0x3840;  // m * 2^-16
  return static_cast<uint16_t>(((e + 112) << 7) | (m << 5));                    // 2^(e - 15) (1 + m / 4)
}
constexpr uint16_t fp8e4m3_bf16_bits(int i) {  // i: the byte without its sign bit
  const int e = i >> 3, m = i & 7;
  if (i == 0x7F) return 0x7FC0;  // NaN (e4m3fn has no inf)
  if (e == 0) {                  // m * 2^-9: normalized as 1.f * 2^(-6 - s)
    if (m == 0) return 0;
    int s = 0;
    while ((m << s) < 8) ++s;
    return static_cast<uint16_t>(((121 - s) << 7) | (((m << s) & 7) << 4));
  }
  return static_cast<uint16_t>(((e + 120) << 7) | (m << 4));  // 2^(e - 7) (1 + m / 8)
}
template <typename T>
constexpr uint16_t fp8_bf16_bits(int i) {
  if constexpr (std::is_same_v<T, at::Float8_e5m2>) return fp8e5m2_bf16_bits(i);
  else return fp8e4m3_bf16_bits(i);
}

template <typename T>  // at::Float8_e5m2 or at::Float8_e4m3fn
struct Fp8Tables {
  alignas(64) uint8_t lo[128];  // the bf16's low byte, by the byte's 7 low bits
  alignas(64) uint8_t hi[128];  // its high byte, sign clear
  // vpermt2b indices (0-63: token a's 64 bytes, 64-127: token b's) of the
  // bytes of 32-dim chunk o (0, 1) of a pair of 64-byte row pieces, so that
  // fp8_to_bf16 gives, for rows A and B in bf16, K: unpack{lo,hi}_epi32(A,
  // B) (bytes 4u..4u+3 of a lane: dims 2u, 2u+1 of a, then of b), V:
  // unpack{lo,hi}_epi16(A, B) (dim by dim, a then b).
  alignas(64) uint8_t pair_k[2][64];
  alignas(64) uint8_t pair_v[2][64];
  // vpermb indices of one 64-byte row piece: fp8_to_bf16's lo is then dims
  // 0-31 in order, hi dims 32-63 (the staged tiles' rows).
  alignas(64) uint8_t row[64];
  constexpr Fp8Tables() : lo(), hi(), pair_k(), pair_v(), row() {
    for (int i = 0; i < 128; ++i) {
      lo[i] = static_cast<uint8_t>(fp8_bf16_bits<T>(i) & 0xFF);
      hi[i] = static_cast<uint8_t>(fp8_bf16_bits<T>(i) >> 8);
    }
    for (int o = 0; o < 2; ++o) {
      for (int lane = 0; lane < 4; ++lane) {
        for (int j = 0; j < 16; ++j) {
          const int dim = 32 * o + 8 * lane;
          pair_k[o][16 * lane + j] = static_cast<uint8_t>(64 * (j % 4 / 2) + dim + 2 * (j / 4) + j % 2);
          pair_v[o][16 * lane + j] = static_cast<uint8_t>(64 * (j % 2) + dim + j / 2);
        }
      }
    }
    for (int lane = 0; lane < 4; ++lane) {
      for (int j = 0; j < 16; ++j) row[16 * lane + j] = static_cast<uint8_t>(32 * (j / 8) + 8 * lane + j % 8);
    }
  }
};
template <typename T>
inline constexpr Fp8Tables<T> kFp8{};

inline __m512i fp8_table(const uint8_t* t) { return _mm512_load_si512(t); }

// 64 fp8 bytes (format T) -> their bf16 words: bytes 0-7 of each 128-bit lane into lo, 8-15 into hi.
template <typename T>
inline __attribute__((always_inline)) void fp8_to_bf16(__m512i x, __m512i& lo, __m512i& hi) {
  const __m512i l = _mm512_permutex2var_epi8(fp8_table(kFp8<T>.lo), x, fp8_table(kFp8<T>.lo + 64));
  const __m512i h = _mm512_permutex2var_epi8(fp8_table(kFp8<T>.hi), x, fp8_table(kFp8<T>.hi + 64));
  // h | (x & 0x80): the sign
  const __m512i hs = _mm512_ternarylogic_epi32(h, x, _mm512_set1_epi32(static_cast<int>(0x80808080u)), 0xF8);
  lo = _mm512_unpacklo_epi8(l, hs);
  hi = _mm512_unpackhi_epi8(l, hs);
}

// Tokens a and b: 64-byte pieces ra, rb of their rows (for head_dim 32 the
// low 32 bytes) -> the bf16 pairs of the pieces' 32-dim chunk o, as the
// bf16 kernels build them from bf16 rows A, B: kV false (K, scores):
// unpack{lo,hi}_epi32(A, B); kV true (V, P . V): unpack{lo,hi}_epi16(A, B).
template <bool kV, typename T>
inline __attribute__((always_inline)) void fp8_pair(__m512i ra, __m512i rb, int o, __m512i& lo, __m512i& hi) {
  const __m512i idx = fp8_table(kV ? kFp8<T>.pair_v[o] : kFp8<T>.pair_k[o]);
  fp8_to_bf16<T>(_mm512_permutex2var_epi8(ra, idx, rb), lo, hi);
}

// One 64-byte row piece -> its dims 0-31 (lo) and 32-63 (hi) as bf16, in order.
template <typename T>
inline __attribute__((always_inline)) void fp8_row(__m512i r, __m512i& lo, __m512i& hi) {
  fp8_to_bf16<T>(_mm512_permutexvar_epi8(fp8_table(kFp8<T>.row), r), lo, hi);
}

// 64 bytes of a row (32 for a 32-byte row: the rest unread), or zero past a tile's n tokens.
template <typename T>
inline __attribute__((always_inline)) __m512i fp8_piece(const T* p, int64_t bytes) {
  if (bytes >= 64) return _mm512_loadu_si512(p);
  return _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
// ---- The staged bf16 tile: re-laid out once, shared by every query of a work item ----
//
// kp [D/2] vectors: lane t of kp[i] is token t's dims (2i, 2i+1) as one bf16
// pair, so one query's 16 scores are D/2 vdpbf16ps with the query's pair i
// broadcast, landing one token per lane: no horizontal reduction per query.
// vp [8 token pairs][D/32 chunks][2]: tokens 2j and 2j+1 interleaved per dim
// (unpacklo/hi within 128-bit lanes), so acc += p . V is vdpbf16ps with the
// pair (p[2j], p[2j+1]) broadcast; acc comes out in pair_dim order per
// 32-dim chunk and is un-permuted once per work item. Rows past the tile's n
// tokens are zero (never read from the cache).

// 16 rows of 16 uint32 -> 16 columns: out[i] lane t = in[t] lane i.
// Three rounds of unpack inside 128-bit lanes, then a 4x4 transpose of the lanes.
inline void transpose16x16_epi32(const __m512i in[16], __m512i* __restrict out) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane L: rows 2k, 2k+1 at elements 4L..4L+1 | 4L+2..4L+3
    t[2 * k] = _mm512_unpacklo_epi32(in[2 * k], in[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(in[2 * k], in[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k + j], lane L: rows 4k..4k+3 at element 4L + j
    u[4 * k + 0] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // out[4L + j], lane k = u[4k + j], lane L
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    out[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    out[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    out[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    out[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// The staged float32 tile (float32 query and cache): kt [D] vectors, lane t
// of kt[d] is token t's dim d (16x16 transposes of the rows), so one query's
// 16 scores are D FMAs with q[d] broadcast, one token per lane, no
// horizontal reduction; vt [16 tokens][D/16]: the V rows as they are, copied
// so that a stripe sits contiguous in cache whatever blocks it spans. Rows
// past the tile's n tokens are zero (never read from the cache: an unwritten
// slot may hold NaN, and 0 * NaN would reach acc).
// kFull: n == 16, loads without per-row tests. Rows of an fp8 cache (T)
// are widened to float as they are staged (load16).
template <bool kFull, typename T>
inline void stage_tile_f32(const T* const* krows, const T* const* vrows, int64_t n, int64_t dim,
                           __m512i* __restrict kt, __m512i* __restrict vt) {
  const __m512i zero = _mm512_setzero_si512();
  auto row = [&](const T* const* rows, int64_t t, int64_t c) __attribute__((always_inline)) {
    return kFull || t < n ? _mm512_castps_si512(load16(rows[t] + 16 * c)) : zero;
  };
  const int64_t chunks = dim / 16;
  for (int64_t c = 0; c < chunks; ++c) {  // 16 dims = one 16x16 block
    __m512i in[16];
    for (int64_t t = 0; t < kTile; ++t) in[t] = row(krows, t, c);
    transpose16x16_epi32(in, kt + 16 * c);
    for (int64_t t = 0; t < kTile; ++t) vt[t * chunks + c] = row(vrows, t, c);
  }
}

#ifdef KVFERRY_AVX512_BF16
// rows[t] (t < n; D bf16 each) -> kp [D/2] and vp [8][D/32][2] as above.
// kFull: n == 16 (all but a sequence's last tile), loads without per-row tests.
template <bool kFull>
inline void stage_tile_bf16(const at::BFloat16* const* krows, const at::BFloat16* const* vrows, int64_t n, int64_t dim,
                            __m512i* __restrict kp, __m512i* __restrict vp) {
  const __m512i zero = _mm512_setzero_si512();
  auto row = [&](const at::BFloat16* const* rows, int64_t t, int64_t c) __attribute__((always_inline)) {
    return kFull || t < n ? _mm512_loadu_si512(rows[t] + 32 * c) : zero;
  };
  for (int64_t c = 0; c < dim / 32; ++c) {  // 32 dims = 16 pairs = one 16x16 block
    __m512i in[16];
    for (int64_t t = 0; t < kTile; ++t) in[t] = row(krows, t, c);
    transpose16x16_epi32(in, kp + 16 * c);
    for (int64_t j = 0; j < kTile / 2; ++j) {
      const __m512i x = row(vrows, 2 * j, c), y = row(vrows, 2 * j + 1, c);
      __m512i* out = vp + (j * (dim / 32) + c) * 2;
      out[0] = _mm512_unpacklo_epi16(x, y);
      out[1] = _mm512_unpackhi_epi16(x, y);
    }
  }
}
#endif  // KVFERRY_AVX512_BF16

#ifdef KVFERRY_FP8_DPBF16
// stage_tile_bf16 for fp8 rows (T: at::Float8_e5m2 / at::Float8_e4m3fn): the same kp and vp, the bytes
// converted to bf16 on the way, a 64-dim piece of the rows at a time (K
// rows by fp8_row, then transposed; V token pairs by fp8_pair, which gives
// the unpacks of stage_tile_bf16 directly).
template <bool kFull, typename T>
inline void stage_tile_fp8(const T* const* krows, const T* const* vrows, int64_t n, int64_t dim,
                           __m512i* __restrict kp, __m512i* __restrict vp) {
  const __m512i zero = _mm512_setzero_si512();
  const int64_t chunks = dim / 32;
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    const int64_t bytes = std::min<int64_t>(64, dim - d0);  // 64, or 32 at the end of a head_dim of 32 (mod 64)
    const int64_t c0 = d0 / 32;                             // the piece's first 32-dim chunk
    auto piece = [&](const T* const* rows, int64_t t) __attribute__((always_inline)) {
      return kFull || t < n ? fp8_piece(rows[t] + d0, bytes) : zero;
    };
    __m512i in0[16], in1[16];
    for (int64_t t = 0; t < kTile; ++t) fp8_row<T>(piece(krows, t), in0[t], in1[t]);
    transpose16x16_epi32(in0, kp + 16 * c0);
    if (bytes == 64) transpose16x16_epi32(in1, kp + 16 * (c0 + 1));
    for (int64_t j = 0; j < kTile / 2; ++j) {
      const __m512i x = piece(vrows, 2 * j), y = piece(vrows, 2 * j + 1);
      __m512i* out = vp + (j * chunks + c0) * 2;
      fp8_pair<true, T>(x, y, 0, out[0], out[1]);
      if (bytes == 64) fp8_pair<true, T>(x, y, 1, out[2], out[3]);
    }
  }
}
#endif

// exp for x <= 0, 16 lanes: the Cephes expf of exp256 above.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  // y * 2^n by one vscalefps, in place of building 2^n from n's bits
  // (cvtps2dq, vpaddd, vpslld, vmulps): the same value bit for bit (y * 2^n
  // is exact in both unless it is subnormal, and then both round the same
  // product; checked on every 7th float in [-88, 9]), three instructions
  // fewer (group_softmax).
  return _mm512_scalef_ps(y, fx);
}

// The same exp in fewer instructions: 2^(x log2 e) as 2^n (vscalefps) times
// a degree-5 polynomial for 2^f, f in [-1/2, 1/2] (relative error 1.5e-7,
// as exp512's); 0 below -87 like exp512.
inline __m512 exp512_scalef(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fmsub_ps(x, log2e, n);
  __m512 y = _mm512_set1_ps(0.0013277444522827864f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.009675883688032627f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.05550713092088699f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.24022112786769867f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6931469440460205f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(y, n);
}

// Online softmax step for one query over one tile, in registers: scores s
// (lanes < n valid) in, weights exp(s - m) out (lanes >= n zero); returns in
// alpha the factor by which l (updated here) and acc (by the caller) are
// rescaled to the new running max m.
inline __m512 softmax_tile(__m512 s, int64_t n, float& m, float& l, float& alpha) {
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  const float tile_max = _mm512_mask_reduce_max_ps(valid, s);
  alpha = 1.f;
  if (tile_max > m) {
    alpha = std::exp(m - tile_max);  // exp(-inf) = 0 on the first tile
    l *= alpha;
    m = tile_max;
  }
  const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m))));
  l += _mm512_reduce_add_ps(p);
  return p;
}

#ifdef KVFERRY_AVX512_BF16
// acc[k][32c, 32c + 16R) = acc * alpha[k] + p_k . V over a staged tile, R
// accumulators (16 dims each) per query, fixed at compile time so that they stay in registers.
template <int Q, int R>
inline void staged_pv(float* const* acc, const __m512* alpha, const int32_t (*pp)[kTile / 2],
                      const __m512i* __restrict vp, int64_t chunks, int64_t c) {
  __m512 o[Q][R];
  for (int k = 0; k < Q; ++k) {
    for (int r = 0; r < R; ++r) o[k][r] = _mm512_mul_ps(_mm512_loadu_ps(acc[k] + 32 * c + 16 * r), alpha[k]);
  }
  for (int64_t j = 0; j < kTile / 2; ++j) {
    const __m512i* v = vp + (j * chunks + c) * 2;
    for (int r = 0; r < R; ++r) {
      const __m512bh vr = (__m512bh)v[r];
      for (int k = 0; k < Q; ++k) o[k][r] = _mm512_dpbf16_ps(o[k][r], vr, (__m512bh)_mm512_set1_epi32(pp[k][j]));
    }
  }
  for (int k = 0; k < Q; ++k) {
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc[k] + 32 * c + 16 * r, o[k][r]);
  }
}
#endif

// The bf16 groups (staged_group, inplace_group) run up to 4 queries
// interleaved, so that their independent vdpbf16ps chains overlap (one query
// alone waits on each instruction's latency). Per query: q[k] bf16 [D];
// acc[k] float [D] (pair_dim order); m running max; l running sum per lane
// (16 partial sums). p is rounded to bf16 for the P . V vdpbf16ps, as
// flash-attention kernels round P before their P @ V product (bf16 path
// only; float32 is exact).
constexpr float kLazyRescale = 8.f;

// Online softmax step for one query over one tile of scores s (lanes <
// visible valid): weights p = exp(s - m) into pp (zero past visible; see
// Out below), l (16 per-lane partial sums) += p; returns alpha, the factor by
// which acc must be rescaled first (1 unless m moved).
// Lazy rescaling: m moves only when a score passes it by more than
// kLazyRescale, so the horizontal max and the rescale of acc and l are rare
// after the first tile. Any m gives the same softmax; this one keeps every
// weight below e^kLazyRescale, far from float32 (and bf16) overflow.
// kInlineExp: alpha by exp512 rather than by a call to std::exp, across
// which no zmm register survives; staged_group needs it (its accumulators
// would otherwise be kept in memory across the whole tile loop: 1.12x the
// time), inplace_group is faster with the call (1.07x with exp512 inlined).
// (GCC still calls lazy_softmax out of line from staged_group;
// staged_group_f32 inlines it, see there.)
// Out: int32_t, p rounded into bf16 pairs (pp [8], the bf16 paths); float,
// p itself (pp [16], the float32 staged path).
// kScalefExp: the weights by exp512_scalef (run_inplace_fast) rather than exp512.
template <bool kInlineExp, typename Out, bool kScalefExp = false>
inline float lazy_softmax(__m512 s, int64_t visible, float& m, __m512& l, Out* pp) {
  const __mmask16 valid = visible >= kTile ? 0xFFFF : visible > 0 ? (1u << visible) - 1u : 0u;
  float alpha = 1.f;
  if (_mm512_mask_cmp_ps_mask(valid, s, _mm512_set1_ps(m + kLazyRescale), _CMP_GT_OQ)) {
    const float tile_max = _mm512_mask_reduce_max_ps(valid, s);
    if constexpr (kInlineExp) {
      alpha = m == -std::numeric_limits<float>::infinity() ? 0.f  // the first tile
                                                           : _mm512_cvtss_f32(exp512(_mm512_set1_ps(m - tile_max)));
    } else {
      alpha = std::exp(m - tile_max);  // exp(-inf) = 0 on the first tile
    }
    l = _mm512_mul_ps(l, _mm512_set1_ps(alpha));
    m = tile_max;
  }
  const __m512 x = _mm512_sub_ps(s, _mm512_set1_ps(m));
  const __m512 p = _mm512_maskz_mov_ps(valid, kScalefExp ? exp512_scalef(x) : exp512(x));
  l = _mm512_add_ps(l, p);
  if constexpr (std::is_same_v<Out, float>) {
    _mm512_store_ps(pp, p);
  } else {
#ifdef KVFERRY_AVX512_BF16
    _mm256_store_si256(reinterpret_cast<__m256i*>(pp), (__m256i)_mm512_cvtneps_pbh(p));
#endif
  }
  return alpha;
}
// lazy_softmax for the Q queries of a staged group at once (staged_group,
// staged_group_f32): n[k] visible scores of query k in s[k]. The same math
// per query as lazy_softmax<true>, but the common case (no score passes its
// running max by kLazyRescale, so m stays and alpha is 1) is one test for
// all Q queries and then straight-line code, the Q exps interleaved; a
// per-query loop (what GCC made of Q calls of lazy_softmax, the scores
// spilled to the stack and a test and branch per query) left the exps'
// dependent chains one after another. Returns whether any alpha is not 1.
template <int Q, typename Out, int kOut>
inline __attribute__((always_inline)) bool group_softmax(const __m512* s, const int64_t* n, float* m, __m512* l,
                                                         Out (*pp)[kOut], float* alpha) {
  __mmask16 valid[Q];
  __mmask16 over = 0;
  for (int k = 0; k < Q; ++k) {
    valid[k] = n[k] >= kTile ? 0xFFFF : n[k] > 0 ? (1u << n[k]) - 1u : 0u;
    over |= _mm512_mask_cmp_ps_mask(valid[k], s[k], _mm512_set1_ps(m[k] + kLazyRescale), _CMP_GT_OQ);
  }
  if (__builtin_expect(over != 0, 0)) {
    bool rescaled = false;
    for (int k = 0; k < Q; ++k) {
      alpha[k] = lazy_softmax<true>(s[k], n[k], m[k], l[k], pp[k]);
      rescaled |= alpha[k] != 1.f;
    }
    return rescaled;
  }
  for (int k = 0; k < Q; ++k) {
    alpha[k] = 1.f;
    const __m512 p = _mm512_maskz_mov_ps(valid[k], exp512(_mm512_sub_ps(s[k], _mm512_set1_ps(m[k]))));
    l[k] = _mm512_add_ps(l[k], p);
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_store_ps(pp[k], p);
    } else {
#ifdef KVFERRY_AVX512_BF16
      _mm256_store_si256(reinterpret_cast<__m256i*>(pp[k]), (__m256i)_mm512_cvtneps_pbh(p));
#endif
    }
  }
  return false;
}
#ifdef KVFERRY_AVX512_BF16

// acc + a . (pair, pair, ...): vdpbf16ps with the bf16 pair at `pair`
// broadcast by the instruction itself ({1to16}). GCC does not fold
// _mm512_set1_epi32 of a load into the instruction: it issues a separate
// vpbroadcastd per product, one more uop for each. Used for the scores
// (staged_group: 0.93-0.95x the time of a 2 x 512-token prefill, one
// thread); the P . V weights taken the same way measured 1.5x the time (pp
// is stored just before: presumably the broadcast operand cannot take the
// store's forwarded data), so they keep _mm512_set1_epi32.
inline __attribute__((always_inline)) __m512 dpbf16_bcast(__m512 acc, __m512i a, const int32_t* pair) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*pair));
  return acc;
}

// Q queries (1..4) against the `tiles` staged tiles of a stripe (tile t at
// kp + t * D/2, vp + t * D/2), in order: per tile, scores, online softmax,
// acc += p . V. visible[k]: stripe tokens query k sees (query 0 sees the
// most; tiles it does not see are skipped).
// Software pipelined: tile t + 1's scores are issued before tile t's P . V
// and its softmax step after it, so that the scores' vdpbf16ps chains and
// the softmax's long dependent chain (reductions, exp) each overlap P . V,
// which does not depend on them (in tile order they would leave the
// vdpbf16ps units idle once per tile; scores and softmax both before P . V
// measured 1.07x the time).
// kDim: the head_dim when the Q queries' accumulators fit in registers
// (Q * kDim / 16 <= 16 of the 32: head_dim 32 or 64 with 4 queries, 128
// with 2); they are then loaded and stored once per stripe, not once per
// tile, and rescaled only when some query's running max moves (rare with
// the lazy rescale). 0: any head_dim, acc updated in memory per tile
// (staged_pv).
template <int Q, int kDim>
inline void staged_group(const at::BFloat16* const* q, float* const* acc, float* m, __m512* l, const int64_t* visible,
                         const __m512i* __restrict kp, const __m512i* __restrict vp, int64_t tiles, int64_t dim,
                         float scale) {
  constexpr int R = kDim / 16;  // accumulators in registers per query
  const int64_t D = kDim ? kDim : dim, pairs = D / 2;
  tiles = std::min(tiles, (visible[0] + kTile - 1) / kTile);
  __m512 s[Q];                           // scores of the next tile
  alignas(32) int32_t pp[Q][kTile / 2];  // (p[2j], p[2j+1]) as bf16 pairs; zero past the visible tokens
  float alpha[Q];
  bool rescaled = false;
  auto scores = [&](int64_t t) __attribute__((always_inline)) {
    const __m512i* tk = kp + t * pairs;
    constexpr int kChains = 4;  // per query (2: 1.05x the time)
    __m512 c4[Q][kChains];
    for (int k = 0; k < Q; ++k) for (int c = 0; c < kChains; ++c) c4[k][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; i += kChains) {
      for (int c = 0; c < kChains; ++c) {
        const __m512bh kv = (__m512bh)tk[i + c];
        for (int k = 0; k < Q; ++k) {
          // (q[2i], q[2i+1])
          c4[k][c] = dpbf16_bcast(c4[k][c], (__m512i)kv, reinterpret_cast<const int32_t*>(q[k]) + i + c);
        }
      }
    }
    for (int k = 0; k < Q; ++k) {
      s[k] = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(c4[k][0], c4[k][1]), _mm512_add_ps(c4[k][2], c4[k][3])),
                           _mm512_set1_ps(scale));
    }
  };
  auto softmax = [&](int64_t t) __attribute__((always_inline)) {
    int64_t n[Q];
    for (int k = 0; k < Q; ++k) n[k] = std::min(kTile, visible[k] - t * kTile);
    rescaled = group_softmax<Q>(s, n, m, l, pp, alpha);
  };
  __m512 o[Q][R > 0 ? R : 1];
  if constexpr (R > 0) {
    for (int k = 0; k < Q; ++k) for (int r = 0; r < R; ++r) o[k][r] = _mm512_loadu_ps(acc[k] + 16 * r);
  }
  if (tiles > 0) scores(0), softmax(0);
  for (int64_t t = 0; t < tiles; ++t) {
    if (t + 1 < tiles) scores(t + 1);
    const __m512i* tv = vp + t * pairs;
    if constexpr (R > 0) {
      if (rescaled) {
        for (int k = 0; k < Q; ++k) {
          const __m512 a = _mm512_set1_ps(alpha[k]);
          for (int r = 0; r < R; ++r) o[k][r] = _mm512_mul_ps(o[k][r], a);
        }
      }
      for (int64_t j = 0; j < kTile / 2; ++j) {
        for (int r = 0; r < R; ++r) {
          const __m512bh vr = (__m512bh)tv[j * R + r];
          for (int k = 0; k < Q; ++k) o[k][r] = _mm512_dpbf16_ps(o[k][r], vr, (__m512bh)_mm512_set1_epi32(pp[k][j]));
        }
      }
    } else {
      __m512 av[Q];
      for (int k = 0; k < Q; ++k) av[k] = _mm512_set1_ps(alpha[k]);
      const int64_t chunks = D / 32;
      int64_t c = 0;
      for (; c + 2 <= chunks; c += 2) staged_pv<Q, 4>(acc, av, pp, tv, chunks, c);
      if (c < chunks) staged_pv<Q, 2>(acc, av, pp, tv, chunks, c);
    }
    if (t + 1 < tiles) softmax(t + 1);  // pp and alpha of tile t are used: tile t + 1 takes their place
  }
  if constexpr (R > 0) {
    for (int k = 0; k < Q; ++k) for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc[k] + 16 * r, o[k][r]);
  }
}

// acc[j][c, c + 16R) = acc * alpha[j] + sum_t p_j[t] v_t[c, c + 16R) for
// the Q queries of inplace_group: R accumulators (16 dims each) per query,
// fixed at compile time so that they stay in registers.
template <int Q, int R>
inline void inplace_pv(float* const* acc, const __m512* alpha, const int32_t (*pp)[kTile / 2],
                       const at::BFloat16* __restrict v, int64_t stride, int64_t n, int64_t c) {
  __m512 o[Q][R];
  for (int j = 0; j < Q; ++j) {
    for (int r = 0; r < R; ++r) o[j][r] = _mm512_mul_ps(_mm512_loadu_ps(acc[j] + c + 16 * r), alpha[j]);
  }
  for (int64_t t = 0; t < n; t += 2) {
    for (int h = 0; h < R / 2; ++h) {  // 32-dim halves
      const __m512i x = _mm512_loadu_si512(v + t * stride + 32 * h);
      const __m512i y = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * stride + 32 * h) : _mm512_setzero_si512();
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
      for (int j = 0; j < Q; ++j) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pp[j][t / 2]);
        o[j][2 * h] = _mm512_dpbf16_ps(o[j][2 * h], lo, w);
        o[j][2 * h + 1] = _mm512_dpbf16_ps(o[j][2 * h + 1], hi, w);
      }
    }
  }
  for (int j = 0; j < Q; ++j) {
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc[j] + c + 16 * r, o[j][r]);
  }
}

// The same for items of few queries (decode), reading the tile's n rows in
// place (row t at k + t * stride, n <= 16, never past the sequence): per
// query the 16 scores are 16 dot products reduced by one transpose; V rows
// are interleaved in registers once per token pair and used by all Q queries.
template <int Q>
inline void inplace_group(const at::BFloat16* const* q, float* const* acc, float* m, __m512* l, const int64_t* visible,
                          const at::BFloat16* __restrict k, const at::BFloat16* __restrict v, int64_t stride,
                          int64_t n, int64_t dim, float scale) {
  alignas(32) int32_t pp[Q][kTile / 2];
  __m512 alpha[Q];
  for (int j = 0; j < Q; ++j) {
    alpha[j] = _mm512_set1_ps(
        lazy_softmax<false>(tile_scores_dpbf16(q[j], k, stride, n, dim, scale), visible[j], m[j], l[j], pp[j]));
  }
  int64_t c = 0;
  for (; c + 64 <= dim; c += 64) inplace_pv<Q, 4>(acc, alpha, pp, v + c, stride, n, c);
  if (c < dim) inplace_pv<Q, 2>(acc, alpha, pp, v + c, stride, n, c);
}
#endif

// acc[k][16c, 16c + 16R) = acc * alpha[k] + p_k . V over a staged float32
// tile (vt [16][chunks]), for head_dims whose accumulators do not fit in
// registers (staged_group_f32 with kDim 0).
template <int Q, int R>
inline void staged_pv_f32(float* const* acc, const __m512* alpha, const float (*pf)[kTile],
                          const __m512i* __restrict vt, int64_t chunks, int64_t c) {
  __m512 o[Q][R];
  for (int k = 0; k < Q; ++k) {
    for (int r = 0; r < R; ++r) o[k][r] = _mm512_mul_ps(_mm512_loadu_ps(acc[k] + 16 * (c + r)), alpha[k]);
  }
  for (int64_t t = 0; t < kTile; ++t) {
    for (int r = 0; r < R; ++r) {
      const __m512 vr = _mm512_castsi512_ps(vt[t * chunks + c + r]);
      for (int k = 0; k < Q; ++k) o[k][r] = _mm512_fmadd_ps(_mm512_set1_ps(pf[k][t]), vr, o[k][r]);
    }
  }
  for (int k = 0; k < Q; ++k) {
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc[k] + 16 * (c + r), o[k][r]);
  }
}

// staged_group for a float32 query over staged float32 tiles (stage_tile_f32;
// tile t at kt + t * D, vt + t * D): q[k] float [D], acc[k] float [D] in
// natural order, p kept in float32, so every product and sum is a float32
// FMA. The same pipelining (tile t + 1's scores before tile t's P . V, its
// softmax after) and register accumulators (kDim: 16, 32, 64 with 4 queries,
// 128 with 2; 0 = any head_dim, acc in memory per tile).
// flatten: GCC otherwise keeps lazy_softmax out of line, and its calls make
// the accumulators go to memory and back once per tile (measured 1.03x the time).
template <int Q, int kDim>
__attribute__((flatten)) inline void staged_group_f32(const float* const* q, float* const* acc, float* m, __m512* l,
                                                      const int64_t* visible, const __m512i* __restrict kt,
                                                      const __m512i* __restrict vt, int64_t tiles, int64_t dim,
                                                      float scale) {
  constexpr int R = kDim / 16;  // accumulators in registers per query
  const int64_t D = kDim ? kDim : dim;
  tiles = std::min(tiles, (visible[0] + kTile - 1) / kTile);
  __m512 s[Q];                      // scores of the next tile
  alignas(64) float pf[Q][kTile];   // p; zero past the visible tokens
  float alpha[Q];
  bool rescaled = false;
  auto scores = [&](int64_t t) __attribute__((always_inline)) {
    const __m512i* tk = kt + t * D;
    // 8 independent FMA chains in all (4-cycle latency, 2 FMA pipes); more
    // would not leave registers for the Q x R accumulators.
    constexpr int kChains = Q >= 3 ? 2 : Q == 2 ? 4 : 8;
    // The chains restart every 32 dims and are summed into tot: one chain
    // over all of a long head_dim (128 dependent FMAs at 256) measured about
    // 3x the rounding error of the in-place path's 16-lane dot products
    // against a float64 softmax (1.4x the tests' 1e-5 tolerance with peaked
    // scores; restarting every 32 dims: 0.7x, the in-place path 0.4x).
    // Restarting every 16 dims measured 1.08x the time.
    __m512 tot[Q];
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      __m512 c[Q][kChains];
      for (int k = 0; k < Q; ++k) for (int i = 0; i < kChains; ++i) c[k][i] = _mm512_setzero_ps();
      for (int64_t d = d0; d < std::min(D, d0 + 32); d += kChains) {
        for (int i = 0; i < kChains; ++i) {
          const __m512 kv = _mm512_castsi512_ps(tk[d + i]);
          for (int k = 0; k < Q; ++k) c[k][i] = _mm512_fmadd_ps(_mm512_set1_ps(q[k][d + i]), kv, c[k][i]);
        }
      }
      for (int k = 0; k < Q; ++k) {
        for (int w = kChains / 2; w > 0; w /= 2) {
          for (int i = 0; i < w; ++i) c[k][i] = _mm512_add_ps(c[k][i], c[k][i + w]);
        }
        tot[k] = d0 == 0 ? c[k][0] : _mm512_add_ps(tot[k], c[k][0]);
      }
    }
    for (int k = 0; k < Q; ++k) s[k] = _mm512_mul_ps(tot[k], _mm512_set1_ps(scale));
  };
  auto softmax = [&](int64_t t) __attribute__((always_inline)) {
    int64_t n[Q];
    for (int k = 0; k < Q; ++k) n[k] = std::min(kTile, visible[k] - t * kTile);
    rescaled = group_softmax<Q>(s, n, m, l, pf, alpha);
  };
  __m512 o[Q][R > 0 ? R : 1];
  if constexpr (R > 0) {
    for (int k = 0; k < Q; ++k) for (int r = 0; r < R; ++r) o[k][r] = _mm512_loadu_ps(acc[k] + 16 * r);
  }
  if (tiles > 0) scores(0), softmax(0);
  for (int64_t t = 0; t < tiles; ++t) {
    if (t + 1 < tiles) scores(t + 1);
    const __m512i* tv = vt + t * D;
    if constexpr (R > 0) {
      if (rescaled) {
        for (int k = 0; k < Q; ++k) {
          const __m512 a = _mm512_set1_ps(alpha[k]);
          for (int r = 0; r < R; ++r) o[k][r] = _mm512_mul_ps(o[k][r], a);
        }
      }
      for (int64_t j = 0; j < kTile; ++j) {
        for (int r = 0; r < R; ++r) {
          const __m512 vr = _mm512_castsi512_ps(tv[j * R + r]);
          for (int k = 0; k < Q; ++k) o[k][r] = _mm512_fmadd_ps(_mm512_set1_ps(pf[k][j]), vr, o[k][r]);
        }
      }
    } else {
      __m512 av[Q];
      for (int k = 0; k < Q; ++k) av[k] = _mm512_set1_ps(alpha[k]);
      const int64_t chunks = D / 16;
      int64_t c = 0;
      for (; c + 4 <= chunks; c += 4) staged_pv_f32<Q, 4>(acc, av, pf, tv, chunks, c);
      for (; c < chunks; ++c) staged_pv_f32<Q, 1>(acc, av, pf, tv, chunks, c);
    }
    if (t + 1 < tiles) softmax(t + 1);  // pf and alpha of tile t are used: tile t + 1 takes their place
  }
  if constexpr (R > 0) {
    for (int k = 0; k < Q; ++k) for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc[k] + 16 * r, o[k][r]);
  }
}

// acc [dim] = acc * alpha + sum_t p[t] * v_t, t < n; dim % 16 == 0. 64 dims
// of acc stay in registers across the tile's tokens.
template <typename scalar_t>
void tile_accumulate16(float* __restrict acc, float alpha, const float* __restrict p,
                       const scalar_t* __restrict v, int64_t stride, int64_t n, int64_t dim) {
  const __m512 av = _mm512_set1_ps(alpha);
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) {
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + d), av), a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 16), av);
    __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 32), av), a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 48), av);
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* vt = v + t * stride + d;
      const __m512 pt = _mm512_set1_ps(p[t]);
      a0 = _mm512_fmadd_ps(pt, load16(vt), a0);
      a1 = _mm512_fmadd_ps(pt, load16(vt + 16), a1);
      a2 = _mm512_fmadd_ps(pt, load16(vt + 32), a2);
      a3 = _mm512_fmadd_ps(pt, load16(vt + 48), a3);
    }
    _mm512_storeu_ps(acc + d, a0);
    _mm512_storeu_ps(acc + d + 16, a1);
    _mm512_storeu_ps(acc + d + 32, a2);
    _mm512_storeu_ps(acc + d + 48, a3);
  }
  for (; d < dim; d += 16) {
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + d), av);
    for (int64_t t = 0; t < n; ++t) a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), load16(v + t * stride + d), a0);
    _mm512_storeu_ps(acc + d, a0);
  }
}

#endif  // KVFERRY_AVX512

// Online softmax step for one query over one tile: s [n] scores in, weights
// exp(s - m) out (in place); returns alpha, the factor by which l (updated
// here) and acc (by the caller) are rescaled to the new running max m.
inline float softmax_update(float* s, int64_t n, float& m, float& l) {
  const float tile_max = *std::max_element(s, s + n);
  float alpha = 1.f;
  if (tile_max > m) {
    alpha = std::exp(m - tile_max);  // exp(-inf) = 0 on the first tile
    l *= alpha;
    m = tile_max;
  }
  l += exp_sum(s, n, m);
  return alpha;
}

// Rows [n, dim] at `stride` as float: the cache itself for float caches (same
// stride), else converted into buf (stride dim).
template <typename scalar_t>
inline const float* as_float(const scalar_t* src, int64_t stride, int64_t n, int64_t dim, float* buf,
                             int64_t& out_stride) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t d = 0; d < dim; ++d) buf[t * dim + d] = static_cast<float>(src[t * stride + d]);
  }
  out_stride = dim;
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, int64_t stride, int64_t, int64_t, float*, int64_t& out_stride) {
  out_stride = stride;
  return src;
}
#if defined(__AVX2__) && defined(__FMA__)
template <typename T>
inline const float* fp8_as_float(const T* src, int64_t stride, int64_t n, int64_t dim, float* buf,
                                 int64_t& out_stride) {
  for (int64_t t = 0; t < n; ++t) {
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(buf + t * dim + d, load8(src + t * stride + d));
    for (; d < dim; ++d) buf[t * dim + d] = static_cast<float>(src[t * stride + d]);
  }
  out_stride = dim;
  return buf;
}
template <>
inline const float* as_float<at::Float8_e5m2>(const at::Float8_e5m2* src, int64_t stride, int64_t n, int64_t dim,
                                             float* buf, int64_t& out_stride) {
  return fp8_as_float(src, stride, n, dim, buf, out_stride);
}
template <>
inline const float* as_float<at::Float8_e4m3fn>(const at::Float8_e4m3fn* src, int64_t stride, int64_t n,
                                               int64_t dim, float* buf, int64_t& out_stride) {
  return fp8_as_float(src, stride, n, dim, buf, out_stride);
}
#endif

// How a tile's rows are read.
enum class Path {
  kPortable,  // rows converted to float (or used in place), AVX2 / plain-loop primitives
  kWiden,     // AVX-512: rows widened in registers, float query (float32 query and cache, items of
              // kStageMinQueries or more queries: staged, run_staged)
  kDpbf16,    // AVX-512 BF16: bf16 query and rows (fp8 rows converted to bf16), vdpbf16ps dot products (items of
              // kStageMinQueries or more queries stage each tile: run_staged)
};

// Work items with at least this many query vectors stage each tile (K
// transposed into dim pairs, V into token pairs) once for all of them; below
// it (decode: M = G, 1-3 heads per KV head in the models we serve) the
// 16x16 transpose costs about what it saves, and each query reads the rows in
// place. Measured (bench/paged_attention_kernel.py, one thread, batch 32,
// context 384, G = 3): staging is 1.07x the per-query time at M = 3, 0.86x at
// M = 6, 0.63-0.72x at M = 12-48. float32 (G = 1 and 3): about even at M =
// 4, 0.87x at M = 8, 0.8x at M = 12.
constexpr int64_t kStageMinQueries = 4;

// Bytes of staged tiles per stripe in run_staged (a bf16 tile is 64 * head_dim
// bytes), for groups of 4 and of 2 queries (see run_staged). Every group
// reads the whole stripe, and each group starts its pipeline afresh per
// stripe: longer stripes start fewer, but fall out of L1, and 2-query groups
// read the stripe twice as often. Measured (one thread, batch 8, 256-token
// prompts): head_dim 64, 16 tiles (64 KB) 0.96x the time of 8 tiles; head_dim
// 128, 16 tiles (128 KB) 1.1-1.25x the time of 4 (32 KB). A float32 tile is
// twice the bytes (128 * head_dim); at head_dim 64, stripes of 4, 8 and 16
// of them (32, 64, 128 KB) measured the same within noise.
constexpr int64_t kStripeBytes4 = 64 * 1024;
// bf16 4-query groups: 32 tiles at head_dim 64 (128 KB, from L2) measured
// 0.96-0.97x the time of 16 (one thread, 2 x 512-token prompts, and 256 over
// 768 cached); 64 tiles (256 KB) the same as 32. Longer stripes start each
// group's pipeline (its first tile's scores and softmax, which nothing
// overlaps) fewer times. float32 at 16 tiles (128 KB) measured even with 8.
constexpr int64_t kStripeBytes4Bf16 = 128 * 1024;
constexpr int64_t kStripeBytes2 = 32 * 1024;
// The AVX2 build's staged items (run_staged_avx2). Stripes: a float32 tile
// is 128 * head_dim bytes (K and V); 16, 32, 64 and 128 KB measured the
// same within noise (2 threads, a 2048-token prompt). From how many query
// vectors an item stages (below, run()'s per-query loop), measured (2
// threads, batch 32, context 384, head_dim 64, against that loop): G = 3
// verify windows of 2 / 3 / 4 / 8 tokens (M = 6 / 9 / 12 / 24) 1.0x /
// 0.9x / 0.86x / 0.79x the time; G = 1, M = 4 1.04x, M = 8 0.88-0.94x.
// Prompts: 512 and 2048 tokens 0.69x, 256 over 768 cached 0.69x.
constexpr int64_t kStripeBytesAvx2 = 64 * 1024;
constexpr int64_t kStageMinQueriesAvx2 = 8;

// How many positions past the tile being read a work item prefetches.
constexpr int64_t kPrefetchTokens = 32;
// For fp8 rows (half the bytes): twice the positions, the same bytes in
// flight. Measured (decode, batch 32, context 384, G = 3, head_dim 64, two
// threads, K/V from memory, A/B in one process): 32 positions 1.17x the
// time of 64; 48 and 80 even with 64; 128 1.09x.
constexpr int64_t kPrefetchTokensFp8 = 64;

// A sequence as the kernels see it, or one part of its context (a split
// item, see attend_all): table starts at the part's first block, seq_len
// counts from there, and positions from `cap` on are not read. A part's
// unnormalized result goes to `part` (finish), for combine_parts.
struct Seq {
  int64_t q_start, q_len, seq_len;
  const int64_t* table;  // its block table row
  int64_t cap = std::numeric_limits<int64_t>::max();
  float* part = nullptr;
  // A draft tree's chunk (q_len <= 64): bit b of tree[j] says whether query
  // token j sees the chunk's token b (its ancestors and itself); the cached
  // context is always visible. nullptr: causal (run_tree).
  const int64_t* tree = nullptr;

  // The positions query tokens [.., j1) read: [0, end(j1)).
  int64_t end(int64_t j1) const { return std::min(seq_len - q_len + j1, cap); }
  // The positions query token j sees: [0, limit(j)).
  int64_t limit(int64_t j) const { return std::min(seq_len - q_len + j + 1, cap); }
};

// The prefetch cursor of the in-place decode kernels (run_inplace_fast,
// run_inplace_f32, run_inplace_f32_avx2): head kDim's K and V rows of one
// sequence, elements of type T, positions row_stride elements apart.
// to(last) requests the rows of the positions before `last` not yet
// requested, tracked as block and offset (not prefetch_ahead's division per
// row, which took a tenth of run_inplace_f32_avx2's time). 16 rows of a
// block that start at a multiple of 16 in it (the steady state at block
// sizes that are multiples of 16: consecutive rows, contiguous) are not
// requested there: their K and V row bases are handed to the next tile (k, v), which issues them a
// token pair at a time inside its loops (pair, indexed by the pair, or
// next_pair, advancing a pointer; each kernel says where) and then clears
// them: no per-row address arithmetic, and no burst of requests before the
// tile. Measured (run_inplace_fast, against the burst): 0.95x the time
// warm, 0.85-0.9x with K/V from memory (--layers 30). Other rows (a
// sequence's last rows, block sizes not a multiple of 16) are requested by
// to() row by row (at block_size 32-128 that was 1.2-1.6x the time of
// block_size 16 with K/V from memory, before those blocks were handed too).
template <typename T, int kDim>
struct PrefetchCursor {
  static constexpr int64_t kRowBytes = kDim * static_cast<int64_t>(sizeof(T));  // a head's row
  const T* kbase;  // head h's rows of block 0 (the block table indexes from there)
  const T* vbase;
  const Seq& seq;
  int64_t row_stride, bs;  // elements between positions; the block size
  int64_t pos = 0, blk = 0, in_block = 0;  // the first position not yet requested
  const char *k = nullptr, *v = nullptr;   // a whole block's K and V rows, for the tile to request

  // Rows 2p and 2p + 1 at base.
  __attribute__((always_inline)) void pair(const char* base, int p) const {
    const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(T));
    for (int t = 2 * p; t < 2 * p + 2; ++t) {
      for (int64_t off = 0; off < kRowBytes; off += 64) prefetch_line<false>(base + t * row_bytes + off);
    }
  }

  // A token pair's rows at base, then base advanced past them.
  __attribute__((always_inline)) void next_pair(const char*& base) const {
    const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(T));
    for (int t = 0; t < 2; ++t, base += row_bytes) {
      for (int64_t off = 0; off < kRowBytes; off += 64) prefetch_line<false>(base + off);
    }
  }

  // The next token pair of the block handed to the tile, if any.
  __attribute__((always_inline)) void pair_step() {
    if (k) next_pair(k), next_pair(v);
  }

  // Token pair p's K (or V) rows of the block handed to the tile, if any
  // (run_inplace_fast: K during the scores, V during P . V); v_rest(): all
  // of its V rows at once, for a partial tile.
  __attribute__((always_inline)) void k_pair(int p) const {
    if (k) pair(k, p);
  }
  __attribute__((always_inline)) void v_pair(int p) const {
    if (v) pair(v, p);
  }
  __attribute__((always_inline)) void v_rest() {
    if (!v) return;
    for (int p = 0; p < kTile / 2; ++p) pair(v, p);
    v = nullptr;
  }

  __attribute__((always_inline)) void to(int64_t last) {
    if (bs % kTile == 0 && in_block % kTile == 0 && last - pos >= kTile) {
      const int64_t first = (seq.table[blk] * bs + in_block) * row_stride;
      k = reinterpret_cast<const char*>(kbase + first);
      v = reinterpret_cast<const char*>(vbase + first);
      pos += kTile;
      if ((in_block += kTile) == bs) in_block = 0, ++blk;
    }
    for (; pos < last; ++pos) {
      const int64_t row = (seq.table[blk] * bs + in_block) * row_stride;
      for (int64_t off = 0; off < kRowBytes; off += 64) {
        prefetch_line<false>(reinterpret_cast<const char*>(kbase + row) + off);
        prefetch_line<false>(reinterpret_cast<const char*>(vbase + row) + off);
      }
      if (++in_block == bs) in_block = 0, ++blk;
    }
  }
};

// PrefetchCursor for an item over all KV heads (run_rows_f32_avx2): whole
// rows of every head, positions row_stride elements apart, kDim the head_dim.
// 16 rows of a block from a multiple of 16 in it (as in PrefetchCursor) are
// a contiguous stretch of K and one of V; they are handed to the tiles of the next position (k, v), whose
// pair_step() calls, one per token pair and head, each request two head
// rows' bytes of it in order, so that the block is requested once over all
// heads' tiles. Other rows are requested by to() row by row.
template <typename T, int kDim>
struct RowCursor {
  static constexpr int64_t kStepBytes = 2 * kDim * static_cast<int64_t>(sizeof(T));
  const T* kbase;  // block 0's first row
  const T* vbase;
  const Seq& seq;
  int64_t row_stride, bs;
  int64_t pos = 0, blk = 0, in_block = 0;
  const char *k = nullptr, *v = nullptr, *kend = nullptr, *vend = nullptr;

  __attribute__((always_inline)) void pair_step() {
    if (!k) return;
    for (int64_t off = 0; off < kStepBytes; off += 64) prefetch_line<false>(k + off), prefetch_line<false>(v + off);
    k += kStepBytes;
    v += kStepBytes;
    if (k >= kend) k = v = nullptr;
  }

  // The hooks of InplaceBf16::tile (run_rows_bf16): the next two head rows'
  // bytes of the block's K during the scores, of its V during P . V, and
  // what is left of its V for a partial tile. (p: the token pair, unused:
  // the block is requested in order over all heads' tiles.)
  __attribute__((always_inline)) void k_pair(int) {
    if (!k) return;
    for (int64_t off = 0; off < kStepBytes; off += 64) prefetch_line<false>(k + off);
    k += kStepBytes;
    if (k >= kend) k = nullptr;
  }
  __attribute__((always_inline)) void v_pair(int) {
    if (!v) return;
    for (int64_t off = 0; off < kStepBytes; off += 64) prefetch_line<false>(v + off);
    v += kStepBytes;
    if (v >= vend) v = nullptr;
  }
  __attribute__((always_inline)) void v_rest() {
    for (; v && v < vend; v += 64) prefetch_line<false>(v);
    v = nullptr;
  }

  __attribute__((always_inline)) void to(int64_t last) {
    const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(T));
    if (bs % kTile == 0 && in_block % kTile == 0 && last - pos >= kTile) {
      const int64_t first = (seq.table[blk] * bs + in_block) * row_stride;
      k = reinterpret_cast<const char*>(kbase + first);
      v = reinterpret_cast<const char*>(vbase + first);
      kend = k + kTile * row_bytes;
      vend = v + kTile * row_bytes;
      pos += kTile;
      if ((in_block += kTile) == bs) in_block = 0, ++blk;
    }
    for (; pos < last; ++pos) {
      const int64_t row = (seq.table[blk] * bs + in_block) * row_stride;
      for (int64_t off = 0; off < row_bytes; off += 64) {
        prefetch_line<false>(reinterpret_cast<const char*>(kbase + row) + off);
        prefetch_line<false>(reinterpret_cast<const char*>(vbase + row) + off);
      }
      if (++in_block == bs) in_block = 0, ++blk;
    }
  }
};

template <typename scalar_t, typename qscalar_t, Path kPath>
struct Attend {
  // Most KV heads an all-heads item takes (run_rows_f32_avx2, run_rows_bf16).
  static constexpr int64_t kMaxRowHeads = 8;

  const qscalar_t* q_ptr;
  qscalar_t* out_ptr;
  const scalar_t* k_ptr;
  const scalar_t* v_ptr;
  int64_t q_token_stride;  // between q's tokens (q may be a column slice of a wider tensor)
  int64_t num_heads, kv_heads, head_dim, group, block_size;
  float scale;
  // The AVX2 build's staged items (run_staged_avx2); off: run()'s per-query
  // loop (KVFERRY_ATTN_STAGED_AVX2=0, for tests and comparisons).
  bool staged_avx2_enabled = true;

  // Positions requested ahead of the tile being read.
  static constexpr int64_t kAhead = kIsFp8<scalar_t> ? kPrefetchTokensFp8 : kPrefetchTokens;

  // The query type the staged groups read: bf16 (kDpbf16) or the float copy in Scratch::qf.
  using group_q_t = std::conditional_t<kPath == Path::kDpbf16, at::BFloat16, float>;

  // Per-thread scratch, reused across work items.
  struct Scratch {
    std::vector<float> acc, m, l, qf, kbuf, vbuf;
    std::vector<int64_t> limit;  // visible positions per query
#ifdef KVFERRY_AVX512
    std::vector<__m512i> kp, vp;  // the staged stripe (run_staged)
    std::vector<__m512> lvec;      // run_staged: per query, softmax sums per lane
#elif defined(__AVX2__) && defined(__FMA__)
    std::vector<__m256> kt8, vt8;  // the staged stripe (run_staged_avx2)
    std::vector<const float*> vrow8;  // its V rows, staged or in place
#endif
  };

  // The K and V rows of head h at positions [from, to) of seq, requested
  // into cache (see prefetch_line).
  template <bool kL2Only>
  void prefetch_rows(const Seq& seq, int64_t h, int64_t from, int64_t to) const {
    const int64_t row_stride = kv_heads * head_dim;
    const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(scalar_t));
    for (int64_t p = from; p < to; ++p) {
      const int64_t row = (seq.table[p / block_size] * block_size + p % block_size) * row_stride + h * head_dim;
      for (int64_t off = 0; off < row_bytes; off += 64) {
        prefetch_line<kL2Only>(reinterpret_cast<const char*>(k_ptr + row) + off);
        prefetch_line<kL2Only>(reinterpret_cast<const char*>(v_ptr + row) + off);
      }
    }
  }

  // A work item's first kAhead rows of head h, requested into L2
  // while the thread still runs the item before it.
  void prefetch_first_rows(const Seq& seq, int64_t h) const {
    prefetch_rows<true>(seq, h, 0, std::min(seq.end(seq.q_len), kAhead));
  }

  // Blocks sit anywhere in the cache, so the hardware prefetcher cannot see
  // the next one coming: before a tile ending at position tile_end is read,
  // the K and V rows of head h up to kAhead past it are requested.
  // `next` is the first position not yet requested (0 at the start of a
  // work item). Measured on the decode of batch 32, context 384, with K/V
  // coming from memory (bench/paged_attention_kernel.py --layers 30, 2
  // threads): 0.87 -> 0.37 ms per layer (whole-block prefetches: 0.48).
  void prefetch_ahead(const Seq& seq, int64_t h, int64_t tile_end, int64_t end, int64_t& next) const {
    const int64_t last = std::min(end, tile_end + kAhead);
    if (next < last) prefetch_rows<false>(seq, h, next, last);
    next = std::max(next, last);
  }

  // Row pointers of K and V for positions [start, start + n) of seq, wherever their blocks are.
  void tile_rows(const Seq& seq, int64_t h, int64_t start, int64_t n, const scalar_t** krows,
                 const scalar_t** vrows) const {
    const int64_t row_stride = kv_heads * head_dim;
    int64_t b = start / block_size, off = start % block_size;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = (seq.table[b] * block_size + off) * row_stride + h * head_dim;
      krows[t] = k_ptr + row;
      vrows[t] = v_ptr + row;
      if (++off == block_size) off = 0, ++b;
    }
  }

  // The staged kernels' walk over positions [0, end) of seq for head h, in
  // stripes of stripe_tiles tiles: stage(t, n, krows, vrows) for each tile
  // t of a stripe (n rows, their K and V row pointers, prefetched ahead),
  // then groups(stripe, tokens, tiles) once the stripe is staged.
  template <typename Stage, typename Groups>
  void for_each_stripe(const Seq& seq, int64_t h, int64_t end, int64_t stripe_tiles, Stage&& stage,
                       Groups&& groups) const {
    const scalar_t* krows[kTile];
    const scalar_t* vrows[kTile];
    int64_t prefetched = 0;
    for (int64_t stripe = 0; stripe < end; stripe += stripe_tiles * kTile) {
      const int64_t tokens = std::min(stripe_tiles * kTile, end - stripe);
      const int64_t tiles = (tokens + kTile - 1) / kTile;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t start = stripe + t * kTile, n = std::min(kTile, end - start);
        prefetch_ahead(seq, h, start + n, end, prefetched);
        tile_rows(seq, h, start, n, krows, vrows);
        stage(t, n, krows, vrows);
      }
      groups(stripe, tokens, tiles);
    }
  }

  // An in-place decode state st (InplaceBf16, InplaceF32, InplaceF32Avx2)
  // over head h's tiles of positions [0, end) of seq, its rows requested
  // ahead by a PrefetchCursor (its hooks: when the state's tile step calls
  // them, a token pair at a time).
  template <typename State>
  void run_head_tiles(const Seq& seq, int64_t end, int64_t h, State& st) const {
    constexpr int kDim = State::kHeadDim;
    const int64_t row_stride = kv_heads * kDim, bs = block_size;
    const scalar_t* kbase = k_ptr + h * kDim;
    const scalar_t* vbase = v_ptr + h * kDim;
    PrefetchCursor<scalar_t, kDim> pf{kbase, vbase, seq, row_stride, bs};
    int64_t n = 0;
    for (int64_t start = 0, b = 0, in_block = 0; start < end; start += n) {
      n = std::min({kTile, end - start, bs - in_block});
      pf.to(std::min(end, start + n + kAhead));
      const int64_t base = (seq.table[b] * bs + in_block) * row_stride;
      if (n == kTile) st.template tile<true>(pf, kbase + base, vbase + base, row_stride, start, n, scale);
      else st.template tile<false>(pf, kbase + base, vbase + base, row_stride, start, n, scale);
      pf.k = pf.v = nullptr;
      in_block += n;
      if (in_block == bs) in_block = 0, ++b;
    }
  }

  // The states st[0 .. kv_heads) (one per KV head) over positions [0, end)
  // of seq, tile by tile: the heads' tiles of one block run back to back,
  // so each block's K and V are read as whole rows (the block's contiguous
  // bytes), not as one head's slice of each row; a RowCursor requests them
  // ahead in order over all heads' tiles.
  template <typename State>
  void run_rows_tiles(const Seq& seq, int64_t end, State* st) const {
    constexpr int kDim = State::kHeadDim;
    const int64_t row_stride = kv_heads * kDim, bs = block_size;
    RowCursor<scalar_t, kDim> pf{k_ptr, v_ptr, seq, row_stride, bs};
    int64_t n = 0;
    for (int64_t start = 0, b = 0, in_block = 0; start < end; start += n) {
      n = std::min({kTile, end - start, bs - in_block});
      pf.to(std::min(end, start + n + kAhead));
      const int64_t base = (seq.table[b] * bs + in_block) * row_stride;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = base + h * kDim;
        if (n == kTile) st[h].template tile<true>(pf, k_ptr + at, v_ptr + at, row_stride, start, n, scale);
        else st[h].template tile<false>(pf, k_ptr + at, v_ptr + at, row_stride, start, n, scale);
      }
      pf.k = pf.v = nullptr;
      in_block += n;
      if (in_block == bs) in_block = 0, ++b;
    }
  }

#ifdef KVFERRY_AVX512

  // What the in-place decode states (InplaceBf16, InplaceF32) share: per
  // query vector, the online softmax's sums per lane and running max, the
  // positions it sees, and its accumulator row.
  template <int Q>
  struct InplaceState {
    __m512 l[Q];
    float m[Q];
    int64_t limit[Q];
    float* acc;  // [Q][head_dim], zero; updated in memory per tile

    void reset(const int64_t* limits, float* acc_) {
      acc = acc_;
      for (int k = 0; k < Q; ++k) {
        l[k] = _mm512_setzero_ps();
        m[k] = -std::numeric_limits<float>::infinity();
        limit[k] = limits[k];
      }
    }

    // The softmax state into query vectors [first, first + Q) of w.
    void store(Scratch& w, int64_t first) const {
      for (int k = 0; k < Q; ++k) {
        w.m[first + k] = m[k];
        w.lvec[first + k] = l[k];
      }
    }
  };

  // Calls run_group(std::integral_constant<int, Q>, q, acc, m, l, visible)
  // for the item's queries that see any of positions [start, start + n),
  // from the last down (later queries see more: limits grow with i), in
  // groups of up to max_group (<= 4), and stores their softmax state back.
  template <typename RunGroup>
  void for_query_groups(const Seq& seq, int64_t j0, int64_t h, int64_t start, int64_t n, int max_group, Scratch& w,
                        RunGroup&& run_group) const {
    const int64_t M = static_cast<int64_t>(w.m.size());
    for (int64_t top = M - 1; top >= 0 && w.limit[top] > start; top -= max_group) {
      const int q = static_cast<int>(std::min<int64_t>(max_group, top + 1));
      const group_q_t* qs[4];
      float* accs[4];
      float ms[4];
      __m512 ls[4];
      int64_t visible[4];
      for (int k = 0; k < q; ++k) {
        const int64_t i = top - k;
        if constexpr (kPath == Path::kDpbf16) {
          qs[k] = reinterpret_cast<const at::BFloat16*>(query(j0 + i / group, i % group, h, seq));
        } else {
          qs[k] = w.qf.data() + i * head_dim;  // float32 path: the query as float
        }
        accs[k] = w.acc.data() + i * head_dim;
        ms[k] = w.m[i];
        ls[k] = w.lvec[i];
        visible[k] = std::min(n, w.limit[i] - start);
      }
      switch (q) {
        case 4: run_group(std::integral_constant<int, 4>{}, qs, accs, ms, ls, visible); break;
        case 3: run_group(std::integral_constant<int, 3>{}, qs, accs, ms, ls, visible); break;
        case 2: run_group(std::integral_constant<int, 2>{}, qs, accs, ms, ls, visible); break;
        default: run_group(std::integral_constant<int, 1>{}, qs, accs, ms, ls, visible);
      }
      for (int k = 0; k < q; ++k) {
        w.m[top - k] = ms[k];
        w.lvec[top - k] = ls[k];
      }
    }
  }

#ifdef KVFERRY_AVX512_BF16
  // Items of fewer queries: tiles of up to 16 rows inside one block, read in place.
  void run_inplace(const Seq& seq, int64_t j0, int64_t j1, int64_t h, Scratch& w) const {
    const int64_t D = head_dim, row_stride = kv_heads * D;
    const int64_t end = seq.end(j1);
    int64_t n = 0, prefetched = 0;
    for (int64_t start = 0; start < end; start += n) {
      const int64_t in_block = start % block_size;
      n = std::min({kTile, end - start, block_size - in_block});
      prefetch_ahead(seq, h, start + n, end, prefetched);
      const int64_t base = (seq.table[start / block_size] * block_size + in_block) * row_stride + h * D;
      const auto* kt = reinterpret_cast<const at::BFloat16*>(k_ptr + base);
      const auto* vt = reinterpret_cast<const at::BFloat16*>(v_ptr + base);
      for_query_groups(seq, j0, h, start, n, 4, w, [&](auto tag, auto&&... a) {
        inplace_group<decltype(tag)::value>(a..., kt, vt, row_stride, n, D, scale);
      });
    }
  }

  // run_inplace for head_dim kDim (32, 64; 128 with Q <= 2) and Q = M query
  // vectors (decode: M = G): the whole item in one loop specialized at
  // compile time (no per-tile query-group setup, no out-of-line score call
  // with its accumulators on the stack). Scores: the tile's K rows are
  // interleaved in token pairs (unpack of 32-bit pairs, once for all Q
  // queries) and dotted with each query's pairs duplicated likewise, so each
  // query's reduction starts at round 2 of transpose_sum16 (21 instructions
  // instead of 45), and runs 4 tokens at a time so that few partial vectors
  // are live. Measured (one thread, batch 32, context 384, G = 3, warm):
  // 0.39 -> 0.21 ms a layer. Tried and not kept: issuing tile t + 1's scores
  // and softmax before tile t's P . V (no gain), prefetching 48-96 tokens
  // ahead or into L2 only, prefetching the next KV head's rows (slower).
  // Also tried, with K/V from memory (--layers 30, batch 32): one work item
  // per decode sequence running its KV heads in turn, the first head's pass
  // also requesting the other heads' rows of each block into L2, so that
  // the blocks are read front to back and the later heads run from L2:
  // 1.1x the time at context 384 (one thread; 2 threads 1.15x), 1.28x at
  // 1024 (a sequence's K/V then fill L2), 1.19x warm; the same items
  // without the L2 requests: even within noise. All KV heads per tile, each
  // head's softmax state indexed at run time: 1.33x warm (GCC keeps it in
  // memory). Prefetching 16 tokens ahead: 1.08x; adding L2 requests 2-8
  // blocks ahead: no gain.
  //
  // InplaceBf16 is its state and tile step (one KV head, Q query vectors,
  // head_dim kDim), which run_rows_bf16 also runs over every KV head of an
  // item at once, tile by tile, each head's state an InplaceBf16 of its own
  // whose tile step is the same inlined code: on Zen 4, 0.85x the per-head
  // items' time with K/V from memory and 0.9-0.95x warm (unlike the
  // run-time-indexed state above). The cursor (PrefetchCursor or RowCursor)
  // gets k_pair(p) once per token pair during the scores and v_pair(p)
  // during P . V.
  template <int Q, int kDim>
  struct InplaceBf16 : InplaceState<Q> {
    using InplaceState<Q>::l, InplaceState<Q>::m, InplaceState<Q>::limit, InplaceState<Q>::acc;
    static constexpr int kHeadDim = kDim, C = kDim / 32, R = kDim / 16;
    // The queries' pairs, duplicated for the token-pair layout, in memory:
    // read as memory operands of vdpbf16ps (in registers they leave too few
    // for the rest: GCC then spills the V rows).
    alignas(64) __m512i qbuf[Q][C][2];

    void init(const Attend& op, const Seq& seq, int64_t j0, int64_t h, const int64_t* limits, float* acc_) {
      this->reset(limits, acc_);
      for (int k = 0; k < Q; ++k) {
        const auto* qk = reinterpret_cast<const at::BFloat16*>(op.query(j0 + k / op.group, k % op.group, h, seq));
        for (int c = 0; c < C; ++c) {
          const __m512i qv = _mm512_loadu_si512(qk + 32 * c);
          qbuf[k][c][0] = _mm512_unpacklo_epi32(qv, qv);
          qbuf[k][c][1] = _mm512_unpackhi_epi32(qv, qv);
        }
      }
    }

    // Tokens [start, start + n) of one block, head rows at kt and vt
    // (row_stride elements apart).
    template <bool kFull, typename Cursor>
    __attribute__((always_inline)) void tile(Cursor& pf, const scalar_t* kt, const scalar_t* vt, int64_t row_stride,
                                             int64_t start, int64_t n, float scale) {
      const __m512i zero = _mm512_setzero_si512();
      auto row = [&](const scalar_t* p, int64_t t, int c) __attribute__((always_inline)) {
        return kFull || t < n ? _mm512_loadu_si512(p + t * row_stride + 32 * c) : zero;
      };
#ifdef KVFERRY_FP8_DPBF16
      // An fp8 cache: token pair p's rows, a 64-byte piece at a time (chunks
      // c, c + 1), converted into the vectors the bf16 unpacks below give
      // (fp8_pair, kV: the V layout), once for all Q queries. (base: auto,
      // so that the bf16 instantiation leaves the body unchecked.)
      auto fp8_pairs = [&](auto v_tag, auto base, int p, __m512i* lo, __m512i* hi)
                           __attribute__((always_inline)) {
        for (int c = 0; c < C; c += 2) {
          const __m512i a = kFull || 2 * p < n ? fp8_piece(base + 2 * p * row_stride + 32 * c, kDim) : zero;
          const __m512i b = kFull || 2 * p + 1 < n ? fp8_piece(base + (2 * p + 1) * row_stride + 32 * c, kDim) : zero;
          using T = std::remove_cv_t<std::remove_pointer_t<decltype(base)>>;
          fp8_pair<decltype(v_tag)::value, T>(a, b, 0, lo[c], hi[c]);
          if (c + 1 < C) fp8_pair<decltype(v_tag)::value, T>(a, b, 1, lo[c + 1], hi[c + 1]);
        }
      };
#endif
      // Per 4 tokens (two pairs), round 2 of the reduction right away, so
      // that few partial vectors are live: y[k][qd] holds tokens 4qd..4qd+3.
      __m512 y[Q][2], wv[Q][2];
#pragma GCC unroll 4
      for (int qd = 0; qd < 4; ++qd) {
        __m512 x[Q][2];
        for (int k = 0; k < Q; ++k) x[k][0] = x[k][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          const int p = 2 * qd + e;
          pf.k_pair(p);
          if constexpr (kIsFp8<scalar_t>) {
#ifdef KVFERRY_FP8_DPBF16
            __m512i lo[C], hi[C];
            fp8_pairs(std::false_type{}, kt, p, lo, hi);
            for (int c = 0; c < C; ++c) {
              for (int k = 0; k < Q; ++k) {
                x[k][e] = _mm512_dpbf16_ps(x[k][e], (__m512bh)lo[c], (__m512bh)qbuf[k][c][0]);
                x[k][e] = _mm512_dpbf16_ps(x[k][e], (__m512bh)hi[c], (__m512bh)qbuf[k][c][1]);
              }
            }
#endif
            continue;  // (the bf16 rows' unpacks below)
          }
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) {
            const __m512i a = row(kt, 2 * p, c), b = row(kt, 2 * p + 1, c);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi32(a, b), hi = (__m512bh)_mm512_unpackhi_epi32(a, b);
            for (int k = 0; k < Q; ++k) {
              x[k][e] = _mm512_dpbf16_ps(x[k][e], lo, (__m512bh)qbuf[k][c][0]);
              x[k][e] = _mm512_dpbf16_ps(x[k][e], hi, (__m512bh)qbuf[k][c][1]);
            }
          }
        }
        for (int k = 0; k < Q; ++k) {
          const __m512d a = _mm512_castps_pd(x[k][0]), b = _mm512_castps_pd(x[k][1]);
          y[k][qd & 1] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
          if (qd & 1) {
            wv[k][qd / 2] = _mm512_add_ps(_mm512_shuffle_f32x4(y[k][0], y[k][1], 0x44),
                                          _mm512_shuffle_f32x4(y[k][0], y[k][1], 0xEE));
          }
        }
      }
      alignas(32) int32_t pp[Q][kTile / 2];
      float alpha[Q];
      bool rescaled = false;
      for (int k = 0; k < Q; ++k) {
        const __m512 w0 = wv[k][0], w1 = wv[k][1];
        const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
        const __m512 sk = _mm512_mul_ps(sum, _mm512_set1_ps(scale));
        alpha[k] = lazy_softmax<true, int32_t, true>(sk, std::min(n, limit[k] - start), m[k], l[k], pp[k]);
        rescaled |= alpha[k] != 1.f;
      }
      // GCC forgets what memory holds here: the weights are then read by
      // broadcast loads (not extracted from a register, two shuffles each),
      // and the queries from memory (not kept in registers).
      asm volatile("" ::: "memory");
      __m512 o[Q][R];
      for (int k = 0; k < Q; ++k) for (int r = 0; r < R; ++r) o[k][r] = _mm512_loadu_ps(acc + k * kDim + 16 * r);
      if (rescaled) {
        for (int k = 0; k < Q; ++k) {
          const __m512 a = _mm512_set1_ps(alpha[k]);
          for (int r = 0; r < R; ++r) o[k][r] = _mm512_mul_ps(o[k][r], a);
        }
      }
      if (!kFull) pf.v_rest();
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        if (kFull) pf.v_pair(p);
        if (!kFull && 2 * p >= n) break;
        if constexpr (kIsFp8<scalar_t>) {
#ifdef KVFERRY_FP8_DPBF16
          __m512i vlo[C], vhi[C];
          fp8_pairs(std::true_type{}, vt, p, vlo, vhi);
          for (int c = 0; c < C; ++c) {
            for (int k = 0; k < Q; ++k) {
              const __m512bh wk = (__m512bh)_mm512_set1_epi32(pp[k][p]);
              o[k][2 * c] = _mm512_dpbf16_ps(o[k][2 * c], (__m512bh)vlo[c], wk);
              o[k][2 * c + 1] = _mm512_dpbf16_ps(o[k][2 * c + 1], (__m512bh)vhi[c], wk);
            }
          }
#endif
          continue;  // (the bf16 rows' unpacks below)
        }
        for (int c = 0; c < C; ++c) {
          const __m512i a = row(vt, 2 * p, c), b = row(vt, 2 * p + 1, c);
          const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
          for (int k = 0; k < Q; ++k) {
            const __m512bh wk = (__m512bh)_mm512_set1_epi32(pp[k][p]);
            o[k][2 * c] = _mm512_dpbf16_ps(o[k][2 * c], lo, wk);
            o[k][2 * c + 1] = _mm512_dpbf16_ps(o[k][2 * c + 1], hi, wk);
          }
        }
      }
      for (int k = 0; k < Q; ++k) for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + k * kDim + 16 * r, o[k][r]);
    }
  };

  template <int Q, int kDim>
  void run_inplace_fast(const Seq& seq, int64_t j0, int64_t j1, int64_t h, Scratch& w) const {
    InplaceBf16<Q, kDim> st;
    st.init(*this, seq, j0, h, w.limit.data(), w.acc.data());
    run_head_tiles(seq, seq.end(j1), h, st);
    st.store(w, 0);
  }

  // run_inplace_fast over every KV head of a decode item at once
  // (run_rows_tiles). Query vectors [h * Q, h * Q + Q) of w's state are head h's.
  template <int Q, int kDim>
  void run_rows_bf16(const Seq& seq, int64_t j0, int64_t j1, Scratch& w) const {
    InplaceBf16<Q, kDim> st[kMaxRowHeads];
    for (int64_t h = 0; h < kv_heads; ++h) st[h].init(*this, seq, j0, h, w.limit.data(), w.acc.data() + h * Q * kDim);
    run_rows_tiles(seq, seq.end(j1), st);
    for (int64_t h = 0; h < kv_heads; ++h) st[h].store(w, h * Q);
  }

  // run_inplace through run_inplace_fast where a specialization exists; false otherwise.
  bool try_inplace_fast(const Seq& seq, int64_t j0, int64_t j1, int64_t h, Scratch& w) const {
    const int64_t M = static_cast<int64_t>(w.m.size());
    if (head_dim == 64) {
      if (M == 1) return run_inplace_fast<1, 64>(seq, j0, j1, h, w), true;
      if (M == 2) return run_inplace_fast<2, 64>(seq, j0, j1, h, w), true;
      if (M == 3) return run_inplace_fast<3, 64>(seq, j0, j1, h, w), true;
    } else if (head_dim == 32) {
      if (M == 1) return run_inplace_fast<1, 32>(seq, j0, j1, h, w), true;
      if (M == 2) return run_inplace_fast<2, 32>(seq, j0, j1, h, w), true;
      if (M == 3) return run_inplace_fast<3, 32>(seq, j0, j1, h, w), true;
    } else if (head_dim == 128) {
      if (M == 1) return run_inplace_fast<1, 128>(seq, j0, j1, h, w), true;
      if (M == 2) return run_inplace_fast<2, 128>(seq, j0, j1, h, w), true;
    }
    return false;
  }
#endif

#ifdef KVFERRY_AVX512
  // The float32 counterpart of run_inplace_fast (float32 query and cache):
  // decode items of 1-3 query vectors at head_dim 32/64, 1-2 at 128, in one
  // loop specialized at compile time, rows read in place tile by tile. The
  // tile's K rows are interleaved in token pairs (unpack of 32-bit lanes,
  // once for all Q queries) and multiplied with each query duplicated
  // likewise, so each query's 16 scores need rounds 2 and 3 of
  // transpose_sum16 only (21 instructions instead of 45), and each V row is
  // loaded once for all Q queries (run()'s per-query loop reads every row Q
  // times and keeps acc in memory across the tile). Lazy softmax rescaling
  // and the spread prefetch of the next block as in run_inplace_fast; every
  // product and sum is a float32 FMA, p stays float32. Measured (batch 32,
  // context 384, G = 3, head_dim 64, against run()'s loop, alternating A/B):
  // one thread warm 0.5-0.55x the time, K/V from memory (--layers 30) 0.68x
  // on one thread, about 0.75x on two. Tried and not kept: letting these
  // items take run_staged (1.15x the per-query loop's time at M = 3), tile
  // t + 1's scores and softmax before tile t's P . V (no gain, as in
  // run_inplace_fast), each query vector loaded once for four token pairs
  // (1.2x: GCC then spills), prefetching 48 or 64 tokens ahead or into L2
  // only (1.05-1.1x).
  // An fp8 cache's rows are widened to float as they are loaded (load16).
  // The state and tile step of run_inplace_f32 (one KV head, Q float32
  // query vectors, head_dim kDim), also run over every KV head of an item at
  // once (run_rows_f32), as InplaceBf16 is for bf16.
  template <int Q, int kDim>
  struct InplaceF32 : InplaceState<Q> {
    using InplaceState<Q>::l, InplaceState<Q>::m, InplaceState<Q>::limit, InplaceState<Q>::acc;
    static constexpr int kHeadDim = kDim;
    static constexpr int C = kDim / 16;  // 16-float chunks per row (= accumulators per query)
    // The queries duplicated for the token-pair layout: lanes 4L + 2i and
    // 4L + 2i + 1 of qbuf[k][c][0] (L a 128-bit lane) hold dim 16c + 4L + i,
    // of qbuf[k][c][1] dim 16c + 4L + 2 + i. (GCC keeps them in registers
    // across the tile loop of run_inplace_f32, up to 24 at Q = 3; forcing
    // them to be read from memory per tile measured no faster.)
    alignas(64) __m512 qbuf[Q][C][2];

    void init(const float* qf, const int64_t* limits, float* acc_) {
      this->reset(limits, acc_);
      for (int k = 0; k < Q; ++k) {
        const float* qk = qf + k * kDim;
        for (int c = 0; c < C; ++c) {
          const __m512 qv = _mm512_loadu_ps(qk + 16 * c);
          qbuf[k][c][0] = _mm512_unpacklo_ps(qv, qv);
          qbuf[k][c][1] = _mm512_unpackhi_ps(qv, qv);
        }
      }
    }

    // Tokens [start, start + n) of one block, head rows at kt and vt
    // (row_stride elements apart); the cursor's hooks as in InplaceBf16.
    template <bool kFull, typename Cursor>
    __attribute__((always_inline)) void tile(Cursor& pf, const scalar_t* kt, const scalar_t* vt, int64_t row_stride,
                                             int64_t start, int64_t n, float scale) {
      const __m512 zero = _mm512_setzero_ps();
      // Rows past n are zero, never read (an unwritten slot may hold NaN).
      // The row pointers advance by a token pair at a time (not 16 offsets
      // from kt: GCC keeps those on the stack and reloads them per row).
      auto row = [&](const scalar_t* p, int64_t t, int c) __attribute__((always_inline)) {
        return kFull || t < n ? load16(p + 16 * c) : zero;
      };
      const scalar_t* kr = kt;
      // Per 4 tokens (two pairs), round 2 of the reduction right away, so
      // that few partial vectors are live: y[k][qd & 1] holds tokens 4qd..4qd+3.
      // (Separate chains for each pair's lo and hi products, for more FMAs
      // in flight with 1-2 queries, measured no faster.)
      __m512 y[Q][2], wv[Q][2];
#pragma GCC unroll 4
      for (int qd = 0; qd < 4; ++qd) {
        __m512 x[Q][2];
        for (int k = 0; k < Q; ++k) x[k][0] = x[k][1] = zero;
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          const int p = 2 * qd + e;
          pf.k_pair(p);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) {
            const __m512 a = row(kr, 2 * p, c), b = row(kr + row_stride, 2 * p + 1, c);
            const __m512 lo = _mm512_unpacklo_ps(a, b), hi = _mm512_unpackhi_ps(a, b);
            for (int k = 0; k < Q; ++k) {
              x[k][e] = _mm512_fmadd_ps(lo, qbuf[k][c][0], x[k][e]);
              x[k][e] = _mm512_fmadd_ps(hi, qbuf[k][c][1], x[k][e]);
            }
          }
          kr += 2 * row_stride;
        }
        for (int k = 0; k < Q; ++k) {
          const __m512d a = _mm512_castps_pd(x[k][0]), b = _mm512_castps_pd(x[k][1]);
          y[k][qd & 1] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
          if (qd & 1) {
            wv[k][qd / 2] = _mm512_add_ps(_mm512_shuffle_f32x4(y[k][0], y[k][1], 0x44),
                                          _mm512_shuffle_f32x4(y[k][0], y[k][1], 0xEE));
          }
        }
      }
      alignas(64) float pp[Q][kTile];
      float alpha[Q];
      bool rescaled = false;
      for (int k = 0; k < Q; ++k) {
        const __m512 w0 = wv[k][0], w1 = wv[k][1];
        const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
        const __m512 sk = _mm512_mul_ps(sum, _mm512_set1_ps(scale));
        alpha[k] = lazy_softmax<true, float, true>(sk, std::min(n, limit[k] - start), m[k], l[k], pp[k]);
        rescaled |= alpha[k] != 1.f;
      }
      // The weights are then read by broadcast loads, the queries from memory (see run_inplace_fast).
      asm volatile("" ::: "memory");
      __m512 o[Q][C];
      for (int k = 0; k < Q; ++k) for (int r = 0; r < C; ++r) o[k][r] = _mm512_loadu_ps(acc + k * kDim + 16 * r);
      if (rescaled) {
        for (int k = 0; k < Q; ++k) {
          const __m512 a = _mm512_set1_ps(alpha[k]);
          for (int r = 0; r < C; ++r) o[k][r] = _mm512_mul_ps(o[k][r], a);
        }
      }
      if (!kFull) pf.v_rest();
#pragma GCC unroll 16
      for (int t = 0; t < kTile; ++t) {
        if (kFull && t % 2 == 0) pf.v_pair(t / 2);
        if (!kFull && t >= n) break;
        for (int c = 0; c < C; ++c) {
          const __m512 vr = load16(vt + 16 * c);
          for (int k = 0; k < Q; ++k) o[k][c] = _mm512_fmadd_ps(_mm512_set1_ps(pp[k][t]), vr, o[k][c]);
        }
        vt += row_stride;
      }
      for (int k = 0; k < Q; ++k) for (int r = 0; r < C; ++r) _mm512_storeu_ps(acc + k * kDim + 16 * r, o[k][r]);
    }
  };

  template <int Q, int kDim>
  void run_inplace_f32(const Seq& seq, int64_t j0, int64_t j1, int64_t h, Scratch& w) const {
    static_assert(kWidenF32<scalar_t, qscalar_t>);
    InplaceF32<Q, kDim> st;
    st.init(w.qf.data(), w.limit.data(), w.acc.data());
    run_head_tiles(seq, seq.end(j1), h, st);
    st.store(w, 0);
  }

  // run_inplace_f32 over every KV head of a decode item at once
  // (run_rows_tiles). Query vectors [h * Q, h * Q + Q) of w.qf and of w's
  // state are head h's.
  template <int Q, int kDim>
  void run_rows_f32(const Seq& seq, int64_t j1, Scratch& w) const {
    static_assert(kWidenF32<scalar_t, qscalar_t>);
    InplaceF32<Q, kDim> st[kMaxRowHeads];
    for (int64_t h = 0; h < kv_heads; ++h) st[h].init(w.qf.data() + h * Q * kDim, w.limit.data(), w.acc.data() + h * Q * kDim);
    run_rows_tiles(seq, seq.end(j1), st);
    for (int64_t h = 0; h < kv_heads; ++h) st[h].store(w, h * Q);
  }

  // The float32 items run_inplace_f32 has a specialization for; false otherwise.
  bool try_inplace_f32(const Seq& seq, int64_t j0, int64_t j1, int64_t h, Scratch& w) const {
    if constexpr (kWidenF32<scalar_t, qscalar_t>) {
      const int64_t M = static_cast<int64_t>(w.m.size());
      if (head_dim == 64) {
        if (M == 1) return run_inplace_f32<1, 64>(seq, j0, j1, h, w), true;
        if (M == 2) return run_inplace_f32<2, 64>(seq, j0, j1, h, w), true;
        if (M == 3) return run_inplace_f32<3, 64>(seq, j0, j1, h, w), true;
      } else if (head_dim == 32) {
        if (M == 1) return run_inplace_f32<1, 32>(seq, j0, j1, h, w), true;
        if (M == 2) return run_inplace_f32<2, 32>(seq, j0, j1, h, w), true;
        if (M == 3) return run_inplace_f32<3, 32>(seq, j0, j1, h, w), true;
      } else if (head_dim == 128) {
        if (M == 1) return run_inplace_f32<1, 128>(seq, j0, j1, h, w), true;
        if (M == 2) return run_inplace_f32<2, 128>(seq, j0, j1, h, w), true;
      }
    }
    return false;
  }
#endif

  // Items of kStageMinQueries or more queries: a stripe of consecutive
  // tiles (kStripeBytes4 or 2 of them) is staged once (bf16: K transposed
  // into dim pairs, V into token pairs; float32: K transposed, V copied) and
  // every query group of the item then runs over all of its tiles from
  // cache, so that a group's accumulators and softmax state are loaded and
  // stored once per stripe rather than once per tile. A tile may span blocks
  // (its rows are looked up one by one), so any block size works.
  void run_staged(const Seq& seq, int64_t j0, int64_t j1, int64_t h, Scratch& w) const {
    const int64_t D = head_dim;
    const int64_t end = seq.end(j1);
    // Groups whose accumulators fit in registers (staged_group): 4 queries
    // at head_dim <= 64, 2 at 128; otherwise 4, acc kept in memory.
    const int max_group = D == 128 ? 2 : 4;
    // Vectors per staged tile, each of K and V: D / 2 for bf16, D for float32.
    const int64_t per_tile = kPath == Path::kDpbf16 ? D / 2 : D;
    const int64_t stripe_tiles =
        std::max<int64_t>(1, (max_group == 4 ? (kPath == Path::kDpbf16 ? kStripeBytes4Bf16 : kStripeBytes4) : kStripeBytes2) /
                                 (2 * 64 * per_tile));
    w.kp.resize(stripe_tiles * per_tile);
    w.vp.resize(stripe_tiles * per_tile);
    auto stage = [&](int64_t t, int64_t n, const scalar_t* const* krows, const scalar_t* const* vrows) {
      __m512i* kp = w.kp.data() + t * per_tile;
      __m512i* vp = w.vp.data() + t * per_tile;
      if constexpr (kPath == Path::kDpbf16 && kIsFp8<scalar_t>) {
#ifdef KVFERRY_FP8_DPBF16
        if (n == kTile) stage_tile_fp8<true>(krows, vrows, n, D, kp, vp);
        else stage_tile_fp8<false>(krows, vrows, n, D, kp, vp);
#endif
      } else if constexpr (kPath == Path::kDpbf16) {
#ifdef KVFERRY_AVX512_BF16
        const auto* kb = reinterpret_cast<const at::BFloat16* const*>(krows);
        const auto* vb = reinterpret_cast<const at::BFloat16* const*>(vrows);
        if (n == kTile) stage_tile_bf16<true>(kb, vb, n, D, kp, vp);
        else stage_tile_bf16<false>(kb, vb, n, D, kp, vp);
#endif
      } else {
        if (n == kTile) stage_tile_f32<true>(krows, vrows, n, D, kp, vp);
        else stage_tile_f32<false>(krows, vrows, n, D, kp, vp);
      }
    };
    auto groups = [&](int64_t stripe, int64_t tokens, int64_t tiles) {
      for_query_groups(seq, j0, h, stripe, tokens, max_group, w, [&](auto tag, auto&&... a) {
        constexpr int Q = decltype(tag)::value;
        const __m512i* kp = w.kp.data();
        const __m512i* vp = w.vp.data();
        if constexpr (kPath == Path::kDpbf16) {
#ifdef KVFERRY_AVX512_BF16
          if constexpr (Q <= 2) {
            if (D == 128) return staged_group<Q, 128>(a..., kp, vp, tiles, D, scale);
          }
          if (D == 64) staged_group<Q, 64>(a..., kp, vp, tiles, D, scale);
          else if (D == 32) staged_group<Q, 32>(a..., kp, vp, tiles, D, scale);
          else staged_group<Q, 0>(a..., kp, vp, tiles, D, scale);
#endif
        } else {
          if constexpr (Q <= 2) {
            if (D == 128) return staged_group_f32<Q, 128>(a..., kp, vp, tiles, D, scale);
          }
          if (D == 64) staged_group_f32<Q, 64>(a..., kp, vp, tiles, D, scale);
          else if (D == 32) staged_group_f32<Q, 32>(a..., kp, vp, tiles, D, scale);
          else if (D == 16) staged_group_f32<Q, 16>(a..., kp, vp, tiles, D, scale);
          else staged_group_f32<Q, 0>(a..., kp, vp, tiles, D, scale);
        }
      });
    };
    for_each_stripe(seq, h, end, stripe_tiles, stage, groups);
  }
#endif

#if !defined(KVFERRY_AVX512) && defined(__AVX2__) && defined(__FMA__)
  // run_inplace_f32 for the AVX2 build (8 lanes, 16 registers): float32
  // query and cache, items of 1-3 query vectors (decode) at head_dim 32, 64
  // or 128, in one loop specialized at compile time. run()'s per-query loop
  // reads each tile's rows once per query (block_scores reduces 8 dot
  // products with hadd per query, softmax_update takes an exact max and a
  // separate exp pass per query, block_accumulate keeps acc in memory);
  // here the K rows of a token pair are interleaved once (unpack of 32-bit
  // lanes) for all Q queries, each query's 8 scores need two rounds of
  // shuffles, the softmax is rescaled lazily (lazy_softmax's kLazyRescale)
  // and each V row is loaded once per pass for all Q queries. P . V runs in
  // passes of R registers (32 dims, 64 with one query) per query so that Q x
  // R accumulators fit. Tiles of up to 16 tokens inside one block, rows read
  // in place, never past n; float32 FMAs throughout. Measured (AVX2 build,
  // batch 32, context 384, G = 3, head_dim 64, against run()'s loop): one
  // thread warm 0.54x the time, K/V from memory 0.6x. Loading each query
  // vector once for both token pairs of a 4-token step measured 1.36x
  // (GCC hoists all Q * C * 2 of them out of the loop and spills).
  // One KV head's state in run_inplace_f32_avx2's loop over the tiles: Q
  // query vectors at head_dim kDim. The queries are duplicated for the
  // token-pair layout (see run_inplace_f32) and read as memory operands of
  // the FMAs; acc [Q][kDim] (zero at the start) is updated in memory per tile.
  template <int Q, int kDim>
  struct InplaceF32Avx2 {
    static constexpr int kHeadDim = kDim;
    static constexpr int C = kDim / 8;                       // 8-float chunks per row
    static constexpr int R = Q == 1 ? std::min(C, 8) : 4;    // accumulators per query per P . V pass
    alignas(32) __m256 qbuf[Q][C][2];
    __m256 l[Q][2];  // softmax sums per lane, tokens 0-7 and 8-15 of the tiles
    float m[Q];
    int64_t limit[Q];
    float* acc;
    alignas(32) float pp[Q][kTile];

    void init(const float* qf, const int64_t* limits, float* acc_) {
      acc = acc_;
      for (int k = 0; k < Q; ++k) {
        const float* qk = qf + k * kDim;
        for (int c = 0; c < C; ++c) {
          const __m256 qv = _mm256_loadu_ps(qk + 8 * c);
          qbuf[k][c][0] = _mm256_unpacklo_ps(qv, qv);
          qbuf[k][c][1] = _mm256_unpackhi_ps(qv, qv);
        }
        l[k][0] = l[k][1] = _mm256_setzero_ps();
        m[k] = -std::numeric_limits<float>::infinity();
        limit[k] = limits[k];
      }
    }

    // Tokens [start, start + n) of one block, head rows at kt and vt
    // (row_stride elements apart); pf.pair_step() once per token pair.
    template <bool kFull, typename Prefetch>
    __attribute__((always_inline)) void tile(Prefetch& pf, const scalar_t* kt, const scalar_t* vt,
                                             int64_t row_stride, int64_t start, int64_t n, float scale) {
      const __m256 zero = _mm256_setzero_ps();
      const __m256i iota0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), iota1 = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
      // Rows past n are zero, never read (an unwritten slot may hold NaN).
      auto row = [&](const scalar_t* p, int64_t t, int c) __attribute__((always_inline)) {
        return kFull || t < n ? load8(p + 8 * c) : zero;
      };
      // Scores: s[k][half] lane j = token 8 half + j. Per 4 tokens (two
      // pairs) the first round of the reduction right away: y[k][qd & 1]
      // holds tokens 4qd..4qd+3 (per 128-bit lane: partial sums of the four).
      __m256 s[Q][2], y[Q][2];
      const scalar_t* kr = kt;
#pragma GCC unroll 4
      for (int qd = 0; qd < 4; ++qd) {
        __m256 x[Q][2];
        for (int k = 0; k < Q; ++k) x[k][0] = x[k][1] = zero;
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          const int p = 2 * qd + e;
          pf.pair_step();
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c) {
            const __m256 a = row(kr, 2 * p, c), b = row(kr + row_stride, 2 * p + 1, c);
            const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
            for (int k = 0; k < Q; ++k) {
              x[k][e] = _mm256_fmadd_ps(lo, qbuf[k][c][0], x[k][e]);
              x[k][e] = _mm256_fmadd_ps(hi, qbuf[k][c][1], x[k][e]);
            }
          }
          kr += 2 * row_stride;
        }
        for (int k = 0; k < Q; ++k) {
          const __m256d a = _mm256_castps_pd(x[k][0]), b = _mm256_castps_pd(x[k][1]);
          y[k][qd & 1] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
          if (qd & 1) {  // add the two 128-bit lanes: tokens 8 (qd / 2) .. + 7 in order
            s[k][qd / 2] = _mm256_add_ps(_mm256_permute2f128_ps(y[k][0], y[k][1], 0x20),
                                         _mm256_permute2f128_ps(y[k][0], y[k][1], 0x31));
          }
        }
      }
      // Online softmax step per query, rescaled lazily as lazy_softmax does.
      float alpha[Q];
      bool rescaled = false;
      for (int k = 0; k < Q; ++k) {
        const __m256 sc = _mm256_set1_ps(scale);
        const __m256 s0 = _mm256_mul_ps(s[k][0], sc), s1 = _mm256_mul_ps(s[k][1], sc);
        const __m256i vis = _mm256_set1_epi32(static_cast<int>(std::min(n, limit[k] - start)));
        const __m256 valid0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(vis, iota0));
        const __m256 valid1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(vis, iota1));
        alpha[k] = 1.f;
        const __m256 th = _mm256_set1_ps(m[k] + kLazyRescaleAvx2);
        const __m256 over = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(s0, th, _CMP_GT_OQ), valid0),
                                         _mm256_and_ps(_mm256_cmp_ps(s1, th, _CMP_GT_OQ), valid1));
        if (_mm256_movemask_ps(over)) {
          const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
          const float tile_max = _mm256_cvtss_f32(
              max_lanes(_mm256_max_ps(_mm256_blendv_ps(ninf, s0, valid0), _mm256_blendv_ps(ninf, s1, valid1))));
          alpha[k] = m[k] == -std::numeric_limits<float>::infinity()
                         ? 0.f  // the first tile
                         : _mm256_cvtss_f32(exp256(_mm256_set1_ps(m[k] - tile_max)));
          const __m256 av = _mm256_set1_ps(alpha[k]);
          l[k][0] = _mm256_mul_ps(l[k][0], av);
          l[k][1] = _mm256_mul_ps(l[k][1], av);
          m[k] = tile_max;
        }
        const __m256 mv = _mm256_set1_ps(m[k]);
        // and, not blend: an invalid lane's exp may be inf; its bits become 0.
        const __m256 p0 = _mm256_and_ps(exp256(_mm256_sub_ps(s0, mv)), valid0);
        const __m256 p1 = _mm256_and_ps(exp256(_mm256_sub_ps(s1, mv)), valid1);
        l[k][0] = _mm256_add_ps(l[k][0], p0);
        l[k][1] = _mm256_add_ps(l[k][1], p1);
        _mm256_store_ps(pp[k], p0);
        _mm256_store_ps(pp[k] + 8, p1);
        rescaled |= alpha[k] != 1.f;
      }
      // As in run_inplace_fast: the weights are then read by broadcast loads.
      asm volatile("" ::: "memory");
#pragma GCC unroll 4
      for (int c0 = 0; c0 < C; c0 += R) {
        __m256 o[Q][R];
        for (int k = 0; k < Q; ++k) for (int r = 0; r < R; ++r) o[k][r] = _mm256_loadu_ps(acc + k * kDim + 8 * (c0 + r));
        if (rescaled) {
          for (int k = 0; k < Q; ++k) {
            const __m256 a = _mm256_set1_ps(alpha[k]);
            for (int r = 0; r < R; ++r) o[k][r] = _mm256_mul_ps(o[k][r], a);
          }
        }
        const scalar_t* vr = vt + 8 * c0;
#pragma GCC unroll 16
        for (int t = 0; t < kTile; ++t) {
          if (!kFull && t >= n) break;
          for (int r = 0; r < R; ++r) {
            const __m256 v = load8(vr + 8 * r);
            for (int k = 0; k < Q; ++k) o[k][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&pp[k][t]), v, o[k][r]);
          }
          vr += row_stride;
        }
        for (int k = 0; k < Q; ++k) for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + k * kDim + 8 * (c0 + r), o[k][r]);
      }
    }

    // The softmax max and sum per query, into m_out and l_out.
    void store(float* m_out, float* l_out) const {
      for (int k = 0; k < Q; ++k) {
        m_out[k] = m[k];
        l_out[k] = sum_lanes(_mm256_add_ps(l[k][0], l[k][1]));
      }
    }
  };

  template <int Q, int kDim>
  void run_inplace_f32_avx2(const Seq& seq, int64_t j0, int64_t j1, int64_t h, Scratch& w) const {
    static_assert(kWidenF32<scalar_t, qscalar_t>);
    InplaceF32Avx2<Q, kDim> st;
    st.init(w.qf.data(), w.limit.data(), w.acc.data());
    run_head_tiles(seq, seq.end(j1), h, st);  // K and V rows requested during the scores
    st.store(w.m.data(), w.l.data());
  }

  // Items of kStageMinQueriesAvx2 or more float32 query vectors over a
  // float32 or fp8 cache (prompt chunks, verify windows), head_dim % 8 ==
  // 0: a stripe of kStripeBytesAvx2 of tiles is staged once
  // (stage_tile_f32_avx2: K transposed; an fp8 cache's V widened, a float32
  // cache's read in place) and every group of up to 4 queries then runs
  // over all of its tiles (staged_group_f32_avx2). run()'s per-query loop
  // instead reads each tile's rows once per query and reduces every score
  // horizontally.
  void run_staged_avx2(const Seq& seq, int64_t j0, int64_t j1, int64_t h, Scratch& w) const {
    const int64_t D = head_dim, M = (j1 - j0) * group;
    const int64_t end = seq.end(j1);
    const int64_t per_tile = 2 * D;  // vectors per staged tile, each of K and V
    const int64_t stripe_tiles = std::max<int64_t>(1, kStripeBytesAvx2 / (2 * 32 * per_tile));
    // V rows of an fp8 cache are widened into the stripe; a float32 cache's are read in place.
    constexpr bool kCopyV = !std::is_same_v<scalar_t, float>;
    w.kt8.resize(stripe_tiles * per_tile);
    if constexpr (kCopyV) w.vt8.resize(stripe_tiles * per_tile);
    w.vrow8.resize(stripe_tiles * kTile);
    auto stage = [&](int64_t t, int64_t n, const scalar_t* const* krows, const scalar_t* const* vrows) {
      __m256* kt = w.kt8.data() + t * per_tile;
      __m256* vt = kCopyV ? w.vt8.data() + t * per_tile : nullptr;
      if (n == kTile) stage_tile_f32_avx2<true, kCopyV>(krows, vrows, n, D, kt, vt);
      else stage_tile_f32_avx2<false, kCopyV>(krows, vrows, n, D, kt, vt);
      for (int64_t j = 0; j < n; ++j) {
        if constexpr (kCopyV) w.vrow8[t * kTile + j] = reinterpret_cast<const float*>(vt + j * (D / 8));
        else w.vrow8[t * kTile + j] = reinterpret_cast<const float*>(vrows[j]);
      }
    };
    // The queries that see any of the stripe, from the last down (later
    // queries see more: limits grow with i), in groups of up to 4.
    auto groups = [&](int64_t stripe, int64_t tokens, int64_t tiles) {
      for (int64_t top = M - 1; top >= 0 && w.limit[top] > stripe; top -= 4) {
        const int q = static_cast<int>(std::min<int64_t>(4, top + 1));
        const float* qs[4];
        float* accs[4];
        float ms[4], ls[4];
        int64_t visible[4];
        for (int k = 0; k < q; ++k) {
          const int64_t i = top - k;
          qs[k] = w.qf.data() + i * D;
          accs[k] = w.acc.data() + i * D;
          ms[k] = w.m[i];
          ls[k] = w.l[i];
          visible[k] = std::min(tokens, w.limit[i] - stripe);
        }
        const __m256* kt = w.kt8.data();
        const float* const* vt = w.vrow8.data();
        switch (q) {
          case 4: staged_group_f32_avx2<4>(qs, accs, ms, ls, visible, kt, vt, tiles, D, scale); break;
          case 3: staged_group_f32_avx2<3>(qs, accs, ms, ls, visible, kt, vt, tiles, D, scale); break;
          case 2: staged_group_f32_avx2<2>(qs, accs, ms, ls, visible, kt, vt, tiles, D, scale); break;
          default: staged_group_f32_avx2<1>(qs, accs, ms, ls, visible, kt, vt, tiles, D, scale);
        }
        for (int k = 0; k < q; ++k) w.m[top - k] = ms[k], w.l[top - k] = ls[k];
      }
    };
    for_each_stripe(seq, h, end, stripe_tiles, stage, groups);
  }

  // run_inplace_f32_avx2 over every KV head of the item at once, tile by
  // tile: the heads' tiles of one block run back to back, so each block's
  // K and V are read as whole rows (the block's contiguous bytes), not as
  // one head's slice of each row. Reading one head's 256-byte slices of
  // scattered 12 KiB blocks measured 5.7 GB/s on Zen 1 against 12.5 GB/s for
  // whole rows (bench/scattered_read.c, 2 threads). Query vectors
  // [h * Q, h * Q + Q) of w.qf and w.acc are head h's.
  template <int Q, int kDim>
  void run_rows_f32_avx2(const Seq& seq, int64_t j1, Scratch& w) const {
    static_assert(kWidenF32<scalar_t, qscalar_t>);
    InplaceF32Avx2<Q, kDim> st[kMaxRowHeads];
    for (int64_t h = 0; h < kv_heads; ++h) st[h].init(w.qf.data() + h * Q * kDim, w.limit.data(), w.acc.data() + h * Q * kDim);
    run_rows_tiles(seq, seq.end(j1), st);
    for (int64_t h = 0; h < kv_heads; ++h) st[h].store(w.m.data() + h * Q, w.l.data() + h * Q);
  }

  // The float32 items run_inplace_f32_avx2 has a specialization for (and
  // fp8 ones, rows widened by load8); false otherwise.
  bool try_inplace_f32_avx2(const Seq& seq, int64_t j0, int64_t j1, int64_t h, Scratch& w) const {
    if constexpr (kWidenF32<scalar_t, qscalar_t>) {
      const int64_t M = static_cast<int64_t>(w.m.size());
      if (head_dim == 64) {
        if (M == 1) return run_inplace_f32_avx2<1, 64>(seq, j0, j1, h, w), true;
        if (M == 2) return run_inplace_f32_avx2<2, 64>(seq, j0, j1, h, w), true;
        if (M == 3) return run_inplace_f32_avx2<3, 64>(seq, j0, j1, h, w), true;
      } else if (head_dim == 32) {
        if (M == 1) return run_inplace_f32_avx2<1, 32>(seq, j0, j1, h, w), true;
        if (M == 2) return run_inplace_f32_avx2<2, 32>(seq, j0, j1, h, w), true;
        if (M == 3) return run_inplace_f32_avx2<3, 32>(seq, j0, j1, h, w), true;
      } else if (head_dim == 128) {
        if (M == 1) return run_inplace_f32_avx2<1, 128>(seq, j0, j1, h, w), true;
        if (M == 2) return run_inplace_f32_avx2<2, 128>(seq, j0, j1, h, w), true;
        if (M == 3) return run_inplace_f32_avx2<3, 128>(seq, j0, j1, h, w), true;
      }
    }
    return false;
  }
#endif

  // Whether query tokens [j0, j1) of a sequence can run as one item over
  // every KV head (run_all_heads) rather than as one item per head: decode
  // items of 1-3 query vectors per head, float32 in the AVX2 build
  // (run_rows_f32_avx2) and in the AVX-512 one (run_rows_f32; 1-2 at
  // head_dim 128, as run_inplace_f32), a bf16 query over a bf16 or fp8
  // cache with AVX512-BF16 (run_rows_bf16; 1-2 at head_dim 128;
  // an fp8 cache's 64-byte head rows are a third of each row's lines at 3
  // KV heads: 0.73-0.79x the per-head items' time, bf16 0.83-0.88x, batch
  // 32, context 384, 30 layers, Zen 4). Not the AVX2 build's fp8 items:
  // there the widening, not the read, is the bound (0.94-1.0x), and their
  // instantiations would add minutes to a cold build.
  static constexpr bool kFloat32Items = std::is_same_v<scalar_t, float> && std::is_same_v<qscalar_t, float>;
  static constexpr bool kAllHeadsItems =
#if defined(KVFERRY_AVX512)
      (kPath == Path::kWiden && kFloat32Items) ||
      (kHaveDpbf16 && kPath == Path::kDpbf16 &&
       (std::is_same_v<scalar_t, at::BFloat16> || (kHaveFp8Dpbf16 && kIsFp8<scalar_t>)));
#elif defined(__AVX2__) && defined(__FMA__)
      kPath == Path::kPortable && kFloat32Items;
#else
      false;
#endif
  bool all_heads_item(int64_t j0, int64_t j1) const {
    if constexpr (kAllHeadsItems) {
      const int64_t M = (j1 - j0) * group;
      return M >= 1 && M < kStageMinQueries && kv_heads > 1 && kv_heads <= kMaxRowHeads &&
             (head_dim == 32 || head_dim == 64 || (head_dim == 128 && (kPath == Path::kPortable || M <= 2)));
    }
    return false;
  }

  // This build's all-heads run of the item for Q query vectors per head at
  // head_dim kDim (kAllHeadsItems).
  template <int Q, int kDim>
  void run_rows(const Seq& seq, int64_t j0, int64_t j1, Scratch& w) const {
#if defined(KVFERRY_AVX512)
    if constexpr (kPath == Path::kWiden) run_rows_f32<Q, kDim>(seq, j1, w);
#if defined(KVFERRY_AVX512_BF16)
    if constexpr (kPath == Path::kDpbf16) run_rows_bf16<Q, kDim>(seq, j0, j1, w);
#endif
#elif defined(__AVX2__) && defined(__FMA__)
    if constexpr (kPath == Path::kPortable) run_rows_f32_avx2<Q, kDim>(seq, j1, w);
#endif
  }

  // Query tokens [j0, j1) of `seq` against every KV head (all_heads_item).
  void run_all_heads(const Seq& seq, int64_t j0, int64_t j1, Scratch& w) const {
    if constexpr (kAllHeadsItems) {
      const int64_t M = (j1 - j0) * group, D = head_dim;
      w.acc.assign(kv_heads * M * D, 0.f);
      w.m.resize(kv_heads * M);
      w.l.resize(kv_heads * M);
      w.limit.resize(M);
      // Float32 items read a float copy of the queries, head h's vectors at [h * M, h * M + M).
      if constexpr (kFloat32Items) w.qf.resize(kv_heads * M * D);
      for (int64_t i = 0; i < M; ++i) {
        const int64_t j = j0 + i / group, g = i % group;
        w.limit[i] = seq.limit(j);
        if constexpr (kFloat32Items) {
          for (int64_t h = 0; h < kv_heads; ++h) {
            const qscalar_t* qi = query(j, g, h, seq);
            std::copy(qi, qi + D, w.qf.data() + (h * M + i) * D);
          }
        }
      }
#ifdef KVFERRY_AVX512
      w.lvec.resize(kv_heads * M);
#endif
      auto by_q = [&](auto dim) {
        constexpr int kDim = decltype(dim)::value;
        if (M == 1) run_rows<1, kDim>(seq, j0, j1, w);
        else if (M == 2) run_rows<2, kDim>(seq, j0, j1, w);
        else if constexpr (kDim != 128 || kPath == Path::kPortable) run_rows<3, kDim>(seq, j0, j1, w);
      };
      if (D == 64) by_q(std::integral_constant<int, 64>{});
      else if (D == 32) by_q(std::integral_constant<int, 32>{});
      else by_q(std::integral_constant<int, 128>{});
#ifdef KVFERRY_AVX512
      for (int64_t i = 0; i < kv_heads * M; ++i) w.l[i] = _mm512_reduce_add_ps(w.lvec[i]);
#endif
      for (int64_t h = 0; h < kv_heads; ++h) finish(seq, j0, M, h, w, h * M);
      return;
    }
    for (int64_t h = 0; h < kv_heads; ++h) run(seq, j0, j1, h, w);
  }

  // Query tokens [j0, j1) of `seq` against KV head h: their positions see
  // the context up to the last one's, end = seq.end(j1).
  void run(const Seq& seq, int64_t j0, int64_t j1, int64_t h, Scratch& w) const {
    const int64_t M = (j1 - j0) * group, D = head_dim;
    const int64_t row_stride = kv_heads * D;  // between tokens of a block
    const int64_t end = seq.end(j1);
    w.acc.assign(M * D, 0.f);
    w.m.assign(M, -std::numeric_limits<float>::infinity());
    w.l.assign(M, 0.f);
    w.limit.resize(M);
    if constexpr (kPath == Path::kPortable || kPath == Path::kWiden) w.qf.resize(M * D);
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = (j - j0) * group + g;  // query vector: token j, head h * G + g
        w.limit[i] = seq.limit(j);
        if constexpr (kPath == Path::kPortable || kPath == Path::kWiden) {
          const qscalar_t* qi = query(j, g, h, seq);
          for (int64_t d = 0; d < D; ++d) w.qf[i * D + d] = static_cast<float>(qi[d]);
        }
      }
    }
    if (seq.tree) return run_tree(seq, j0, j1, h, w);
#ifdef KVFERRY_AVX512_BF16
    if constexpr (kPath == Path::kDpbf16) {
      w.lvec.assign(M, _mm512_setzero_ps());
      if (M >= kStageMinQueries) {
        run_staged(seq, j0, j1, h, w);
      } else if (!try_inplace_fast(seq, j0, j1, h, w)) {
        // run_inplace reads bf16 rows in place; an fp8 cache's items
        // without a run_inplace_fast specialization (3 query vectors at
        // head_dim 128, head_dims other than 32/64/128) stage their tiles.
        if constexpr (kIsFp8<scalar_t>) run_staged(seq, j0, j1, h, w);
        else run_inplace(seq, j0, j1, h, w);
      }
      for (int64_t i = 0; i < M; ++i) w.l[i] = _mm512_reduce_add_ps(w.lvec[i]);
      return finish(seq, j0, M, h, w);
    }
#endif
#ifdef KVFERRY_AVX512
    // A float32 query over a float32 cache: items of kStageMinQueries or
    // more query vectors stage their tiles too (stage_tile_f32,
    // staged_group_f32), decode items of 1-3 take run_inplace_f32; the rest
    // read rows in place below. Likewise an fp8 cache under a float32 or
    // float16 query (its float copy in qf; a bf16 one where the CPU has no
    // VBMI), the rows widened to float as they are staged or read (load16).
    if constexpr (kPath == Path::kWiden && kWidenF32<scalar_t, qscalar_t>) {
      w.lvec.assign(M, _mm512_setzero_ps());
      bool done = true;
      if (M >= kStageMinQueries) run_staged(seq, j0, j1, h, w);
      else done = try_inplace_f32(seq, j0, j1, h, w);  // false: no specialization, the loop below
      if (done) {
        for (int64_t i = 0; i < M; ++i) w.l[i] = _mm512_reduce_add_ps(w.lvec[i]);
        return finish(seq, j0, M, h, w);
      }
    }
#endif
#if !defined(KVFERRY_AVX512) && defined(__AVX2__) && defined(__FMA__)
    // The AVX2 build: decode items of 1-3 float32 query vectors take
    // run_inplace_f32_avx2, as do those over an fp8 cache (any query);
    // items of kStageMinQueriesAvx2 or more take run_staged_avx2.
    if constexpr (kPath == Path::kPortable && kWidenF32<scalar_t, qscalar_t>) {
      if (M < kStageMinQueries && try_inplace_f32_avx2(seq, j0, j1, h, w)) return finish(seq, j0, M, h, w);
      if (M >= kStageMinQueriesAvx2 && D % 8 == 0 && staged_avx2_enabled) {
        run_staged_avx2(seq, j0, j1, h, w);
        return finish(seq, j0, M, h, w);
      }
    }
#endif
    if constexpr (kPath == Path::kPortable && !std::is_same_v<scalar_t, float>) {
      w.kbuf.resize(kTile * D);
      w.vbuf.resize(kTile * D);
    }
    alignas(64) float s[kTile];
    const int64_t* table = seq.table;
    int64_t n = 0;  // tokens in the current tile: up to 16, never across a block boundary
    int64_t prefetched = 0;
    for (int64_t start = 0; start < end; start += n) {
      const int64_t in_block = start % block_size;
      n = std::min({kTile, end - start, block_size - in_block});
      prefetch_ahead(seq, h, start + n, end, prefetched);
      const int64_t base = (table[start / block_size] * block_size + in_block) * row_stride + h * D;
      const scalar_t* kt = k_ptr + base;
      const scalar_t* vt = v_ptr + base;
      const float* kf = nullptr;
      const float* vf = nullptr;
      int64_t ks = 0, vs = 0;
      if constexpr (kPath == Path::kPortable) {
        kf = as_float(kt, row_stride, n, D, w.kbuf.data(), ks);  // [n, D] at stride ks
        vf = as_float(vt, row_stride, n, D, w.vbuf.data(), vs);
      }
      // Earlier query tokens see fewer positions; query i sees tile tokens < visible.
      for (int64_t i = M - 1; i >= 0; --i) {
        const int64_t visible = std::min(n, w.limit[i] - start);
        if (visible <= 0) break;  // queries below i see even less (limits grow with i)
        float* acc = w.acc.data() + i * D;
        if constexpr (kPath == Path::kPortable) {
          block_scores(w.qf.data() + i * D, kf, ks, visible, D, scale, s);
          const float alpha = softmax_update(s, visible, w.m[i], w.l[i]);
          if (alpha != 1.f) for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
          block_accumulate(acc, s, vf, vs, visible, D);
        }
#ifdef KVFERRY_AVX512
        if constexpr (kPath != Path::kPortable) {
          float alpha = 1.f;
          {
            const __m512 sv = tile_scores16(w.qf.data() + i * D, kt, row_stride, visible, D, scale);
            _mm512_store_ps(s, softmax_tile(sv, visible, w.m[i], w.l[i], alpha));
            tile_accumulate16(acc, alpha, s, vt, row_stride, visible, D);
          }
        }
#endif
      }
    }
    finish(seq, j0, M, h, w);
  }

  // A draft tree's query tokens [j0, j1) against KV head h (seq.tree; w's
  // m, l, acc and limit set up by run()). One loop for every build and
  // dtype: a tile's rows as float (as_float, shared by the item's queries),
  // then per query the scores, the online softmax and P @ V. Tiles of the
  // cached context take softmax_update as run()'s loop does; a tile that
  // reaches into the chunk weighs the tokens the query's bits leave out 0
  // (skipped where it sees none of them: the running max stays finite).
  // split_contexts cuts a tree's sequence at the block of its chunk, so
  // this loop reads at most a block plus the chunk (<= 64 tokens); the
  // context before it runs as a part of its own on the fast kernels, and
  // combine_parts merges the two.
  void run_tree(const Seq& seq, int64_t j0, int64_t j1, int64_t h, Scratch& w) const {
    const int64_t M = (j1 - j0) * group, D = head_dim;
    const int64_t row_stride = kv_heads * D;
    const int64_t end = seq.end(j1);
    const int64_t chunk = seq.seq_len - seq.q_len;  // the chunk's first position
    w.qf.resize(M * D);
    for (int64_t i = 0; i < M; ++i) {
      const qscalar_t* qi = query(j0 + i / group, i % group, h, seq);
      for (int64_t d = 0; d < D; ++d) w.qf[i * D + d] = static_cast<float>(qi[d]);
    }
    if constexpr (!std::is_same_v<scalar_t, float>) {
      w.kbuf.resize(kTile * D);
      w.vbuf.resize(kTile * D);
    }
    alignas(64) float s[kTile];
    int64_t n = 0;
    int64_t prefetched = 0;
    for (int64_t start = 0; start < end; start += n) {
      const int64_t in_block = start % block_size;
      n = std::min({kTile, end - start, block_size - in_block});
      prefetch_ahead(seq, h, start + n, end, prefetched);
      const int64_t base = (seq.table[start / block_size] * block_size + in_block) * row_stride + h * D;
      int64_t ks = 0, vs = 0;
      const float* kf = as_float(k_ptr + base, row_stride, n, D, w.kbuf.data(), ks);
      const float* vf = as_float(v_ptr + base, row_stride, n, D, w.vbuf.data(), vs);
      for (int64_t i = M - 1; i >= 0; --i) {
        const int64_t visible = std::min(n, w.limit[i] - start);
        if (visible <= 0) break;  // queries below i see even less (limits grow with i)
        float* acc = w.acc.data() + i * D;
        block_scores(w.qf.data() + i * D, kf, ks, visible, D, scale, s);
        float alpha = 1.f;
        if (start + visible <= chunk) {
          alpha = softmax_update(s, visible, w.m[i], w.l[i]);
        } else {
          const uint64_t bits = static_cast<uint64_t>(seq.tree[j0 + i / group]);
          bool sees[kTile];
          float tile_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < visible; ++t) {
            const int64_t p = start + t;
            sees[t] = p < chunk || ((bits >> (p - chunk)) & 1u);
            if (sees[t]) tile_max = std::max(tile_max, s[t]);
          }
          if (!(tile_max > -std::numeric_limits<float>::infinity())) continue;  // none of this tile
          if (tile_max > w.m[i]) {
            alpha = std::exp(w.m[i] - tile_max);
            w.l[i] *= alpha;
            w.m[i] = tile_max;
          }
          float sum = 0.f;
          for (int64_t t = 0; t < visible; ++t) {
            s[t] = sees[t] ? std::exp(s[t] - w.m[i]) : 0.f;
            sum += s[t];
          }
          w.l[i] += sum;
        }
        if (alpha != 1.f) for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
        block_accumulate(acc, s, vf, vs, visible, D);
      }
    }
#ifdef KVFERRY_AVX512_BF16
    if constexpr (kPath == Path::kDpbf16) {
      // finish (and combine_parts) read the dpbf16 kernels' accumulators,
      // in pair_dim order: position e of each 32 dims holds dim pair_dim(e).
      float natural[32];
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t c = 0; c < D; c += 32) {
          float* a = w.acc.data() + i * D + c;
          std::copy(a, a + 32, natural);
          for (int64_t e = 0; e < 32; ++e) a[e] = natural[pair_dim(e)];
        }
      }
    }
#endif
    finish(seq, j0, M, h, w);
  }

  // Floats per query vector in a split item's partial result: acc [D], m, l.
  int64_t part_stride() const { return head_dim + 2; }

  // out rows of the item's M queries = acc / l; a split item's (seq.part)
  // keep acc, m and l for combine_parts instead.
  // `first`: where head h's query vectors start in w's arrays (all-heads items).
  void finish(const Seq& seq, int64_t j0, int64_t M, int64_t h, Scratch& w, int64_t first = 0) const {
    const int64_t D = head_dim;
    for (int64_t i = 0; i < M; ++i) {
      const int64_t row = (j0 + i / group) * num_heads + h * group + i % group;  // the query vector's row of seq
      const float* a = w.acc.data() + (first + i) * D;
      if (seq.part) {
        float* p = seq.part + row * part_stride();
        std::copy(a, a + D, p);
        p[D] = w.m[first + i];
        p[D + 1] = w.l[first + i];
        continue;
      }
      const float inv = w.l[first + i] > 0.f ? 1.f / w.l[first + i] : 0.f;  // seq_len == 0: zeros, not NaN
      emit(out_ptr + (seq.q_start * num_heads + row) * D, a, inv);
    }
  }

  // The parts of a split sequence (seq.part, rows of parts consecutive
  // buffers of q_len * num_heads query vectors each) merged into its out
  // rows: acc and l of each part scaled by exp(m_part - max m).
  void combine_parts(const Seq& seq, const float* parts, int64_t count, std::vector<float>& acc) const {
    const int64_t D = head_dim, stride = part_stride(), rows = seq.q_len * num_heads;
    acc.resize(D);
    for (int64_t row = 0; row < rows; ++row) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t k = 0; k < count; ++k) m = std::max(m, parts[(k * rows + row) * stride + D]);
      std::fill(acc.begin(), acc.end(), 0.f);
      float l = 0.f;
      for (int64_t k = 0; k < count; ++k) {
        const float* p = parts + (k * rows + row) * stride;
        if (p[D + 1] <= 0.f) continue;  // a part this query sees nothing of
        const float c = std::exp(p[D] - m);
        for (int64_t d = 0; d < D; ++d) acc[d] += c * p[d];
        l += c * p[D + 1];
      }
      emit(out_ptr + (seq.q_start * num_heads + row) * D, acc.data(), l > 0.f ? 1.f / l : 0.f);
    }
  }

  // One query vector's out row o = a * inv (a in the accumulator's dim order).
  void emit(qscalar_t* o, const float* a, float inv) const {
    const int64_t D = head_dim;
    if constexpr (kPath == Path::kDpbf16) {
#ifdef KVFERRY_AVX512_BF16
      const __m512 iv = _mm512_set1_ps(inv);
      for (int64_t c = 0; c < D; c += 32) {
        // In pair_dim order, 128-bit lane L of lo holds dims 8L..8L+3 and of hi 8L+4..8L+7.
        const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(a + c), iv);
        const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(a + c + 16), iv);
        // [lo.L0, lo.L1, hi.L0, hi.L1] -> lanes (0, 2, 1, 3): dims 0..15; likewise L2, L3: dims 16..31.
        const __m512 x0 = _mm512_shuffle_f32x4(lo, hi, 0x44), x1 = _mm512_shuffle_f32x4(lo, hi, 0xEE);
        const __m512 n0 = _mm512_shuffle_f32x4(x0, x0, 0xD8), n1 = _mm512_shuffle_f32x4(x1, x1, 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c), (__m256i)_mm512_cvtneps_pbh(n0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c + 16), (__m256i)_mm512_cvtneps_pbh(n1));
      }
#endif
    } else {
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<qscalar_t>(a[d] * inv);
    }
  }

  const qscalar_t* query(int64_t j, int64_t g, int64_t h, const Seq& seq) const {
    return q_ptr + (seq.q_start + j) * q_token_stride + (h * group + g) * head_dim;
  }

};

// Query tokens per work item: a long chunk is split into blocks of this
// many tokens, so that one long prompt keeps every thread busy (it would
// otherwise be only KVH items). Each block reads the context up to its own
// last position; the tiles it shares with other blocks come from cache.
// 64 where that still leaves at least kMinItemsPerThread items per thread
// (else 32): each item stages the tiles it reads, so 64-token blocks halve
// the staging per query vector (one thread, 2 x 512-token
// prompts: 0.95x the time of 32-token blocks; 256 tokens over 768 cached:
// 0.95x), but fewer items balance worse over the threads (longest first).
constexpr int64_t kQueryBlock = 32;
constexpr int64_t kLongQueryBlock = 64;
constexpr int64_t kMinItemsPerThread = 4;

struct Item {
  int64_t seq, j0, j1, cost;
  int64_t head;  // its KV head, or kAllHeads
};
constexpr int64_t kAllHeads = -1;

// Runs every (sequence, query block, kv_head) item, longest first, over
// torch's threads. Where at least kMinAllHeadsItemsPerThread query blocks
// per thread can (Attend::all_heads_item), each of those is one item over
// every KV head instead. Measured (AVX2 build, Zen 1, 2 threads, float32,
// K/V from memory): batch 32 at context 128-2048 0.6-0.82x the per-head
// items' time, batch 4-8 0.78-0.83x; batch 2, where two items leave the
// threads nothing to balance, 1.03-1.09x.
constexpr int64_t kMinAllHeadsItemsPerThread = 2;

// Context parts (split items). A step of fewer work items than
// kMinItemsPerThread per thread leaves threads idle, or waiting on the one
// that reads the longest context (on 2 threads: a float32 decode at batch
// 1-7 in the AVX2 build, one item per sequence; batch 1-2 where items are
// per KV head, at 3 KV heads).
// There, the context of each sequence whose query tokens form one block is
// cut at block boundaries into parts of at least kMinSplitTokens positions,
// so that there are about kMinItemsPerThread items per thread. Each part is
// a Seq of its own (Seq::cap, Seq::part); its unnormalized result is merged
// into the out rows after all items ran (combine_parts). With enough parts,
// a float32 batch of the AVX2 build also takes the all-heads items, whose
// whole-row reads are the faster ones. Measured (Zen 1, 2 threads, float32,
// K/V from memory, bench/paged_attention_kernel.py --layers 30): batch 1 at
// context 4096 0.58-0.62x the time of whole contexts, 2048 0.7x, 512-768
// 0.8-0.9x, 256 even; batch 2 at 4096 0.6x; batch 3 at 1024 0.7-0.8x.
// Parts of 128 positions were as fast as or faster than 256 at every
// context, and 4, 8 or 16 parts at 4096 the same within noise.
constexpr int64_t kMinSplitTokens = 128;

// The sequences as work: each one, or its context parts (split items),
// with the buffer their partial results go to.
struct SplitWork {
  struct Split {
    int64_t seq, count;  // seqs[seq] runs as `count` parts
    int64_t offset;      // where their results start in `parts`, one after another
  };
  std::vector<Seq> work;
  std::vector<Split> splits;
  std::vector<float> parts;
};

// items_of(j0, j1): the work items query tokens [j0, j1) of a sequence
// would be, whole (1 where one item covers every KV head, else KVH).
template <typename ItemsOf>
SplitWork split_contexts(const std::vector<Seq>& seqs, int64_t qblock, int64_t block_size, int64_t part_floats_per_token,
                         bool enabled, ItemsOf&& items_of) {
  SplitWork out;
  int64_t items = 0;
  for (const Seq& seq : seqs) {
    for (int64_t j0 = 0; j0 < std::max<int64_t>(seq.q_len, 1); j0 += qblock) items += items_of(j0, std::min(j0 + qblock, seq.q_len));
  }
  const int64_t target = kMinItemsPerThread * at::get_num_threads();
  const int64_t wanted = enabled && items < target ? (target + items - 1) / std::max<int64_t>(items, 1) : 1;
  // Boundaries per sequence, before any pointer into `parts` is taken.
  std::vector<std::vector<int64_t>> cuts(seqs.size());
  int64_t floats = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const Seq& seq = seqs[s];
    const int64_t context = seq.seq_len - seq.q_len;
    const int64_t count = seq.q_len >= 1 && seq.q_len <= qblock ? std::min(wanted, context / kMinSplitTokens) : 1;
    // A draft tree's last part starts at the block of its chunk: only that
    // part runs run_tree's loop, the context before it the fast kernels.
    const int64_t tree_from = seq.tree ? context / block_size * block_size : 0;
    if (count < 2 && tree_from == 0) continue;
    cuts[s].push_back(0);
    const int64_t span = seq.tree ? tree_from : context;
    for (int64_t k = 1; k < count; ++k) {
      const int64_t cut = k * span / count / block_size * block_size;
      if (cut > cuts[s].back()) cuts[s].push_back(cut);
    }
    if (tree_from > cuts[s].back()) cuts[s].push_back(tree_from);
    if (cuts[s].size() < 2) {  // blocks longer than the parts: no split
      cuts[s].clear();
      continue;
    }
    floats += static_cast<int64_t>(cuts[s].size()) * seq.q_len * part_floats_per_token;
  }
  out.parts.resize(floats);
  int64_t offset = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const Seq& seq = seqs[s];
    if (cuts[s].empty()) {
      out.work.push_back(seq);
      continue;
    }
    const int64_t count = static_cast<int64_t>(cuts[s].size());
    out.splits.push_back({static_cast<int64_t>(s), count, offset});
    for (int64_t k = 0; k < count; ++k) {
      const int64_t from = cuts[s][k];
      Seq part{seq.q_start, seq.q_len, seq.seq_len - from, seq.table + from / block_size};
      if (k + 1 < count) part.cap = cuts[s][k + 1] - from;  // the last part runs to the query tokens
      part.part = out.parts.data() + offset;
      // Only the last part reaches the chunk (positions shift by `from`, the chunk's start with them).
      if (k + 1 == count) part.tree = seq.tree;
      offset += seq.q_len * part_floats_per_token;
      out.work.push_back(part);
    }
  }
  return out;
}

// Batch-invariant mode (--deterministic), set per calling thread by
// set_batch_invariant around a model's step: every item is one query token
// of one KV head (qblock 1: M = G query vectors, so every item takes the
// same path whatever the step holds), no context parts and no all-heads
// items. A query token's output is then the same computation, tile by tile
// from position 0 to its own, whether it is a decode, one of a prompt
// chunk's tokens (after any cached prefix or chunk boundary), or one of a
// batch of any size. Costs the reuse of K/V rows across a query block's
// tokens.
thread_local bool t_batch_invariant = false;

void set_batch_invariant(bool on) { t_batch_invariant = on; }

template <typename scalar_t, typename qscalar_t, Path kPath>
void attend_all(Attend<scalar_t, qscalar_t, kPath> op, const std::vector<Seq>& all_seqs) {
  const int64_t kvh = op.kv_heads;
  const bool invariant = t_batch_invariant;
  std::vector<Item> items;
  int64_t long_blocks = 0;
  for (const Seq& seq : all_seqs) long_blocks += (std::max<int64_t>(seq.q_len, 1) + kLongQueryBlock - 1) / kLongQueryBlock;
  const int64_t qblock = invariant ? 1
      : long_blocks * kvh >= kMinItemsPerThread * at::get_num_threads() ? kLongQueryBlock : kQueryBlock;
  // KVFERRY_ATTN_SPLIT_CONTEXT=0: no context parts (tests and comparisons;
  // a draft tree's chunk still runs as a part of its own).
  const char* split_env = std::getenv("KVFERRY_ATTN_SPLIT_CONTEXT");
  const SplitWork split = split_contexts(
      all_seqs, qblock, op.block_size, op.num_heads * op.part_stride(),
      !invariant && !(split_env && split_env[0] == '0'),
      [&](int64_t j0, int64_t j1) { return op.all_heads_item(j0, j1) ? int64_t{1} : kvh; });
  const std::vector<Seq>& seqs = split.work;
  auto each_block = [&](auto fn) {
    for (int64_t s = 0; s < static_cast<int64_t>(seqs.size()); ++s) {
      for (int64_t j0 = 0; j0 < std::max<int64_t>(seqs[s].q_len, 1); j0 += qblock) fn(s, j0, std::min(j0 + qblock, seqs[s].q_len));
    }
  };
  int64_t all_heads_blocks = 0;
  each_block([&](int64_t, int64_t j0, int64_t j1) { all_heads_blocks += op.all_heads_item(j0, j1); });
  // KVFERRY_ATTN_ALL_HEADS_ITEMS=0: per-head items only (tests and comparisons).
  const char* env = all_heads_blocks ? std::getenv("KVFERRY_ATTN_ALL_HEADS_ITEMS") : nullptr;
  const bool all_heads = !invariant && all_heads_blocks >= kMinAllHeadsItemsPerThread * at::get_num_threads() &&
                         !(env && env[0] == '0');
  const char* staged_env = std::getenv("KVFERRY_ATTN_STAGED_AVX2");
  op.staged_avx2_enabled = !(staged_env && staged_env[0] == '0');
  each_block([&](int64_t s, int64_t j0, int64_t j1) {
    // Cost ~ context it reads x (its query tokens + the K/V read itself).
    const int64_t cost = seqs[s].end(j1) * (j1 - j0 + 1);
    if (all_heads && op.all_heads_item(j0, j1) && !seqs[s].tree) {
      items.push_back(Item{s, j0, j1, cost * kvh, kAllHeads});
    } else {
      for (int64_t h = 0; h < kvh; ++h) items.push_back(Item{s, j0, j1, cost, h});
    }
  });
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t count = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    typename Attend<scalar_t, qscalar_t, kPath>::Scratch w;
    for (int64_t worker = begin; worker < end; ++worker) {
      // Each thread claims its next item before running the current one and
      // requests that item's first rows, so that it does not start cold.
      for (int64_t item = next.fetch_add(1); item < count;) {
        const int64_t following = next.fetch_add(1);
        if (following < count) {
          const Item& f = items[following];
          if (f.head != kAllHeads) op.prefetch_first_rows(seqs[f.seq], f.head);
          else for (int64_t h = 0; h < kvh; ++h) op.prefetch_first_rows(seqs[f.seq], h);
        }
        const Item& b = items[item];
        if (b.head == kAllHeads) op.run_all_heads(seqs[b.seq], b.j0, b.j1, w);
        else op.run(seqs[b.seq], b.j0, b.j1, b.head, w);
        item = following;
      }
    }
  });
  std::vector<float> acc;
  for (const SplitWork::Split& s : split.splits) {
    op.combine_parts(all_seqs[s.seq], split.parts.data() + s.offset, s.count, acc);
  }
}

template <typename scalar_t, typename qscalar_t>
void dispatch_path(Path path, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const std::vector<Seq>& seqs, double scale, at::Tensor& out) {
  auto make = [&](auto tag) {
    using Op = Attend<scalar_t, qscalar_t, decltype(tag)::value>;
    Op op{q.data_ptr<qscalar_t>(), out.data_ptr<qscalar_t>(), k_cache.data_ptr<scalar_t>(),
          v_cache.data_ptr<scalar_t>(), q.stride(0), q.size(1), k_cache.size(2), q.size(2), q.size(1) / k_cache.size(2),
          k_cache.size(1), static_cast<float>(scale)};
    attend_all(op, seqs);
  };
  if constexpr (kHaveDpbf16 && std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<qscalar_t, at::BFloat16>) {
    if (path == Path::kDpbf16) return make(std::integral_constant<Path, Path::kDpbf16>{});
  }
  if constexpr (kHaveFp8Dpbf16 && kIsFp8<scalar_t> && std::is_same_v<qscalar_t, at::BFloat16>) {
    if (path == Path::kDpbf16) return make(std::integral_constant<Path, Path::kDpbf16>{});
  }
  if constexpr (kHaveAvx512) {
    if (path != Path::kPortable) return make(std::integral_constant<Path, Path::kWiden>{});
  }
  make(std::integral_constant<Path, Path::kPortable>{});
}

template <typename qscalar_t>
void dispatch_cache(Path path, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const std::vector<Seq>& seqs, double scale, at::Tensor& out) {
  switch (k_cache.scalar_type()) {
    case at::kFloat: return dispatch_path<float, qscalar_t>(path, q, k_cache, v_cache, block_tables, seqs, scale, out);
    case at::kBFloat16:
      return dispatch_path<at::BFloat16, qscalar_t>(path, q, k_cache, v_cache, block_tables, seqs, scale, out);
    case at::kHalf: return dispatch_path<at::Half, qscalar_t>(path, q, k_cache, v_cache, block_tables, seqs, scale, out);
    case at::kFloat8_e5m2:
      return dispatch_path<at::Float8_e5m2, qscalar_t>(path, q, k_cache, v_cache, block_tables, seqs, scale, out);
    case at::kFloat8_e4m3fn:
      return dispatch_path<at::Float8_e4m3fn, qscalar_t>(path, q, k_cache, v_cache, block_tables, seqs, scale, out);
    default: TORCH_CHECK(false, "unsupported cache dtype ", k_cache.scalar_type());
  }
}

// A bf16 query over a bf16 cache, or over an fp8 one (its rows converted
// to bf16 in registers: fp8_to_bf16), takes vdpbf16ps where the CPU has it.
bool takes_dpbf16(at::ScalarType q_dtype, at::ScalarType cache_dtype, int64_t head_dim) {
  if (head_dim % 32 != 0 || q_dtype != at::kBFloat16) return false;
  return (kHaveDpbf16 && cache_dtype == at::kBFloat16) ||
         (kHaveFp8Dpbf16 && (cache_dtype == at::kFloat8_e5m2 || cache_dtype == at::kFloat8_e4m3fn));
}

std::vector<int64_t> as_longs(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// q [T, H, D] (rows may be strided), out [T, H, D] contiguous (same dtype: float32 / bfloat16 / float16; out written in
// place, only the rows of the given sequences); k_cache, v_cache
// [num_blocks, block_size, KVH, D] float32 / bfloat16 / float16 / float8_e5m2 / float8_e4m3fn;
// block_tables [S, max_blocks] int64; seq_lens, query_starts, query_lens [S]
// int32 or int64.
constexpr int64_t kMaxTreeTokens = 64;  // one uint64 of ancestor bits per query token

void attend_paged(const at::Tensor& q_in, const at::Tensor& k_cache_in, const at::Tensor& v_cache_in,
                  const at::Tensor& block_tables_in, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                  const at::Tensor& query_lens, double scale, at::Tensor out, const at::Tensor* tree_masks) {
  TORCH_CHECK(q_in.device().is_cpu() && k_cache_in.device().is_cpu() && v_cache_in.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q_in.dim() == 3, "q must be [tokens, H, D]");
  TORCH_CHECK(out.sizes() == q_in.sizes() && out.scalar_type() == q_in.scalar_type() && out.is_contiguous(),
              "out must be a contiguous tensor of q's shape and dtype");
  TORCH_CHECK(k_cache_in.dim() == 4 && k_cache_in.sizes() == v_cache_in.sizes(),
              "k/v cache must be [blocks, block_size, KVH, D]");
  TORCH_CHECK(k_cache_in.scalar_type() == v_cache_in.scalar_type(), "k/v cache dtypes differ");
  TORCH_CHECK(k_cache_in.size(3) == q_in.size(2), "head_dim mismatch");
  TORCH_CHECK(q_in.size(1) % k_cache_in.size(2) == 0, "num_heads must be a multiple of kv_heads");
  const int64_t num_seqs = block_tables_in.size(0);
  TORCH_CHECK(block_tables_in.dim() == 2 && block_tables_in.scalar_type() == at::kLong,
              "block_tables must be [seqs, max_blocks] int64");
  TORCH_CHECK(seq_lens.numel() == num_seqs && query_starts.numel() == num_seqs && query_lens.numel() == num_seqs,
              "seq_lens, query_starts and query_lens must have one entry per block table row");
  // Token rows may be strided (q sliced from the fused qkv); heads and dims must be dense.
  const at::Tensor q = q_in.stride(2) == 1 && q_in.stride(1) == q_in.size(2) ? q_in : q_in.contiguous();
  const at::Tensor k_cache = k_cache_in.contiguous();  // views of the layer cache are already contiguous: no copy
  const at::Tensor v_cache = v_cache_in.contiguous();
  const at::Tensor block_tables = block_tables_in.contiguous();
  const std::vector<int64_t> lens = as_longs(seq_lens), starts = as_longs(query_starts), qlens = as_longs(query_lens);
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  const int64_t max_blocks = block_tables.size(1), tokens = q.size(0);
  // Validate everything the kernel will read or write, here on the calling
  // thread, so a bad table is an error rather than an out-of-bounds access.
  std::vector<Seq> seqs(num_seqs);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_seqs; ++r) {
    TORCH_CHECK(lens[r] >= 0 && lens[r] <= max_blocks * block_size, "seq_len ", lens[r], " of row ", r,
                " does not fit its block table");
    TORCH_CHECK(qlens[r] >= 0 && qlens[r] <= lens[r] && starts[r] >= 0 && starts[r] + qlens[r] <= tokens,
                "query rows of sequence ", r, " out of range");
    for (int64_t b = 0; b * block_size < lens[r]; ++b) {
      const int64_t id = bt[r * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " out of range in row ", r);
    }
    seqs[r] = Seq{starts[r], qlens[r], lens[r], bt + r * max_blocks};
  }
  // Draft trees: [S, 64] int64, row r all zeros for a causal sequence, else
  // entry j the bits of the chunk tokens query token j sees (bit j set, none
  // above it: a token's ancestors come before it, so limit() still bounds it).
  at::Tensor trees;
  if (tree_masks) {
    trees = tree_masks->contiguous();
    TORCH_CHECK(trees.scalar_type() == at::kLong && trees.dim() == 2 && trees.size(0) == num_seqs &&
                trees.size(1) == kMaxTreeTokens, "tree_masks must be [seqs, 64] int64");
    const int64_t* tm = trees.data_ptr<int64_t>();
    for (int64_t r = 0; r < num_seqs; ++r) {
      const int64_t* row = tm + r * kMaxTreeTokens;
      if (std::all_of(row, row + kMaxTreeTokens, [](int64_t b) { return b == 0; })) continue;
      TORCH_CHECK(qlens[r] <= kMaxTreeTokens, "a tree of ", qlens[r], " tokens in row ", r, " (at most 64)");
      for (int64_t j = 0; j < qlens[r]; ++j) {
        const uint64_t bits = static_cast<uint64_t>(row[j]);
        TORCH_CHECK(((bits >> j) & 1u) && (j == 63 || (bits >> j >> 1) == 0), "tree mask row ", j,
                    " of sequence ", r, " must set bit ", j, " and none above it");
      }
      seqs[r].tree = row;
    }
  }
  const int64_t head_dim = q.size(2);
  Path path = Path::kPortable;
  if (kHaveAvx512 && head_dim % 16 == 0) path = Path::kWiden;
  if (takes_dpbf16(q.scalar_type(), k_cache.scalar_type(), head_dim)) path = Path::kDpbf16;
  switch (q.scalar_type()) {
    case at::kFloat: return dispatch_cache<float>(path, q, k_cache, v_cache, block_tables, seqs, scale, out);
    case at::kBFloat16:
      return dispatch_cache<at::BFloat16>(path, q, k_cache, v_cache, block_tables, seqs, scale, out);
    case at::kHalf: return dispatch_cache<at::Half>(path, q, k_cache, v_cache, block_tables, seqs, scale, out);
    default: TORCH_CHECK(false, "unsupported query dtype ", q.scalar_type());
  }
}

// paged_attention with draft trees among the sequences (tree_masks
// [S, 64] int64, see there): its own op, so that paged_attention's schema
// (and decoder_layer.cpp's call of it) stays as it was.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, double scale, at::Tensor out) {
  attend_paged(q, k_cache, v_cache, block_tables, seq_lens, query_starts, query_lens, scale, out, nullptr);
}

void paged_attention_tree(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                          const at::Tensor& query_lens, double scale, at::Tensor out, const at::Tensor& tree_masks) {
  attend_paged(q, k_cache, v_cache, block_tables, seq_lens, query_starts, query_lens, scale, out, &tree_masks);
}

// Which dot-product path a call with these dtypes and head_dim takes (for
// tests and benchmark records): "dpbf16", "avx512" or "portable".
std::string kernel_path(at::ScalarType q_dtype, at::ScalarType cache_dtype, int64_t head_dim) {
  if (takes_dpbf16(q_dtype, cache_dtype, head_dim)) return "dpbf16";
  if (kHaveAvx512 && head_dim % 16 == 0) return "avx512";
  return "portable";
}

}  // namespace

// Registered as torch.ops.kvferry.*; no Python headers, so the build takes
// seconds rather than a minute.
TORCH_LIBRARY(kvferry, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_starts, Tensor query_lens, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
  m.def(
      "paged_attention_tree(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_starts, Tensor query_lens, float scale, Tensor(a!) out, Tensor tree_masks) -> ()");
  m.impl("paged_attention_tree", c10::DispatchKey::CPU, TORCH_FN(paged_attention_tree));
  m.def("paged_attention_path(ScalarType q_dtype, ScalarType cache_dtype, int head_dim) -> str",
        TORCH_FN(kernel_path));
  m.def("set_batch_invariant(bool on) -> ()", TORCH_FN(set_batch_invariant));
}
