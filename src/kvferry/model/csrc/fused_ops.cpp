// Fused elementwise ops of the decoder layer, with HF's roundings.
//
// silu_and_mul(x) -> out
//   x:   [tokens, 2 * inter] (gate | up), the gate_up matmul's output; rows may be strided
//   out: [tokens, inter] contiguous, x's dtype
//   out = silu(gate) * up, rounded as HF's ``act_fn(gate_proj(x)) * up_proj(x)``:
//   silu in float32, rounded to the dtype, then the product in float32,
//   rounded again (a no-op in float32).
//
// rope_neox(x, cos, sin) -> out
//   x:        [tokens, heads, head_dim]; head_dim contiguous, other strides free
//   cos, sin: [tokens, head_dim / 2] contiguous, x's dtype (HF casts them so)
//   out:      [tokens, heads, head_dim] contiguous
//   rotate-half (NeoX) RoPE with HF's roundings, every product and sum
//   rounded to the dtype as torch's ops do:
//     out[:half] = r(r(x1 * cos) - r(x2 * sin)),  out[half:] = r(r(x2 * cos) + r(x1 * sin))
//   (HF's ``x * cos + rotate_half(x) * sin``; negation is exact). One op in
//   place of seven (chunk, four products, a sum, a difference, a cat).
//
// rms_norm(x, weight, eps) -> out
//   x:      [tokens, dim], rows contiguous (other strides free); weight [dim], x's dtype
//   out:    [tokens, dim] contiguous
//   HF's RMSNorm with its roundings: w * r((x * rsqrt(mean(x^2) + eps))) with
//   the normalization in float32 and the weight's product rounded again. The
//   mean of the float32 squares is summed in at::sum's own order (see
//   torch_order_row_sum), so every bit of the result is F.rms_norm's, in one
//   pass per row where torch's composite takes nine ops (two casts, pow,
//   sum, div, add, rsqrt, two products).
//
// add_rms_norm(x, residual, weight, eps) -> (h, out)
//   x, residual: [tokens, dim], rows contiguous; weight [dim]; all one dtype
//   h = residual + x (HF's residual add, rounded to the dtype) and out =
//   rms_norm(h, weight, eps), as above, the add in the same pass (the
//   decoder layer's residual add fused into the norm after it).
//
// write_kv(k, v, k_cache, v_cache, slots): the step's new K/V rows into
//   their cache slots (see the function); into an fp8 cache converted as
//   ``.to(torch.float8_e5m2)`` rounds, or saturated and rounded to e4m3.
//
// argmax_rows(x) -> [rows] int64: torch.argmax(x, dim=-1) for float32 rows
//   (greedy sampling over the vocabulary; see the function).
//
// silu_and_mul is one pass instead of two ops: torch reads the strided gate, writes silu's
// [tokens, inter] result, then reads it and up and writes the product.
// silu uses at::vec's exp (Sleef's u10 expf, the one torch's own silu kernel
// calls for this instruction set), so the values match torch's bit for bit,
// and it walks a row as torch's loops do (vectors by pairs, a scalar tail
// with std::exp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using at::vec::Vectorized;

// Rows per parallel task: at least ~16K elements each, so decode-sized
// batches stay on one thread (a fork costs more than the work).
int64_t grain_rows(int64_t inter) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, inter)); }

// a * b with a as the instruction's first source, so that where both are NaN
// the result is a's NaN, as in torch's mul kernel (silu(gate) * up): the
// compiler is free to commute a product, and with the operands in other
// registers it has picked up's NaN.
inline Vectorized<float> mul_in_order(const Vectorized<float>& a, const Vectorized<float>& b) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r;
  asm("vmulps %2, %1, %0" : "=v"(r) : "v"(static_cast<__m512>(a)), "v"(static_cast<__m512>(b)));
  return Vectorized<float>(r);
#else
  return a * b;
#endif
}

inline float silu_scalar(float g) { return g / (1.0f + std::exp(-g)); }

// Widening and rounding (to nearest even) between a reduced type and float,
// the conversions torch's own kernels use.
inline std::tuple<Vectorized<float>, Vectorized<float>> to_float(const Vectorized<at::BFloat16>& v) {
  return at::vec::convert_bfloat16_float(v);
}
inline std::tuple<Vectorized<float>, Vectorized<float>> to_float(const Vectorized<at::Half>& v) {
  return at::vec::convert_half_float(v);
}
template <typename T>
Vectorized<T> from_float(const Vectorized<float>& a, const Vectorized<float>& b);
template <>
Vectorized<at::BFloat16> from_float<at::BFloat16>(const Vectorized<float>& a, const Vectorized<float>& b) {
  return at::vec::convert_float_bfloat16(a, b);
}
template <>
Vectorized<at::Half> from_float<at::Half>(const Vectorized<float>& a, const Vectorized<float>& b) {
  return at::vec::convert_float_half(a, b);
}

#if defined(CPU_CAPABILITY_AVX512)
// bf16 kept in float32 lanes: rounding to nearest even is integer arithmetic
// on each lane's bits (torch's own rounding, c10::round_to_nearest_even),
// without packing to 16 bits and widening back, which at::vec's
// conversions do in about four times the instructions. NaN lanes become
// 0xFFFF, as at::vec's conversion makes them.
constexpr bool kLaneBf16 = true;
#if defined(__AVX512BF16__)
// The rounding in one instruction where the CPU has it: vcvtneps2bf16
// rounds to nearest even as torch does, but treats subnormal inputs as zero
// and keeps NaN's payload (torch makes NaN 0xFFFF). A vector with a lane of
// either class (one fpclass test: quiet NaN 0x01, subnormal 0x20,
// signalling NaN 0x80; a predicted branch) takes the integer way below;
// otherwise this saves four to six of the integer way's instructions per
// rounding, in every op here.
inline bool bf16_plain(__m512 v) { return _mm512_fpclass_ps_mask(v, 0xA1) == 0; }
inline __m512 bf16_widen(__m256bh b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i&>(b)), 16));
}
#endif
inline __m512 bf16_round_lanes_int(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                                           _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 ordered = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(-65536), rounded));
}
inline __m512 bf16_round_lanes(__m512 v) {
#if defined(__AVX512BF16__)
  if (__builtin_expect(bf16_plain(v), 1)) return bf16_widen(_mm512_cvtneps_pbh(v));
#endif
  return bf16_round_lanes_int(v);
}
inline __m512 bf16_load_lanes(const at::BFloat16* p) {  // 16 bf16 -> 16 floats
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// Lanes already bf16 values (bf16_round_lanes' results): each lane's top 16 bits.
inline void bf16_store_rounded_lanes(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
inline void bf16_store_lanes(at::BFloat16* p, __m512 v) {  // rounds, then keeps each lane's top 16 bits
#if defined(__AVX512BF16__)
  if (__builtin_expect(bf16_plain(v), 1)) {
    const __m256bh b = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(b));
    return;
  }
#endif
  bf16_store_rounded_lanes(p, bf16_round_lanes_int(v));
}

// silu(g) = g / (1 + exp(-g)) with at::vec's exp (Sleef's u10 expf, torch's
// own; neg() flips the sign bit), as torch's kernel computes it. The
// division stays: g / (1 + e) must be correctly rounded, as torch's is.
// (Inlining Sleef's instructions, so that the call through the PLT spills no
// live vectors, took a further ~8% off bf16 silu_and_mul at [1024, 3072] and
// ~5% off float32 in cache: not kept, a copy of the library's code to keep
// in step with it for that little.)
inline __m512 silu_lanes(__m512 g) {
  const Vectorized<float> gv(g);
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), gv.neg().exp()));
}
inline Vectorized<float> silu_vec(const Vectorized<float>& g) { return Vectorized<float>(silu_lanes(g)); }
#else
constexpr bool kLaneBf16 = false;
#endif
#if !defined(CPU_CAPABILITY_AVX512)
inline Vectorized<float> silu_vec(const Vectorized<float>& g) { return g / (Vectorized<float>(1.0f) + g.neg().exp()); }
#endif

// r(x) for a float vector: round to T and widen back (a no-op for float).
template <typename T>
inline Vectorized<float> round_to(const Vectorized<float>& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
#if defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return Vectorized<float>(bf16_round_lanes(v));
#endif
  } else {
    // Vectorized<T> holds two float vectors' worth; only the low half is used.
    return std::get<0>(to_float(from_float<T>(v, v)));
  }
}

template <typename T>
inline float round_scalar(float v) { return static_cast<float>(static_cast<T>(v)); }

template <typename T>
inline Vectorized<float> load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vectorized<float>::loadu(p);
#if defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return Vectorized<float>(bf16_load_lanes(p));
#endif
  } else {
    // Read only size() elements of T (not a whole Vectorized<T>): a row may end here.
    return std::get<0>(to_float(Vectorized<T>::loadu(p, Vectorized<float>::size())));
  }
}

// store_float for v already rounded to T (round_to's result): no second rounding.
template <typename T>
inline void store_rounded(T* p, const Vectorized<float>& v);

template <typename T>
inline void store_float(T* p, const Vectorized<float>& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
#if defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    bf16_store_lanes(p, v);
#endif
  } else {
    from_float<T>(v, v).store(p, Vectorized<float>::size());
  }
}

template <typename T>
inline void store_rounded(T* p, const Vectorized<float>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    bf16_store_rounded_lanes(p, v);
    return;
  }
#endif
  store_float(p, v);
}

void silu_and_mul_float(const float* x, float* out, int64_t rows, int64_t inter, int64_t x_stride) {
  using fVec = Vectorized<float>;
  at::parallel_for(0, rows, grain_rows(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = x + r * x_stride;
      const float* u = g + inter;
      float* o = out + r * inter;
      int64_t i = 0;
      // Vectors by pairs and the rest by scalars, as torch's vectorized_loop
      // goes over a row: a tail of one to two vectors' worth taken by vectors
      // here (inter % 32 in 16..31 for AVX512) gave Sleef's exp where torch's
      // silu takes std::exp, off by an ulp at times (not at inter 1536).
      for (; i + 2 * fVec::size() <= inter; i += 2 * fVec::size()) {
        const fVec s0 = silu_vec(fVec::loadu(g + i)), s1 = silu_vec(fVec::loadu(g + i + fVec::size()));
        mul_in_order(s0, fVec::loadu(u + i)).store(o + i);
        mul_in_order(s1, fVec::loadu(u + i + fVec::size())).store(o + i + fVec::size());
      }
      for (; i < inter; ++i) o[i] = silu_scalar(g[i]) * u[i];
    }
  });
}

#if defined(CPU_CAPABILITY_AVX512)
// 32 elements of silu_and_mul for bf16, all in float lanes.
inline void silu_and_mul_bf16_32(const at::BFloat16* g, const at::BFloat16* u, at::BFloat16* o) {
  const __m512 g0 = bf16_load_lanes(g), g1 = bf16_load_lanes(g + 16);
  const __m512 u0 = bf16_load_lanes(u), u1 = bf16_load_lanes(u + 16);
  const __m512 s0 = silu_lanes(g0), s1 = silu_lanes(g1);
#if defined(__AVX512BF16__)
  // (bf16_round_lanes and bf16_store_lanes' fast way, with one branch for
  // the block's four roundings.)
  if (__builtin_expect(bf16_plain(s0) && bf16_plain(s1), 1)) {
    const __m512 p0 = _mm512_mul_ps(bf16_widen(_mm512_cvtneps_pbh(s0)), u0);
    const __m512 p1 = _mm512_mul_ps(bf16_widen(_mm512_cvtneps_pbh(s1)), u1);
    if (__builtin_expect(bf16_plain(p0) && bf16_plain(p1), 1)) {
      const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);  // p0 in the low half
      _mm512_storeu_si512(o, reinterpret_cast<const __m512i&>(pb));
      return;
    }
  }
#endif
  bf16_store_lanes(o, _mm512_mul_ps(bf16_round_lanes_int(s0), u0));
  bf16_store_lanes(o + 16, _mm512_mul_ps(bf16_round_lanes_int(s1), u1));
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kVecBf16NanFFFF = true;  // at::vec's float -> bf16 conversion
#else
constexpr bool kVecBf16NanFFFF = false;
#endif

template <typename T>  // at::BFloat16 or at::Half
void silu_and_mul_reduced(const T* x, T* out, int64_t rows, int64_t inter, int64_t x_stride) {
  using rVec = Vectorized<T>;
  using fVec = Vectorized<float>;
  at::parallel_for(0, rows, grain_rows(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * x_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      // Pairs of vectors, the rest by scalars: torch's step (see silu_and_mul_float).
      const int64_t vec_end = inter - inter % (2 * rVec::size());
      int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        for (; i < vec_end; i += 32) silu_and_mul_bf16_32(g + i, u + i, o + i);
      }
#endif
      for (; i < vec_end; i += rVec::size()) {
        auto [g0, g1] = to_float(rVec::loadu(g + i));
        auto [u0, u1] = to_float(rVec::loadu(u + i));
        // silu rounded to T, as torch's silu returns it ...
        fVec s0 = silu_vec(g0), s1 = silu_vec(g1);
        if constexpr (kLaneBf16 && std::is_same_v<T, at::BFloat16>) {
          s0 = round_to<T>(s0);
          s1 = round_to<T>(s1);
        } else {
          std::tie(s0, s1) = to_float(from_float<T>(s0, s1));
        }
        // ... then the product in float, rounded once more.
        from_float<T>(mul_in_order(s0, u0), mul_in_order(s1, u1)).store(o + i);
      }
      // torch's mul steps by single vectors, so up to rVec::size() - 1 of
      // these products were rounded by a vector, which makes every bf16 NaN
      // 0xFFFF (a scalar conversion makes it 0x7FC0).
      const int64_t mul_vec_end = inter - inter % rVec::size();
      for (; i < inter; ++i) {
        const float s = static_cast<float>(static_cast<T>(silu_scalar(static_cast<float>(g[i]))));
        const float p = s * static_cast<float>(u[i]);
        if (kVecBf16NanFFFF && std::is_same_v<T, at::BFloat16> && i < mul_vec_end && std::isnan(p)) {
          o[i] = c10::bit_cast<T>(uint16_t{0xFFFF});
        } else {
          o[i] = static_cast<T>(p);
        }
      }
    }
  });
}

template <typename T>
void rope_rows(const at::Tensor& x, const T* cos, const T* sin, T* out) {
  using fVec = Vectorized<float>;
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  const T* xp = x.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, heads * dim));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x1 = xp + t * st + h * sh;
        const T* x2 = x1 + half;
        T* o1 = out + (t * heads + h) * dim;
        T* o2 = o1 + half;
        int64_t i = 0;
        for (; i + fVec::size() <= half; i += fVec::size()) {
          const fVec a = load_float(x1 + i), b = load_float(x2 + i);
          const fVec cv = load_float(c + i), sv = load_float(s + i);
          // (store_float rounds the sum; the round_to<T> that wrapped it before was
          // a second rounding of a rounded value: an exact no-op, paid for.)
          store_float(o1 + i, round_to<T>(a * cv) - round_to<T>(b * sv));
          store_float(o2 + i, round_to<T>(b * cv) + round_to<T>(a * sv));
        }
        for (; i < half; ++i) {
          const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
          const float cv = static_cast<float>(c[i]), sv = static_cast<float>(s[i]);
          o1[i] = static_cast<T>(round_scalar<T>(a * cv) - round_scalar<T>(b * sv));
          o2[i] = static_cast<T>(round_scalar<T>(b * cv) + round_scalar<T>(a * sv));
        }
      }
    }
  });
}

// Into out (contiguous, x's sizes and dtype): the one-call decoder layer's
// workspace, reused by every layer of a step (no allocation per op).
void rope_neox_out(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor out) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1,
              "rope_neox: x must be [tokens, heads, head_dim] with contiguous rows, got ", x.sizes());
  const int64_t half = x.size(2) / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == half && t->is_contiguous() &&
                    t->scalar_type() == x.scalar_type(),
                "rope_neox: cos and sin must be contiguous [tokens, head_dim / 2] of x's dtype, got ", t->sizes());
  }
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "rope_neox: out must be contiguous, of x's sizes and dtype");
  if (x.numel() == 0) return;
  switch (x.scalar_type()) {
    case at::kFloat:
      rope_rows<float>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>());
      break;
    case at::kBFloat16:
      rope_rows<at::BFloat16>(x, cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
                              out.data_ptr<at::BFloat16>());
      break;
    case at::kHalf:
      rope_rows<at::Half>(x, cos.data_ptr<at::Half>(), sin.data_ptr<at::Half>(), out.data_ptr<at::Half>());
      break;
    default:
      TORCH_CHECK(false, "rope_neox: unsupported dtype ", x.scalar_type());
  }
}

at::Tensor rope_neox(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rope_neox_out(x, cos, sin, out);
  return out;
}

// Into out (contiguous [tokens, inter] of x's dtype), as rope_neox_out.
void silu_and_mul_out(const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [tokens, 2 * inter], got ", x.sizes());
  TORCH_CHECK(x.stride(1) == 1, "silu_and_mul: x's rows must be contiguous");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == inter && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(),
              "silu_and_mul: out must be contiguous [tokens, inter] of x's dtype");
  if (rows == 0) return;
  switch (x.scalar_type()) {
    case at::kFloat:
      silu_and_mul_float(x.data_ptr<float>(), out.data_ptr<float>(), rows, inter, x.stride(0));
      break;
    case at::kBFloat16:
      silu_and_mul_reduced(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, inter, x.stride(0));
      break;
    case at::kHalf:
      silu_and_mul_reduced(x.data_ptr<at::Half>(), out.data_ptr<at::Half>(), rows, inter, x.stride(0));
      break;
    default:
      TORCH_CHECK(false, "silu_and_mul: unsupported dtype ", x.scalar_type());
  }
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [tokens, 2 * inter], got ", x.sizes());
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  silu_and_mul_out(x, out);
  return out;
}

// ---- RMSNorm: the mean of the squares in torch's own summation order ----
//
// F.rms_norm's mean is at::sum over the row's float32 squares, then a
// division by dim. Its CPU kernel (built for AVX2 and AVX512 alike with
// 8-float vectors) adds the row's 8-float vectors lane-wise into 4
// interleaved accumulators (vector 4i + k into accumulator k), each a
// cascade of 4 levels: every 2^p rows of 4 vectors (p = max(4,
// ceil_log2(rows) / 4)) level 0 is added into level 1, and so on up while
// the row count is a multiple of the next level's span. Then the levels are
// added up, the leftover vectors into accumulator 0, accumulators 1-3 into
// it, and the scalar tail and the 8 lanes, in order, into a float that
// starts at 0. Summing in that order here, per row in one pass with the
// squares kept in cache, is every bit of at::mean, where calling it took
// three ops (sum, a scalar tensor, div_) and a [tokens, dim] squares tensor:
// about half of the op's time at decode sizes. test_fused_ops compares the
// result with F.rms_norm bit for bit over many dims; rows this order does not
// cover (fewer than 8 floats, where torch sums by scalars, or builds without
// AVX2) still take at::mean.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kOwnRowSum = true;
#else
constexpr bool kOwnRowSum = false;
#endif
constexpr int64_t kOwnRowSumMinDim = 8;
// Beyond this a single row may be split across threads by at::sum, which changes its order.
constexpr int64_t kOwnRowSumMaxDim = 16384;

struct Lanes8 {
  float v[8];
};
inline void add_lanes(Lanes8& a, const float* x) {
  for (int e = 0; e < 8; ++e) a.v[e] += x[e];
}
inline void add_lanes(Lanes8& a, const Lanes8& b) { add_lanes(a, b.v); }

inline int64_t ceil_log2(int64_t x) {
  return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<unsigned long long>(x - 1));
}

float torch_order_row_sum(const float* x, int64_t n) {
  constexpr int kLevels = 4, kChains = 4;
  const int64_t vectors = n / 8, rows = vectors / kChains;
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / kLevels);
  const int64_t span = int64_t{1} << power, span_mask = span - 1;
  Lanes8 acc[kLevels][kChains] = {};
  auto add_row = [&](int64_t i) {
    for (int k = 0; k < kChains; ++k) add_lanes(acc[0][k], x + (i * kChains + k) * 8);
  };
  int64_t i = 0;
  while (i + span <= rows) {
    for (int64_t j = 0; j < span; ++j, ++i) add_row(i);
    for (int l = 1; l < kLevels; ++l) {
      for (int k = 0; k < kChains; ++k) {
        add_lanes(acc[l][k], acc[l - 1][k]);
        acc[l - 1][k] = Lanes8{};
      }
      if ((i & (span_mask << (l * power))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int l = 1; l < kLevels; ++l)
    for (int k = 0; k < kChains; ++k) add_lanes(acc[0][k], acc[l][k]);
  Lanes8 total = acc[0][0];
  for (int64_t v = rows * kChains; v < vectors; ++v) add_lanes(total, x + v * 8);
  for (int k = 1; k < kChains; ++k) add_lanes(total, acc[0][k]);
  float sum = 0.f;
  for (int64_t t = vectors * 8; t < n; ++t) sum += x[t];
  for (int e = 0; e < 8; ++e) sum += total.v[e];
  return sum;
}

inline bool own_row_sum(int64_t dim) { return kOwnRowSum && dim >= kOwnRowSumMinDim && dim <= kOwnRowSumMaxDim; }

// One row's float32 squares of xr into sq (pow(x, 2) is x * x in torch).
template <typename T>
inline void square_row(const T* xr, float* sq, int64_t dim) {
  using fVec = Vectorized<float>;
  int64_t i = 0;
  for (; i + fVec::size() <= dim; i += fVec::size()) {
    const fVec v = load_float(xr + i);
    (v * v).store(sq + i);
  }
  for (; i < dim; ++i) {
    const float v = static_cast<float>(xr[i]);
    sq[i] = v * v;
  }
}

// h = r(residual + x) (torch's add: in float32, rounded to T) and its float32 squares, one row.
template <typename T>
inline void add_square_row(const T* xr, const T* rr, T* hr, float* sq, int64_t dim) {
  using fVec = Vectorized<float>;
  int64_t i = 0;
  for (; i + fVec::size() <= dim; i += fVec::size()) {
    const fVec v = round_to<T>(load_float(rr + i) + load_float(xr + i));
    store_rounded(hr + i, v);
    (v * v).store(sq + i);
  }
  for (; i < dim; ++i) {
    const float v = round_scalar<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
    hr[i] = static_cast<T>(v);
    sq[i] = v * v;
  }
}

// out = w * r(x * rsqrt(var + eps)), one row.
template <typename T>
inline void normalize_row(const T* xr, const T* w, float var, float eps, T* o, int64_t dim) {
  using fVec = Vectorized<float>;
  // torch's rsqrt: a correctly rounded sqrt, then a correctly rounded 1 / it.
  const float rstd = 1.0f / std::sqrt(var + eps);
  const fVec rv(rstd);
  int64_t i = 0;
  for (; i + fVec::size() <= dim; i += fVec::size()) {
    const fVec normed = round_to<T>(load_float(xr + i) * rv);  // .to(dtype)
    store_float(o + i, load_float(w + i) * normed);            // weight * it, rounded once more
  }
  for (; i < dim; ++i) {
    const float normed = round_scalar<T>(static_cast<float>(xr[i]) * rstd);
    o[i] = static_cast<T>(static_cast<float>(w[i]) * normed);
  }
}

// The norm of `rows` rows of `src` (x, or h after the residual add): with
// our own row sum in one pass per row, the squares in a per-task buffer;
// otherwise the squares of every row, at::mean over them, and a second pass.
// square(r, sq) writes row r's squares (and h for add_rms_norm).
template <typename T, typename SquareRow>
void norm_rows(const T* src, int64_t src_stride, const T* w, float eps, T* out, int64_t rows, int64_t dim,
               const at::TensorOptions& options, SquareRow square) {
  if (own_row_sum(dim)) {
    at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
      std::vector<float> sq(dim);
      for (int64_t r = begin; r < end; ++r) {
        square(r, sq.data());
        const float var = torch_order_row_sum(sq.data(), dim) / static_cast<float>(dim);
        normalize_row<T>(src + r * src_stride, w, var, eps, out + r * dim, dim);
      }
    });
    return;
  }
  at::Tensor sq = at::empty({rows, dim}, options.dtype(at::kFloat));
  float* sqp = sq.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) square(r, sqp + r * dim);
  });
  const at::Tensor var = at::mean(sq, {1}).contiguous();  // torch's reduction, bit for bit
  const float* vp = var.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row<T>(src + r * src_stride, w, vp[r], eps, out + r * dim, dim);
  });
}

template <typename T>
void add_rms_norm_typed(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                        const at::Tensor& h, const at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1);
  if (rows == 0) return;
  const T* xp = x.data_ptr<T>();
  const T* rp = residual.data_ptr<T>();
  T* hp = h.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  norm_rows<T>(hp, dim, weight.data_ptr<T>(), static_cast<float>(eps), out.data_ptr<T>(), rows, dim, x.options(),
               [&](int64_t r, float* sq) { add_square_row<T>(xp + r * xs, rp + r * rs, hp + r * dim, sq, dim); });
}

template <typename T>
at::Tensor rms_norm_typed(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  at::Tensor out = at::empty({rows, dim}, x.options());
  if (rows == 0) return out;
  const T* xp = x.data_ptr<T>();
  const int64_t xs = x.stride(0);
  norm_rows<T>(xp, xs, weight.data_ptr<T>(), static_cast<float>(eps), out.data_ptr<T>(), rows, dim, x.options(),
               [&](int64_t r, float* sq) { square_row<T>(xp + r * xs, sq, dim); });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [tokens, dim] with contiguous rows, got ",
              x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be contiguous [dim] of x's dtype");
  switch (x.scalar_type()) {
    case at::kFloat:
      return rms_norm_typed<float>(x, weight, eps);
    case at::kBFloat16:
      return rms_norm_typed<at::BFloat16>(x, weight, eps);
    case at::kHalf:
      return rms_norm_typed<at::Half>(x, weight, eps);
    default:
      TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
}

// Into h_out and out (contiguous [tokens, dim] of x's dtype, neither an input),
// as rope_neox_out.
void add_rms_norm_out(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                      at::Tensor h_out, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.dim() == 2 && residual.stride(1) == 1 &&
                  residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and residual must be [tokens, dim] of one dtype with contiguous rows, got ", x.sizes(),
              " and ", residual.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be contiguous [dim] of x's dtype");
  for (const at::Tensor* t : {&h_out, &out}) {
    TORCH_CHECK(t->sizes() == x.sizes() && t->is_contiguous() && t->scalar_type() == x.scalar_type(),
                "add_rms_norm: the outputs must be contiguous [tokens, dim] of x's dtype");
  }
  switch (x.scalar_type()) {
    case at::kFloat:
      return add_rms_norm_typed<float>(x, residual, weight, eps, h_out, out);
    case at::kBFloat16:
      return add_rms_norm_typed<at::BFloat16>(x, residual, weight, eps, h_out, out);
    case at::kHalf:
      return add_rms_norm_typed<at::Half>(x, residual, weight, eps, h_out, out);
    default:
      TORCH_CHECK(false, "add_rms_norm: unsupported dtype ", x.scalar_type());
  }
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  at::Tensor h = at::empty(x.sizes(), x.options());
  at::Tensor out = at::empty(x.sizes(), x.options());
  add_rms_norm_out(x, residual, weight, eps, h, out);
  return {h, out};
}

// float -> float8_e5m2 bits, bit for bit c10::Float8_e5m2(float) (what
// ``.to(torch.float8_e5m2)`` computes): round to nearest even, magnitudes
// from 61440 (57344 + half its ulp) up to inf become inf (0x7C), NaN 0x7F,
// the sign kept. The vector versions are c10's integer arithmetic per
// 32-bit lane (at::vec's own AVX-512 conversion is the same): below 2^-14,
// |x| + 128.0f lands on a multiple of 2^-16 (the subnormal step), rounded
// by the FPU to nearest even, and its low mantissa bits are the result;
// above, the exponent is rebiased and the 21 dropped bits rounded to
// nearest even by adding 0xFFFFF plus the kept bit. Rounding to fp16 first
// (vcvtps2ph) and then to the top byte would round twice: a float just
// above an e5m2 tie can land on the tie in fp16 and then go to even, down.
inline uint8_t fp8e5m2_bits(float f) { return c10::Float8_e5m2(f).x; }

#if defined(CPU_CAPABILITY_AVX512)
inline __m128i fp8e5m2_from_lanes(__m512 x) {  // 16 floats -> 16 bytes
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i a = _mm512_xor_si512(bits, sign);  // |x|
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 21), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_set1_epi32(static_cast<int>((uint32_t(15 - 127) << 23) + 0xFFFFF));  // rebias, round
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, bias), odd), 21);
  const __m512i denorm = _mm512_set1_epi32(134 << 23);  // 128.0f
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm))), denorm);
  r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(113 << 23)), sub);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(143 << 23)), _mm512_set1_epi32(0x7C));
  r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(r, _mm512_srli_epi32(sign, 24)));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline uint64_t fp8e5m2_from_lanes(__m256 x) {  // 8 floats -> 8 bytes
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i a = _mm256_xor_si256(bits, sign);  // |x|: below 2^31, so signed compares order it
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 21), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_set1_epi32(static_cast<int>((uint32_t(15 - 127) << 23) + 0xFFFFF));  // rebias, round
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, bias), odd), 21);
  const __m256i denorm = _mm256_set1_epi32(134 << 23);  // 128.0f
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm))), denorm);
  r = _mm256_blendv_epi8(r, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(113 << 23), a));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7C), _mm256_cmpgt_epi32(a, _mm256_set1_epi32((143 << 23) - 1)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
  r = _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
  // The low byte of each lane, in order.
  const __m256i packed = _mm256_shuffle_epi8(r, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                 -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                 -1, -1, -1, -1));
  return static_cast<uint32_t>(_mm256_extract_epi32(packed, 0)) |
         (static_cast<uint64_t>(static_cast<uint32_t>(_mm256_extract_epi32(packed, 4))) << 32);
}
#endif

// float -> float8_e4m3fn bits, saturating: c10::Float8_e4m3fn(clamp(f,
// -448, 448)), NaN kept (0x7F, signed): what vLLM's fp8 cache writes, where
// ``.to(torch.float8_e4m3fn)`` alone would turn |f| >= 480 (inf included)
// into NaN. The vector versions are c10's integer arithmetic per lane on
// the clamped |x|: below 2^-6, |x| + 16384.0f lands on a multiple of 2^-9 (the
// subnormal step), rounded to nearest even by the FPU, and its low bits are
// the result; above, the exponent is rebiased and the 20 dropped bits
// rounded to nearest even by adding 0x7FFFF plus the kept bit.
inline uint8_t fp8e4m3_bits(float f) {
  if (!std::isnan(f)) f = std::min(std::max(f, -448.0f), 448.0f);
  return c10::Float8_e4m3fn(f).x;
}

#if defined(CPU_CAPABILITY_AVX512)
inline __m128i fp8e4m3_from_lanes(__m512 x) {  // 16 floats -> 16 bytes
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i abs = _mm512_xor_si512(bits, sign);
  const __m512i a = _mm512_min_epu32(abs, _mm512_set1_epi32(0x43E00000));  // 448.0f
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_set1_epi32(static_cast<int>((uint32_t(7 - 127) << 23) + 0x7FFFF));  // rebias, round
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, bias), odd), 20);
  const __m512i denorm = _mm512_set1_epi32(141 << 23);  // 16384.0f: its ulp is 2^-9
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm))), denorm);
  r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23)), sub);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(r, _mm512_srli_epi32(sign, 24)));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline uint64_t fp8e4m3_from_lanes(__m256 x) {  // 8 floats -> 8 bytes
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i abs = _mm256_xor_si256(bits, sign);  // below 2^31, so signed compares order it
  const __m256i a = _mm256_min_epu32(abs, _mm256_set1_epi32(0x43E00000));  // 448.0f
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_set1_epi32(static_cast<int>((uint32_t(7 - 127) << 23) + 0x7FFFF));  // rebias, round
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, bias), odd), 20);
  const __m256i denorm = _mm256_set1_epi32(141 << 23);  // 16384.0f: its ulp is 2^-9
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm))), denorm);
  r = _mm256_blendv_epi8(r, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), a));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F800000)));
  r = _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
  const __m256i packed = _mm256_shuffle_epi8(r, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                 -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                 -1, -1, -1, -1));
  return static_cast<uint32_t>(_mm256_extract_epi32(packed, 0)) |
         (static_cast<uint64_t>(static_cast<uint32_t>(_mm256_extract_epi32(packed, 4))) << 32);
}
#endif

// One fp8 format's conversions, for row_to_fp8.
struct E5m2 {
  static uint8_t bits(float f) { return fp8e5m2_bits(f); }
#if defined(CPU_CAPABILITY_AVX512)
  static __m128i lanes(__m512 x) { return fp8e5m2_from_lanes(x); }
#elif defined(CPU_CAPABILITY_AVX2)
  static uint64_t lanes(__m256 x) { return fp8e5m2_from_lanes(x); }
#endif
};
struct E4m3 {
  static uint8_t bits(float f) { return fp8e4m3_bits(f); }
#if defined(CPU_CAPABILITY_AVX512)
  static __m128i lanes(__m512 x) { return fp8e4m3_from_lanes(x); }
#elif defined(CPU_CAPABILITY_AVX2)
  static uint64_t lanes(__m256 x) { return fp8e4m3_from_lanes(x); }
#endif
};

// n elements of a float32 or bf16 row -> fp8 bytes of format F (E5m2, E4m3).
template <typename F, typename T>
void row_to_fp8(const T* src, uint8_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= n; i += 16) {
    __m512 x;
    if constexpr (std::is_same_v<T, float>) x = _mm512_loadu_ps(src + i);
    else x = bf16_load_lanes(src + i);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), F::lanes(x));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= n; i += 8) {
    __m256 x;
    if constexpr (std::is_same_v<T, float>) {
      x = _mm256_loadu_ps(src + i);
    } else {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
    const uint64_t bytes = F::lanes(x);
    std::memcpy(dst + i, &bytes, 8);
  }
#endif
  for (; i < n; ++i) dst[i] = F::bits(static_cast<float>(src[i]));
}

// k, v [tokens, KVH, D] (each token's heads dense; token strides free, as
// slices of the fused qkv output are); k_cache, v_cache [slots, KVH, D]
// contiguous, of k's dtype, or float8_e5m2 / float8_e4m3fn with k, v bf16
// or float32 (the --kv-cache-dtype fp8 caches: each element rounded as
// ``.to(torch.float8_e5m2)`` does, or clamped to +-448 and rounded as
// ``.to(torch.float8_e4m3fn)`` does); slots [tokens] int64. Row t of k and v goes
// to slot slots[t]: one copy (or conversion) of KVH * D elements per token
// and tensor, where index_copy_ takes ~5x as long for the step's 2048 rows
// of 3 x 64 bf16.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots_in) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() &&
                  k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2),
              "write_kv: k, v must be [tokens, KVH, D] and the caches [slots, KVH, D], got ", k.sizes(), " and ",
              k_cache.sizes());
  const at::ScalarType cache_dtype = k_cache.scalar_type();
  const bool to_fp8 = (cache_dtype == at::kFloat8_e5m2 || cache_dtype == at::kFloat8_e4m3fn) &&
                      v_cache.scalar_type() == cache_dtype && v.scalar_type() == k.scalar_type() &&
                      (k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat);
  TORCH_CHECK(to_fp8 || (k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                         v_cache.scalar_type() == k.scalar_type()),
              "write_kv: k, v and the caches must share one dtype");
  const int64_t row = k.size(1) * k.size(2);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "write_kv: each token's heads must be dense");
  }
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: the caches must be contiguous");
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0), "write_kv: one slot per token");
  const int64_t tokens = k.size(0), num_slots = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "write_kv: slot ", sp[t], " out of range for ", num_slots, " slots");
  }
  const int64_t bytes = row * static_cast<int64_t>(k.element_size());  // of a source row
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 2 * bytes));
  if (to_fp8) {
    auto convert = [&](auto tag, auto format) {
      using T = decltype(tag);
      using F = decltype(format);
      auto* kc8 = reinterpret_cast<uint8_t*>(kc);
      auto* vc8 = reinterpret_cast<uint8_t*>(vc);
      at::parallel_for(0, tokens, grain, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          row_to_fp8<F>(reinterpret_cast<const T*>(kp + t * ks), kc8 + sp[t] * row, row);
          row_to_fp8<F>(reinterpret_cast<const T*>(vp + t * vs), vc8 + sp[t] * row, row);
        }
      });
    };
    const bool e4m3 = cache_dtype == at::kFloat8_e4m3fn;
    if (k.scalar_type() == at::kFloat) e4m3 ? convert(float{}, E4m3{}) : convert(float{}, E5m2{});
    else e4m3 ? convert(at::BFloat16{}, E4m3{}) : convert(at::BFloat16{}, E5m2{});
    return;
  }
  at::parallel_for(0, tokens, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
    }
  });
}

// The first index of each row's maximum, NaN counting as the largest (so a
// row with a NaN gives its first NaN): torch.argmax(x, dim=-1)'s answer.
// One pass with a vector of running maxima and their indices (a lane keeps
// its first maximum: strictly greater replaces), then the lanes are merged
// (equal maxima: the smaller index). Indices ride in float lanes, exact
// below 2^24; longer rows take the scalar loop. torch's own argmax over
// [32, 49152] float32 took 0.46 ms on two threads, ~6x the time to read it.
int64_t row_argmax(const float* x, int64_t n) {
  using V = Vectorized<float>;
  constexpr int64_t L = V::size();
  int64_t i = 0, best_i = 0;
  float best = -std::numeric_limits<float>::infinity();
  if (n >= 2 * L && n < (int64_t{1} << 24)) {
    V vbest = V::loadu(x), vidx = V::arange(0.f, 1.f), vbi = vidx, nan = vbest.isnan();
    const V step(static_cast<float>(L));
    for (i = L; i + L <= n; i += L) {
      vidx = vidx + step;
      const V v = V::loadu(x + i);
      const V gt = v > vbest;  // false for NaN: caught by the mask instead
      nan = nan | v.isnan();
      vbest = V::blendv(vbest, v, gt);
      vbi = V::blendv(vbi, vidx, gt);
    }
    alignas(64) float b[L], bi[L];
    alignas(64) uint32_t nn[L];
    vbest.store(b);
    vbi.store(bi);
    nan.store(reinterpret_cast<float*>(nn));
    for (int64_t l = 0; l < L; ++l) {
      if (nn[l]) {
        for (int64_t j = 0;; ++j)
          if (std::isnan(x[j])) return j;
      }
    }
    best = b[0];
    best_i = static_cast<int64_t>(bi[0]);
    for (int64_t l = 1; l < L; ++l) {
      const int64_t li = static_cast<int64_t>(bi[l]);
      if (b[l] > best || (b[l] == best && li < best_i)) best = b[l], best_i = li;
    }
  } else if (n > 0) {
    if (std::isnan(x[0])) return 0;
    best = x[0];
    i = 1;
  }
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > best) best = x[i], best_i = i;
  }
  return best_i;
}

// x [rows, n] float32, rows contiguous (row stride free) -> [rows] int64.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be a 2-D float32 tensor with contiguous, non-empty rows, got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = row_argmax(xp + r * stride, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvferry_fused, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
  m.def("rope_neox(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rope_neox", c10::DispatchKey::CPU, TORCH_FN(rope_neox));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, TORCH_FN(write_kv));
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.def("rope_neox_out(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()");
  m.impl("rope_neox_out", c10::DispatchKey::CPU, TORCH_FN(rope_neox_out));
  m.def("silu_and_mul_out(Tensor x, Tensor(a!) out) -> ()");
  m.impl("silu_and_mul_out", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul_out));
  m.def("add_rms_norm_out(Tensor x, Tensor residual, Tensor weight, float eps, Tensor(a!) h_out, Tensor(b!) out) -> ()");
  m.impl("add_rms_norm_out", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm_out));
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
}
