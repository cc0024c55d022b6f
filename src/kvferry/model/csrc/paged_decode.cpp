// Paged attention for query tokens that each attend to a prefix of one
// request's paged KV cache (single-token decode; also short prefill chunks,
// one row per query token). CPU only; built at first use by paged_kernel.py.
//
// Layout (see attention.py): k_cache, v_cache [num_blocks, block_size, KVH, D];
// token p of row r lives in block block_tables[r][p / block_size] at offset
// p % block_size. Row r attends to positions 0 .. seq_lens[r]-1 and nothing else,
// so unwritten (possibly NaN) slots are never read.
//
// Work item = (row, kv_head): its G = H / KVH query heads stream over the
// row's blocks once (a block's K/V rows stay in L1 while the G heads use them).
// Per block and head: scores [n] = q . k * scale, then an online softmax update
// (running max m, running sum l, accumulator acc [D]) that rescales once per
// block rather than once per token.
//
// Two builds of the block primitives, chosen at compile time (-march=native):
// AVX-512 (16 lanes) reads float32 / bf16 / fp16 cache rows in place and
// widens them in registers (bf16 -> f32 is a 16-bit shift), for head_dim a
// multiple of 16; otherwise AVX2 (8 lanes, float rows; other cache dtypes are
// first converted into a per-thread float buffer) or portable loops.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <limits>
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
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0.f;
  for (int j = 0; j < 8; ++j) total += lanes[j];
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

// s[t] = (q . k_t) * scale, t < n; dim % 16 == 0. Four tokens at a time so
// that four independent FMA chains hide the FMA latency.
template <typename scalar_t>
void block_scores16(const float* __restrict q, const scalar_t* __restrict k, int64_t stride, int64_t n,
                    int64_t dim, float scale, float* __restrict s) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const scalar_t* k0 = k + t * stride;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      a0 = _mm512_fmadd_ps(load16(k0 + d), qv, a0);
      a1 = _mm512_fmadd_ps(load16(k0 + stride + d), qv, a1);
      a2 = _mm512_fmadd_ps(load16(k0 + 2 * stride + d), qv, a2);
      a3 = _mm512_fmadd_ps(load16(k0 + 3 * stride + d), qv, a3);
    }
    s[t] = _mm512_reduce_add_ps(a0) * scale;
    s[t + 1] = _mm512_reduce_add_ps(a1) * scale;
    s[t + 2] = _mm512_reduce_add_ps(a2) * scale;
    s[t + 3] = _mm512_reduce_add_ps(a3) * scale;
  }
  for (; t < n; ++t) {
    __m512 a0 = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) a0 = _mm512_fmadd_ps(load16(k + t * stride + d), _mm512_loadu_ps(q + d), a0);
    s[t] = _mm512_reduce_add_ps(a0) * scale;
  }
}

// acc [dim] += sum_t p[t] * v_t; dim % 16 == 0. 64 dims of acc stay in
// registers across the block's tokens.
template <typename scalar_t>
void block_accumulate16(float* __restrict acc, const float* __restrict p, const scalar_t* __restrict v,
                        int64_t stride, int64_t n, int64_t dim) {
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) {
    __m512 a0 = _mm512_loadu_ps(acc + d), a1 = _mm512_loadu_ps(acc + d + 16);
    __m512 a2 = _mm512_loadu_ps(acc + d + 32), a3 = _mm512_loadu_ps(acc + d + 48);
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
    __m512 a0 = _mm512_loadu_ps(acc + d);
    for (int64_t t = 0; t < n; ++t) a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), load16(v + t * stride + d), a0);
    _mm512_storeu_ps(acc + d, a0);
  }
}

#endif  // KVFERRY_AVX512

// Online softmax step for one head over one block: s [n] scores in, weights
// exp(s - m) out (in place); l and acc [dim] rescaled once to the new running max m.
inline void softmax_update(float* s, int64_t n, float& m, float& l, float* acc, int64_t dim) {
  const float block_max = *std::max_element(s, s + n);
  if (block_max > m) {
    const float alpha = std::exp(m - block_max);  // exp(-inf) = 0 on the first block
    l *= alpha;
    for (int64_t d = 0; d < dim; ++d) acc[d] *= alpha;
    m = block_max;
  }
  l += exp_sum(s, n, m);
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

// kDirect: the AVX-512 primitives read the cache rows in place (any dtype).
template <typename scalar_t, bool kDirect>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const std::vector<int64_t>& lens, double scale,
                          at::Tensor& out) {
  const int64_t rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = num_heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t row_stride = kv_heads * head_dim;        // between tokens of a block
  const int64_t block_stride = block_size * row_stride;  // between blocks
  const float* q_ptr = q.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const int64_t* bt_ptr = block_tables.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    // Per-thread scratch, reused across this chunk's work items.
    std::vector<float> acc(group * head_dim), scores(group * block_size), m(group), l(group);
    std::vector<float> kbuf(std::is_same_v<scalar_t, float> || kDirect ? 0 : block_size * head_dim);
    std::vector<float> vbuf(kbuf.size());
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[r];
      const float* qg = q_ptr + (r * num_heads + h * group) * head_dim;  // [G, D], head h*G + g
      float* og = out_ptr + (r * num_heads + h * group) * head_dim;      // [G, D]
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t* table = bt_ptr + r * max_blocks;
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);  // valid tokens of this block
        const int64_t base = table[start / block_size] * block_stride + h * head_dim;
#ifdef KVFERRY_AVX512
        if constexpr (kDirect) {
          for (int64_t g = 0; g < group; ++g) {
            float* s = scores.data() + g * block_size;
            float* a = acc.data() + g * head_dim;
            block_scores16(qg + g * head_dim, k_ptr + base, row_stride, n, head_dim, fscale, s);
            softmax_update(s, n, m[g], l[g], a, head_dim);
            block_accumulate16(a, s, v_ptr + base, row_stride, n, head_dim);
          }
          continue;
        }
#endif
        int64_t ks = 0, vs = 0;
        const float* kb = as_float(k_ptr + base, row_stride, n, head_dim, kbuf.data(), ks);  // [n, D] at stride ks
        const float* vb = as_float(v_ptr + base, row_stride, n, head_dim, vbuf.data(), vs);
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * block_size;
          float* a = acc.data() + g * head_dim;
          block_scores(qg + g * head_dim, kb, ks, n, head_dim, fscale, s);
          softmax_update(s, n, m[g], l[g], a, head_dim);
          block_accumulate(a, s, vb, vs, n, head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;  // len == 0: zeros, not NaN
        for (int64_t d = 0; d < head_dim; ++d) og[g * head_dim + d] = acc[g * head_dim + d] * inv;
      }
    }
  });
}

template <typename scalar_t>
void dispatch(bool direct, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& block_tables, const std::vector<int64_t>& lens, double scale, at::Tensor& out) {
  if (direct) {
    paged_attention_impl<scalar_t, kHaveAvx512>(q, k_cache, v_cache, block_tables, lens, scale, out);
  } else {
    paged_attention_impl<scalar_t, false>(q, k_cache, v_cache, block_tables, lens, scale, out);
  }
}

// q [rows, H, D] float32; k_cache, v_cache [num_blocks, block_size, KVH, D]
// float32 / bfloat16 / float16; block_tables [rows, max_blocks] int64;
// seq_lens [rows] int32 or int64. Returns [rows, H, D] float32.
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                           at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be [rows, H, D] float32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k/v cache must be [blocks, block_size, KVH, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k/v cache dtypes differ");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "head_dim mismatch");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  block_tables.scalar_type() == at::kLong, "block_tables must be [rows, max_blocks] int64");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0), "seq_lens must be [rows]");
  q = q.contiguous();
  k_cache = k_cache.contiguous();  // views of the layer cache are already contiguous: no copy
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  const at::Tensor lens_t = seq_lens.to(at::kLong).contiguous();
  const int64_t rows = q.size(0), block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  const int64_t max_blocks = block_tables.size(1);
  std::vector<int64_t> lens(lens_t.data_ptr<int64_t>(), lens_t.data_ptr<int64_t>() + rows);
  // Validate every block the kernel will read, here on the calling thread, so
  // a bad table is an error rather than an out-of-bounds read.
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens[r] >= 0 && lens[r] <= max_blocks * block_size, "seq_len ", lens[r], " of row ", r,
                " does not fit its block table");
    for (int64_t b = 0; b * block_size < lens[r]; ++b) {
      const int64_t id = bt[r * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " out of range in row ", r);
    }
  }
  at::Tensor out = at::empty_like(q);
  const bool direct = kHaveAvx512 && q.size(2) % 16 == 0;
  switch (k_cache.scalar_type()) {
    case at::kFloat: dispatch<float>(direct, q, k_cache, v_cache, block_tables, lens, scale, out); break;
    case at::kBFloat16: dispatch<at::BFloat16>(direct, q, k_cache, v_cache, block_tables, lens, scale, out); break;
    case at::kHalf: dispatch<at::Half>(direct, q, k_cache, v_cache, block_tables, lens, scale, out); break;
    default: TORCH_CHECK(false, "unsupported cache dtype ", k_cache.scalar_type());
  }
  return out;
}

}  // namespace

// Registered as torch.ops.kvferry.paged_attention; no Python headers, so the
// build takes seconds rather than a minute.
TORCH_LIBRARY(kvferry, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
