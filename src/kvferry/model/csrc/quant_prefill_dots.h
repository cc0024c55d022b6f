// Prefill-sized integer dots for every GGUF block type (included by
// quant_gemm.cpp inside its anonymous namespace, after rowsK_512;
// AVX512-VNNI builds only). The K-quants first; the 32-value blocks below.
//
// The one-row dots (rowsK_512) keep 8 partial sums per output, one per 32-bit
// lane: each superblock costs every output an 8-lane convert, multiply and
// multiply-add (twice: values and mins) plus packing and folding its group
// sums, about as many instructions as its 256 multiply-adds (vpdpbusd does
// 64). A form of them that keeps those 8 lanes (decoded weights in L2, four
// rows of x per pass) measured 0.55x the bf16 tiles' speed on Zen 4 (1 thread,
// 8192 x 2048 Q4_K at 512 rows): bf16 vdpbf16ps does half vpdpbusd's
// multiplies per instruction but nothing else. So here, as llama.cpp's
// repacked CPU kernels do, each 32-bit lane is one OUTPUT (one weight row of a
// panel of 16), and all of a superblock's integer products of that output sum
// into it:
//   * a thread decodes a block of panels (about kDecodedBytes, in L2) once per
//     call: per superblock, the 16 rows' values as unsigned bytes, 4 values of
//     a row per lane (q[j]: values 4j..4j+3), their scales per U values as
//     int32 lanes, their mins as int16 pairs, d and dmin as float lanes;
//   * then R rows of x at a time meet every panel of the block: per unit of U
//     values (one scale), U / 4 vpdpbusd per row (x's 4 bytes broadcast from
//     L1) and one vpmulld by the scales; per superblock 8 vpdpwssd for the
//     mins (x's per-16 sums, Q8_K's bsums; Q4_K / Q5_K: 4, x's per-32 sums),
//     then one convert and multiply-add
//     per 16 outputs each for values and mins.
// x is quantized as for the one-row dots (quantize_rows), and each output's
// superblock integers are theirs (the sum of their 8 lanes, exact); only the
// float steps differ: one float accumulator per output, where they keep 8 and
// add them at the end. So a row's value may differ from the one-row dots' in
// its last bits, but not with the batch: each lane's operations are the same
// whatever M, the panel or thread a weight row falls in (the K loop's order
// is fixed), so from PREFILL_DOTS_FROM_ROWS rows a row's result is the same
// in any batch and at any thread count.
#pragma once

#if defined(KVQ_K512) && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define KVQ_PREFILL_DOTS 1

constexpr int kPanel = 16;  // weight rows per panel: one per 32-bit lane

// Values per scale: Q4_K and Q5_K have one scale per 32 values (khead's sc
// repeats it), the others one per 16.
template <int T>
constexpr int scale_unit() { return T == 12 || T == 13 ? 32 : 16; }

// One superblock of a panel of 16 weight rows, decoded (lane c: row c).
template <int U>
struct alignas(64) KPanel {
  __m512i q[64];        // q[j]: values 4j..4j+3 of each row, unsigned bytes
  __m512i sc[256 / U];  // the scale of values U s .. U s + U - 1, int32
  // Per 16 values (U = 16): mins 2j and 2j + 1, int16 pairs, j < 8. Per 32
  // (U = 32: Q4_K / Q5_K, whose mins come in equal pairs per 16): the mins of
  // groups 2j and 2j + 1 for j < 4, the rest zero, against x's per-32 sums
  // (Acts::bsum32): 4 vpdpwssd a superblock and row of x where per 16 took 8
  // (Zen 4, 8 x 6 rows in L1: 181 GMAC/s against 173), the same integers.
  __m512i mn[8];
  __m512 vd, vdm;       // d and dmin
};

// A 16 x 16 matrix of 32-bit values, rows r[0..16), transposed in registers:
// r[c]'s value j to r[j]'s lane c (the panels' layout: one lane per weight
// row). Four stages of 16 shuffles: pairs of values, then of pairs, then of
// 128-bit lanes twice. Where each panel took vpgatherdd per 16 values (64 a
// K-quant superblock), about half a 16-row batch's time on Zen 4.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  KVQ_UNROLL for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  // r[4k + e]'s 128-bit lane L: value 4L + e of rows 4k..4k + 3.
  KVQ_UNROLL for (int k = 0; k < 4; ++k) {
    r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  KVQ_UNROLL for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44), v3 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
    t[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  KVQ_UNROLL for (int j = 0; j < 16; ++j) r[j] = t[j];
}

// The next panel's weight bytes (its 16 rows lie back to back after this
// panel's), prefetched a share per block while this panel is decoded: the
// decoder reads 16 rows a block apiece, a stride the hardware prefetchers did
// not follow (Q8_0's 49152 x 576 lm_head read 4.8 GB/s cold at one row of x,
// the one-row dots with their prefetches 16).
struct PanelPrefetch {
  const char *at, *end;
  int64_t step;
  PanelPrefetch(const uint8_t* w, int64_t row_bytes, int64_t nb)
      : at(reinterpret_cast<const char*>(w + kPanel * row_bytes)), end(at + kPanel * row_bytes),
        step((kPanel * row_bytes + nb - 1) / nb) {}
  inline void next() {
    const char* until = std::min(end, at + step);
    for (; at < until; at += 64) _mm_prefetch(at, _MM_HINT_T0);
  }
};

// Groups 2p and 2p + 1 of a K-quant superblock as unsigned bytes, side by
// side (rowsK_512's decoders).
template <int T>
inline __m512i kpair(const uint8_t* b, int p) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (T == 12) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * p)));
    return _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)), m4);
  } else if constexpr (T == 14) {
    const int n = p / 2, half = p % 2;
    const __m512i ql = _mm512_loadu_si512(b + 64 * n);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n)));
    const __m512i lo = _mm512_and_si512(half ? _mm512_srli_epi16(ql, 4) : ql, m4);
    const __m512i hs = half ? _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4) : _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    const __m512i hi = _mm512_and_si512(_mm512_srlv_epi64(qh, hs), _mm512_set1_epi8(3));
    return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
  } else {
    return _mm512_inserti64x4(_mm512_castsi256_si512(kgroup<T>(b, 2 * p)), kgroup<T>(b, 2 * p + 1), 1);
  }
}

// Weight rows w[0..rows) (rows <= 16; lanes past them repeat the last row),
// superblocks 0..nb, into out[0..nb). Q4_K's pairs of groups are decoded
// for the 16 rows straight into the registers their transpose takes (one
// load and two operations a pair; measured on Zen 4, 8B shapes at one row of
// x: 0.75-0.85x the time of a round trip through the stack); the other
// types' decoders share loads between pairs (Q6_K: ql and qh serve two),
// and each row's four pairs go through the stack (Q6_K decoded per pair
// measured 1.1x slower).
template <int T>
void kdecode_panel(const uint8_t* w, int64_t row_bytes, int rows, int64_t nb, KPanel<scale_unit<T>()>* out) {
  constexpr int U = scale_unit<T>();
  const int64_t bytes = info(T).bytes;  // a superblock's
  // Per row: its 16 scales as int32 (sc), then its 8 min pairs, d and dmin (mn).
  alignas(64) int32_t sc[kPanel][16], mn[kPanel][16];
  constexpr bool kInRegisters = T == 12;
  alignas(64) uint8_t vals[kInRegisters ? 1 : kPanel][256];
  PanelPrefetch pf(w, row_bytes, nb);
  for (int64_t i = 0; i < nb; ++i) {
    pf.next();
    const uint8_t* b0 = w + i * bytes;
    auto row = [&](int c) { return b0 + std::min(c, rows - 1) * row_bytes; };
    for (int c = 0; c < kPanel; ++c) {
      if constexpr (!kInRegisters)
        KVQ_UNROLL for (int p = 0; p < 4; ++p) _mm512_store_si512(vals[c] + 64 * p, kpair<T>(row(c), p));
      KHead h;
      khead(T, row(c), h);
      // khead stored sc and mn 256 bits each: these loads are forwarded from those stores.
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.sc));
      _mm512_store_si512(sc[c], _mm512_cvtepi16_epi32(s16));
      __m256i m16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.mn));
      if constexpr (U == 32)  // (m_g, m_g) per 32-bit lane: the low halves are the 8 groups' mins, in order
        m16 = _mm256_zextsi128_si256(_mm256_cvtepi32_epi16(m16));
      const __m256 dd = _mm256_setr_ps(h.d, h.dm, 0, 0, 0, 0, 0, 0);
      _mm512_store_si512(mn[c], _mm512_inserti64x4(_mm512_castsi256_si512(m16), _mm256_castps_si256(dd), 1));
    }
    KPanel<U>& P = out[i];
    __m512i r[16];
    KVQ_UNROLL for (int p = 0; p < 4; ++p) {
      KVQ_UNROLL for (int c = 0; c < kPanel; ++c)
        r[c] = kInRegisters ? kpair<T>(row(c), p) : _mm512_load_si512(vals[kInRegisters ? 0 : c] + 64 * p);
      transpose16(r);
      KVQ_UNROLL for (int j = 0; j < 16; ++j) P.q[16 * p + j] = r[j];
    }
    KVQ_UNROLL for (int c = 0; c < kPanel; ++c) r[c] = _mm512_load_si512(sc[c]);
    transpose16(r);
    // Scale s covers values U s..U s + U - 1: khead's sc[s U / 16] (Q4_K / Q5_K repeat each scale twice).
    KVQ_UNROLL for (int s = 0; s < 256 / U; ++s) P.sc[s] = r[s * U / 16];
    KVQ_UNROLL for (int c = 0; c < kPanel; ++c) r[c] = _mm512_load_si512(mn[c]);
    transpose16(r);
    KVQ_UNROLL for (int j = 0; j < 8; ++j) P.mn[j] = r[j];
    P.vd = _mm512_castsi512_ps(r[8]);
    P.vdm = _mm512_castsi512_ps(r[9]);
  }
}

// R rows of x (m0..m0 + R) against one decoded panel, the whole K: y[r * 16 + c].
template <int U, int R>
inline void kpanel_rows(const KPanel<U>* P, const Acts& a, int64_t m0, float* y) {
  __m512 acc[R], macc[R];
  KVQ_UNROLL for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm512_setzero_ps();
  const int64_t nb = a.nb;
  auto x4 = [](const void* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); };
  for (int64_t i = 0; i < nb; ++i) {
    const KPanel<U>& p = P[i];
    const int8_t* xq = a.q + (m0 * nb + i) * 256;
    const int64_t xstep = nb * 256;  // one row of x to the next
    __m512i iacc[R];
    KVQ_UNROLL for (int r = 0; r < R; ++r) iacc[r] = _mm512_setzero_si512();
    for (int s = 0; s < 256 / U; ++s) {
      __m512i t[R];
      KVQ_UNROLL for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_si512();
      KVQ_UNROLL for (int j = 0; j < U / 4; ++j) {
        const __m512i w = p.q[s * U / 4 + j];
        KVQ_UNROLL for (int r = 0; r < R; ++r) t[r] = _mm512_dpbusd_epi32(t[r], w, x4(xq + r * xstep + s * U + 4 * j));
      }
      const __m512i sc = p.sc[s];
      KVQ_UNROLL for (int r = 0; r < R; ++r) iacc[r] = _mm512_add_epi32(iacc[r], _mm512_mullo_epi32(t[r], sc));
    }
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      const int64_t ai = (m0 + r) * nb + i;
      __m512i im = _mm512_setzero_si512();
      if constexpr (U == 32) {  // mins per 32 values, two groups a lane against x's per-32 sums
        KVQ_UNROLL for (int j = 0; j < 4; ++j) im = _mm512_dpwssd_epi32(im, p.mn[j], x4(a.bsum32 + ai * 8 + 2 * j));
      } else {
        KVQ_UNROLL for (int j = 0; j < 8; ++j) im = _mm512_dpwssd_epi32(im, p.mn[j], x4(a.bsum + ai * 16 + 2 * j));
      }
      const __m512 xd = _mm512_set1_ps(a.d[ai]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r]), _mm512_mul_ps(p.vd, xd), acc[r]);
      macc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(im), _mm512_mul_ps(p.vdm, xd), macc[r]);
    }
  }
  KVQ_UNROLL for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * kPanel, _mm512_sub_ps(acc[r], macc[r]));
}

// Rows of x per kpanel_rows call: 6 rows' float (12 registers) and integer
// (12) accumulators, a panel's weights and scales fit the 32 registers.
constexpr int kPrefillRows = 6;
// A thread's block of decoded panels: about this many bytes (L2 holds it
// beside x's rows; Zen 4 has 1 MiB of L2 per core).
constexpr int64_t kDecodedBytes = 512 << 10;

// The prefill kernels' loop over a thread's weight rows n0..n1 against all M
// rows of x, into Y[m * ldy + n] (O: float or bf16): panels of kPanel weight
// rows decoded (decode(n, rows, out): the panel at weight row n, nb blocks),
// as many as fit kDecodedBytes, then kPrefillRows rows of x at a time against
// each (rows(R, P, m, y): R rows from row m into y[R][kPanel], R a
// compile-time constant, 1..kPrefillRows). ahead(n, panels, step, steps):
// called before each of a block's `steps` (rows of x, panel) steps with the
// next block's first weight row n and panel count (panels 0 past n1): the
// packed panels prefetch that block's bytes a share per step, so the next
// decode reads L2, not memory.
template <typename Panel, typename O, typename Decode, typename Rows, typename Ahead>
void panel_loop(std::vector<Panel>& decoded, int64_t nb, int64_t M, int64_t n0, int64_t n1, O* Y, int64_t ldy,
                Decode decode, Rows rows, Ahead ahead) {
  const int64_t block_panels = std::max<int64_t>(1, kDecodedBytes / (nb * int64_t(sizeof(Panel))));
  if (int64_t(decoded.size()) < block_panels * nb) decoded.resize(block_panels * nb);
  alignas(64) float y[kPrefillRows * kPanel];
  for (int64_t nblk = n0; nblk < n1; nblk += kPanel * block_panels) {
    const int64_t panels = std::min<int64_t>(block_panels, (n1 - nblk + kPanel - 1) / kPanel);
    for (int64_t j = 0; j < panels; ++j) {
      const int64_t n = nblk + kPanel * j;
      decode(n, int(std::min<int64_t>(kPanel, n1 - n)), decoded.data() + j * nb);
    }
    const int64_t next = nblk + kPanel * block_panels;
    const int64_t next_panels = next < n1 ? std::min<int64_t>(block_panels, (n1 - next + kPanel - 1) / kPanel) : 0;
    const int64_t steps = (M + kPrefillRows - 1) / kPrefillRows * panels;
    int64_t step = 0;
    for (int64_t m = 0; m < M; m += kPrefillRows) {
      const int r = int(std::min<int64_t>(kPrefillRows, M - m));
      for (int64_t j = 0; j < panels; ++j) {
        ahead(next, next_panels, step++, steps);
        const Panel* P = decoded.data() + j * nb;
        switch (r) {
          case 6: rows(std::integral_constant<int, 6>{}, P, m, y); break;
          case 5: rows(std::integral_constant<int, 5>{}, P, m, y); break;
          case 4: rows(std::integral_constant<int, 4>{}, P, m, y); break;
          case 3: rows(std::integral_constant<int, 3>{}, P, m, y); break;
          case 2: rows(std::integral_constant<int, 2>{}, P, m, y); break;
          default: rows(std::integral_constant<int, 1>{}, P, m, y); break;
        }
        const int64_t n = nblk + kPanel * j, cols = std::min<int64_t>(kPanel, n1 - n);
        for (int k = 0; k < r; ++k)
          for (int64_t c = 0; c < cols; ++c) Y[(m + k) * ldy + n + c] = O(y[k * kPanel + c]);
      }
    }
  }
}

// Weight rows n0..n1 (bytes each) against all M rows of a, into y[m * ldy + n] (O: float or bf16).
template <int T, typename O>
void prefill_rows(const uint8_t* W, int64_t bytes, const Acts& a, int64_t M, int64_t n0, int64_t n1, O* Y,
                  int64_t ldy) {
  constexpr int U = scale_unit<T>();
  thread_local std::vector<KPanel<U>> decoded;
  const int64_t nb = a.nb;
  panel_loop(decoded, nb, M, n0, n1, Y, ldy,
             [&](int64_t n, int rows, KPanel<U>* out) { kdecode_panel<T>(W + n * bytes, bytes, rows, nb, out); },
             [&](auto R, const KPanel<U>* P, int64_t m, float* y) { kpanel_rows<U, decltype(R)::value>(P, a, m, y); },
             [](int64_t, int64_t, int64_t, int64_t) {});
}

// Q4_K and Q6_K panels repacked once at load (pack_panels), so that a call
// no longer decodes them: kdecode_panel's KPanel, with each register's bytes
// narrowed back to the bits they carry, one superblock of a panel of 16 rows
// after another (panel-major, then superblock), every register a 64-byte
// line in the order the call reads it:
//   Q4_K (2368 bytes, the 16 rows' blocks 2304): 32 lines of nibbles, line
//     8p + m = q[16p + m] | q[16p + 8 + m] << 4; the 8 scales and 8 mins as
//     bytes, 16 rows each; d and dmin as 16 fp16 each.
//   Q6_K (3360 bytes, the blocks 3360): the 6-bit values' low nibbles as
//     Q4_K's, then 16 lines of their high 2 bits (line h: q[h + 16p] >> 4 at
//     bits 2p, 2p + 1); the 16 scales as int8 bytes, 16 rows each; d as fp16.
// unpack_superblock puts back kdecode_panel's registers bit for bit (the
// tests compare), so the packed panels' results are the decoded panels', to
// the bit; unpacking costs per superblock and panel about 100 simple
// operations on lines read in order, where decoding cost per row a K-quant
// head, four pairs of groups and six 16 x 16 transposes.
template <int T>
constexpr int64_t packed_superblock_bytes() { return T == 12 ? 2368 : T == 14 ? 3360 : 0; }
inline int64_t packed_bytes_of(int64_t t) { return t == 12 ? 2368 : t == 14 ? 3360 : 0; }

template <int T>
void pack_superblock(const KPanel<scale_unit<T>()>& P, uint8_t* o) {
  constexpr int U = scale_unit<T>();
  const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
  for (int p = 0; p < 4; ++p)
    for (int m = 0; m < 8; ++m) {
      const __m512i lo = _mm512_and_si512(P.q[16 * p + m], m4), hi = _mm512_and_si512(P.q[16 * p + 8 + m], m4);
      _mm512_storeu_si512(o + 64 * (8 * p + m), _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)));
    }
  int64_t at = 2048;
  if constexpr (T == 14) {
    for (int h = 0; h < 16; ++h) {
      __m512i v = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p)  // values <= 63: bits 4-5 of each byte, to bits 2p, 2p + 1
        v = _mm512_or_si512(v, _mm512_sll_epi16(_mm512_and_si512(_mm512_srli_epi16(P.q[16 * p + h], 4), m2),
                                                _mm_cvtsi32_si128(2 * p)));
      _mm512_storeu_si512(o + at + 64 * h, v);
    }
    at += 1024;
  }
  for (int s = 0; s < 256 / U; ++s) _mm_storeu_si128(reinterpret_cast<__m128i*>(o + at + 16 * s), _mm512_cvtepi32_epi8(P.sc[s]));
  at += 16 * (256 / U);
  if constexpr (T == 12) {  // group g's min: the low (g even) or high (g odd) half of mn[g / 2]
    for (int g = 0; g < 8; ++g) {
      const __m512i m = g % 2 ? _mm512_srli_epi32(P.mn[g / 2], 16) : P.mn[g / 2];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + at + 16 * g), _mm512_cvtepi32_epi8(m));
    }
    at += 128;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + at), _mm512_cvtps_ph(P.vd, _MM_FROUND_TO_NEAREST_INT));
  if constexpr (T == 12)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + at + 32), _mm512_cvtps_ph(P.vdm, _MM_FROUND_TO_NEAREST_INT));
}

template <int T>
inline void unpack_superblock(const uint8_t* o, KPanel<scale_unit<T>()>& P) {
  constexpr int U = scale_unit<T>();
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  KVQ_UNROLL for (int p = 0; p < 4; ++p) {
    KVQ_UNROLL for (int m = 0; m < 8; ++m) {
      const __m512i c = _mm512_loadu_si512(o + 64 * (8 * p + m));
      __m512i lo = _mm512_and_si512(c, m4), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), m4);
      if constexpr (T == 14) {  // bits 2p, 2p + 1 of the high-bit lines to bits 4, 5
        const __m512i h0 = _mm512_loadu_si512(o + 2048 + 64 * m), h1 = _mm512_loadu_si512(o + 2048 + 64 * (m + 8));
        auto up = [&](__m512i h) { return p < 3 ? _mm512_slli_epi16(h, 4 - 2 * p) : _mm512_srli_epi16(h, 2); };
        lo = _mm512_ternarylogic_epi32(lo, up(h0), m30, 0xF8);  // lo | (h & 0x30)
        hi = _mm512_ternarylogic_epi32(hi, up(h1), m30, 0xF8);
      }
      P.q[16 * p + m] = lo;
      P.q[16 * p + 8 + m] = hi;
    }
  }
  constexpr int64_t at = T == 14 ? 3072 : 2048;
  KVQ_UNROLL for (int s = 0; s < 256 / U; ++s) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + at + 16 * s));
    P.sc[s] = T == 14 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  }
  if constexpr (T == 12) {
    auto mins = [&](int g) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + at + 128 + 16 * g))); };
    KVQ_UNROLL for (int j = 0; j < 4; ++j) P.mn[j] = _mm512_or_si512(mins(2 * j), _mm512_slli_epi32(mins(2 * j + 1), 16));
    KVQ_UNROLL for (int j = 4; j < 8; ++j) P.mn[j] = _mm512_setzero_si512();
    P.vd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + at + 256)));
    P.vdm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + at + 288)));
  } else {  // Q6_K's "mins" are 32 sc (the -32 offset), as int16 pairs
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    KVQ_UNROLL for (int j = 0; j < 8; ++j)
      P.mn[j] = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(P.sc[2 * j], 5), low16),
                                _mm512_slli_epi32(P.sc[2 * j + 1], 21));
    P.vd = P.vdm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + at + 256)));
  }
}

// Weight rows w[0..n) (row_bytes each, nb superblocks) packed into out:
// ceil(n / 16) panels of nb * packed_superblock_bytes<T>() (the last panel's
// missing rows repeat its last row, as kdecode_panel's lanes do).
template <int T>
void pack_panels(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t nb, uint8_t* out) {
  constexpr int64_t PB = packed_superblock_bytes<T>();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<KPanel<scale_unit<T>()>> buf(nb);
    for (int64_t p = p0; p < p1; ++p) {
      kdecode_panel<T>(w + p * kPanel * row_bytes, row_bytes, int(std::min<int64_t>(kPanel, n - p * kPanel)), nb,
                       buf.data());
      for (int64_t i = 0; i < nb; ++i) pack_superblock<T>(buf[i], out + (p * nb + i) * PB);
    }
  });
}

// prefill_rows on packed panels: weight rows n0..n1, n0 a multiple of 16
// (dots() rounds its shares to 16 rows).
template <int T, typename O>
void prefill_rows_packed(const uint8_t* packed, const Acts& a, int64_t M, int64_t n0, int64_t n1, O* Y, int64_t ldy) {
  constexpr int U = scale_unit<T>();
  constexpr int64_t PB = packed_superblock_bytes<T>();
  thread_local std::vector<KPanel<U>> decoded;
  const int64_t nb = a.nb;
  panel_loop(decoded, nb, M, n0, n1, Y, ldy,
             [&](int64_t n, int, KPanel<U>* out) {
               const uint8_t* src = packed + (n / kPanel) * nb * PB;
               for (int64_t i = 0; i < nb; ++i) unpack_superblock<T>(src + i * PB, out[i]);
             },
             [&](auto R, const KPanel<U>* P, int64_t m, float* y) { kpanel_rows<U, decltype(R)::value>(P, a, m, y); },
             [&](int64_t n, int64_t panels, int64_t step, int64_t steps) {
               // The next block's packed bytes to L2, a share per step (lines [b0, b1)).
               const char* at = reinterpret_cast<const char*>(packed + (n / kPanel) * nb * PB);
               const int64_t bytes = panels * nb * PB, b0 = bytes * step / steps / 64 * 64, b1 = bytes * (step + 1) / steps;
               for (int64_t b = b0; b < b1; b += 64) _mm_prefetch(at + b, _MM_HINT_T1);
             });
}

// Lane step l of a superblock's (an eighth of its bytes) lines
// far_ahead_bytes further on, to L2: a second prefetch stream beside the Stream's, which
// keeps the bytes about to be read in L1 (Stream::kAhead ahead). The panels'
// dots read a superblock's lines 512 bytes apart (line 8p + l for lane l),
// and their batch-1 kernel takes under half the blocks' instructions a byte
// (Q6_K: 825 a superblock of 16 rows, rowsK1_512 126 a row): with the L1
// stream alone the Q6_K panels read ~13 GB/s cold on Zen 4 (1B's lm_head and
// ffn_down, 1 thread) against the blocks' ~16, with this one 20-25 (measured
// 12-32 KiB; to L1 it measured slower, its lines evicting the ones being
// read). Prefetches only: the same bits; past the share's or the buffer's
// end they are wasted, never a fault. On AMD Zen 5 it only cost time (the
// batch-1 step's panels took 0.885x the time without it), so the distance is
// configure's (quant/kernels.py's PANEL_FAR_AHEAD, by CPU; 0: none).
inline int64_t far_ahead_bytes = 24576;
template <int T>
inline void far_prefetch(const uint8_t* superblock, int l) {
  constexpr int64_t step = packed_superblock_bytes<T>() / 8;
  if (far_ahead_bytes == 0) return;
  const char* f = reinterpret_cast<const char*>(superblock) + far_ahead_bytes + step * l;
  KVQ_UNROLL for (int64_t j = 0; j < step; j += 64) _mm_prefetch(f + j, _MM_HINT_T1);
}

// One row of x (decode at batch 1) against packed panels: weight rows n0..n1
// (n0 a multiple of 16), each output's arithmetic rowsK1_512's to the bit, so
// a weight whose blocks were replaced by its panels decodes as before. Each
// output keeps rowsK1_512's 8 integer lanes (lane l: values 4l..4l+3 of every
// 32-value group, q[j] with j % 8 == l, times their scales) and 8 mins lanes
// (sub-blocks 2l, 2l + 1), as one register of 16 outputs each, multiplies
// and adds them as floats lane by lane in superblock order, and ends with
// hsum's order ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). Per group
// pair, two vpdpbusd (x's 4 bytes broadcast) whose sums (|s| < 2^15) share a
// dword as 16-bit halves (one byte shuffle) and one vpdpwssd by the pair's
// scales, as rowsK_512's. About 20 instructions per output and superblock,
// where rowsK1_512 takes ~50 (its scales' shuffles and its per-row sums).
template <int T>
inline void packed_panel_row1(const uint8_t* src, const Acts& a, int64_t m0, float* y, Spread& spread) {
  constexpr int64_t PB = packed_superblock_bytes<T>();
  constexpr int64_t at = T == 14 ? 3072 : 2048;  // the scales' bytes
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i up4 = _mm512_broadcast_i32x4(_mm_setr_epi32(0x01000000, 0x05040000, 0x09080000, 0x0D0C0000));
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  __m512 acc[8], macc[8];
  KVQ_UNROLL for (int l = 0; l < 8; ++l) acc[l] = macc[l] = _mm512_setzero_ps();
  auto x4 = [](const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); };
  const int64_t nb = a.nb;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* o = src + i * PB;
    const int64_t ai = m0 * nb + i;
    const int8_t* xq = a.q + ai * 256;
    const __m512 xd = _mm512_set1_ps(a.d[ai]);
    __m512 vd, vdm;
    auto scale = [&](int s) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + at + 16 * s));
      return T == 14 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    };
    if constexpr (T == 12) {
      vd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + at + 256)));
      vdm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + at + 288)));
    } else {
      vd = vdm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + at + 256)));
    }
    const __m512 vdd = _mm512_mul_ps(vd, xd), vdmd = _mm512_mul_ps(vdm, xd);
    // Lane l's integers: line (p, l) holds q[16p + l] (low nibbles) and q[16p + 8 + l] (high).
    KVQ_UNROLL for (int half = 0; half < 2; ++half) {
      // The scales of q[16p + l] and q[16p + 8 + l] (l in this half) as 16-bit halves of a dword.
      __m512i scp[4];
      KVQ_UNROLL for (int p = 0; p < 4; ++p) {
        const int s0 = T == 12 ? 2 * p : 4 * p + half, s1 = T == 12 ? 2 * p + 1 : 4 * p + 2 + half;
        scp[p] = _mm512_or_si512(_mm512_and_si512(scale(s0), low16), _mm512_slli_epi32(scale(s1), 16));
      }
      KVQ_UNROLL for (int l = 4 * half; l < 4 * half + 4; ++l) {
        spread.next();  // a few lines at a time: a superblock's ~37 at once held up its loads
        far_prefetch<T>(o, l);
        __m512i h0, h1;
        if constexpr (T == 14) {
          h0 = _mm512_loadu_si512(o + 2048 + 64 * l);
          h1 = _mm512_loadu_si512(o + 2048 + 64 * (l + 8));
        }
        __m512i iacc = _mm512_setzero_si512();
        KVQ_UNROLL for (int p = 0; p < 4; ++p) {
          const __m512i c = _mm512_loadu_si512(o + 64 * (8 * p + l));
          __m512i lo = _mm512_and_si512(c, m4), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), m4);
          if constexpr (T == 14) {  // bits 2p, 2p + 1 of the high-bit lines to bits 4, 5
            auto up = [&](__m512i h) { return p < 3 ? _mm512_slli_epi16(h, 4 - 2 * p) : _mm512_srli_epi16(h, 2); };
            lo = _mm512_ternarylogic_epi32(lo, up(h0), m30, 0xF8);
            hi = _mm512_ternarylogic_epi32(hi, up(h1), m30, 0xF8);
          }
          const __m512i t0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x4(xq + 4 * (16 * p + l)));
          const __m512i t1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, x4(xq + 4 * (16 * p + 8 + l)));
          iacc = _mm512_dpwssd_epi32(iacc, _mm512_mask_shuffle_epi8(t0, 0xCCCCCCCCCCCCCCCCull, t1, up4), scp[p]);
        }
        acc[l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), vdd, acc[l]);
      }
    }
    // Mins lane l: sub-blocks 2l and 2l + 1 (Q6_K: 32 times their scales) times x's per-16 sums.
    KVQ_UNROLL for (int l = 0; l < 8; ++l) {
      __m512i mn;
      if constexpr (T == 12) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + at + 128 + 16 * l)));
        mn = _mm512_or_si512(v, _mm512_slli_epi32(v, 16));
      } else {
        mn = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(scale(2 * l), 5), low16),
                             _mm512_slli_epi32(scale(2 * l + 1), 21));
      }
      const __m512i im = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mn, x4(reinterpret_cast<const int8_t*>(a.bsum + ai * 16 + 2 * l)));
      macc[l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(im), vdmd, macc[l]);
    }
  }
  __m512 v[8];
  KVQ_UNROLL for (int l = 0; l < 8; ++l) v[l] = _mm512_sub_ps(acc[l], macc[l]);
  const __m512 t0 = _mm512_add_ps(_mm512_add_ps(v[0], v[4]), _mm512_add_ps(v[2], v[6]));
  const __m512 t1 = _mm512_add_ps(_mm512_add_ps(v[1], v[5]), _mm512_add_ps(v[3], v[7]));
  _mm512_storeu_ps(y, _mm512_add_ps(t0, t1));
}

// Weight rows n0..n1 (n0 a multiple of 16) of packed panels against one row of x, into Y[n].
template <int T, typename O>
void packed_rows1(const uint8_t* packed, const Acts& a, int64_t n0, int64_t n1, O* Y, Stream& pf) {
  constexpr int64_t PB = packed_superblock_bytes<T>();
  const int64_t panel_bytes = a.nb * PB;
  alignas(64) float y[kPanel];
  for (int64_t n = n0; n < n1; n += kPanel) {
    Spread spread(pf.take(panel_bytes), 8 * a.nb);
    packed_panel_row1<T>(packed + (n / kPanel) * panel_bytes, a, 0, y, spread);
    spread.rest();
    const int64_t cols = std::min<int64_t>(kPanel, n1 - n);
    for (int64_t c = 0; c < cols; ++c) Y[n + c] = O(y[c]);
  }
}

// R rows of x (m0..m0 + R) against one packed panel (decode batches of 2 to
// PREFILL_DOTS_FROM_ROWS - 1): packed_panel_row1's arithmetic for each row,
// step for step (its integer lanes, its float multiply-adds in superblock
// order, its final sums), so each row's value is the batch-1 dots' to the
// bit, but each line of the panel is widened (nibbles, Q6_K's high bits, the
// scales and mins) once for all R rows, not once per row: at 8 rows the
// row-by-row form spent ~60% of its work widening (Q6_K) and lost to the
// blocks' rowsK_512, which decodes a superblock once for its rows. The R rows'
// 16 float accumulators each live in acc (L1; R x 2 KiB), loaded and stored
// once per superblock and lane: registers hold one lane's 8 widened lines,
// its 4 scale pairs and the constants.
template <int T, int R>
__attribute__((noinline)) void packed_panel_rows(const uint8_t* src, const Acts& a, int64_t m0, float* y,
                                                 int64_t ldy, Spread& spread) {
  constexpr int64_t PB = packed_superblock_bytes<T>();
  constexpr int64_t at = T == 14 ? 3072 : 2048;  // the scales' bytes
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i up4 = _mm512_broadcast_i32x4(_mm_setr_epi32(0x01000000, 0x05040000, 0x09080000, 0x0D0C0000));
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  alignas(64) float acc[R][8][kPanel], macc[R][8][kPanel];
  alignas(64) float vdd[R][kPanel], vdmd[R][kPanel];
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 8; ++l) {
      _mm512_store_ps(acc[r][l], _mm512_setzero_ps());
      _mm512_store_ps(macc[r][l], _mm512_setzero_ps());
    }
  auto x4 = [](const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); };
  const int64_t nb = a.nb;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* o = src + i * PB;
    auto scale = [&](int s) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + at + 16 * s));
      return T == 14 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    };
    __m512 vd, vdm;
    if constexpr (T == 12) {
      vd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + at + 256)));
      vdm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + at + 288)));
    } else {
      vd = vdm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + at + 256)));
    }
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      const __m512 xd = _mm512_set1_ps(a.d[(m0 + r) * nb + i]);
      _mm512_store_ps(vdd[r], _mm512_mul_ps(vd, xd));
      _mm512_store_ps(vdmd[r], _mm512_mul_ps(vdm, xd));
    }
    // Kept in memory: the compiler would otherwise try to hold R x 16 accumulators in registers.
    asm("" : "+m"(acc), "+m"(macc), "+m"(vdd), "+m"(vdmd));
    for (int half = 0; half < 2; ++half) {
      __m512i scp[4];
      KVQ_UNROLL for (int p = 0; p < 4; ++p) {
        const int s0 = T == 12 ? 2 * p : 4 * p + half, s1 = T == 12 ? 2 * p + 1 : 4 * p + 2 + half;
        scp[p] = _mm512_or_si512(_mm512_and_si512(scale(s0), low16), _mm512_slli_epi32(scale(s1), 16));
      }
      for (int l = 4 * half; l < 4 * half + 4; ++l) {
        spread.next();
        far_prefetch<T>(o, l);
        __m512i lo[4], hi[4];
        __m512i h0, h1;
        if constexpr (T == 14) {
          h0 = _mm512_loadu_si512(o + 2048 + 64 * l);
          h1 = _mm512_loadu_si512(o + 2048 + 64 * (l + 8));
        }
        KVQ_UNROLL for (int p = 0; p < 4; ++p) {
          const __m512i c = _mm512_loadu_si512(o + 64 * (8 * p + l));
          lo[p] = _mm512_and_si512(c, m4);
          hi[p] = _mm512_and_si512(_mm512_srli_epi16(c, 4), m4);
          if constexpr (T == 14) {
            auto up = [&](__m512i h) { return p < 3 ? _mm512_slli_epi16(h, 4 - 2 * p) : _mm512_srli_epi16(h, 2); };
            lo[p] = _mm512_ternarylogic_epi32(lo[p], up(h0), m30, 0xF8);
            hi[p] = _mm512_ternarylogic_epi32(hi[p], up(h1), m30, 0xF8);
          }
        }
        KVQ_UNROLL for (int r = 0; r < R; ++r) {
          const int8_t* xq = a.q + ((m0 + r) * nb + i) * 256;
          __m512i iacc = _mm512_setzero_si512();
          KVQ_UNROLL for (int p = 0; p < 4; ++p) {
            const __m512i t0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[p], x4(xq + 4 * (16 * p + l)));
            const __m512i t1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[p], x4(xq + 4 * (16 * p + 8 + l)));
            iacc = _mm512_dpwssd_epi32(iacc, _mm512_mask_shuffle_epi8(t0, 0xCCCCCCCCCCCCCCCCull, t1, up4), scp[p]);
          }
          _mm512_store_ps(acc[r][l], _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), _mm512_load_ps(vdd[r]),
                                                     _mm512_load_ps(acc[r][l])));
        }
      }
    }
    for (int l = 0; l < 8; ++l) {
      __m512i mn;
      if constexpr (T == 12) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + at + 128 + 16 * l)));
        mn = _mm512_or_si512(v, _mm512_slli_epi32(v, 16));
      } else {
        mn = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(scale(2 * l), 5), low16),
                             _mm512_slli_epi32(scale(2 * l + 1), 21));
      }
      KVQ_UNROLL for (int r = 0; r < R; ++r) {
        const int64_t ai = (m0 + r) * nb + i;
        const __m512i im = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mn,
                                               x4(reinterpret_cast<const int8_t*>(a.bsum + ai * 16 + 2 * l)));
        _mm512_store_ps(macc[r][l], _mm512_fmadd_ps(_mm512_cvtepi32_ps(im), _mm512_load_ps(vdmd[r]),
                                                    _mm512_load_ps(macc[r][l])));
      }
    }
    asm("" : "+m"(acc), "+m"(macc));
  }
  for (int r = 0; r < R; ++r) {
    __m512 v[8];
    KVQ_UNROLL for (int l = 0; l < 8; ++l) v[l] = _mm512_sub_ps(_mm512_load_ps(acc[r][l]), _mm512_load_ps(macc[r][l]));
    const __m512 t0 = _mm512_add_ps(_mm512_add_ps(v[0], v[4]), _mm512_add_ps(v[2], v[6]));
    const __m512 t1 = _mm512_add_ps(_mm512_add_ps(v[1], v[5]), _mm512_add_ps(v[3], v[7]));
    _mm512_store_ps(y + r * ldy, _mm512_add_ps(t0, t1));
  }
}

// Rows of x per packed_panel_rows pass (more: the passes' acc outgrow L1's share).
constexpr int kPackedRowsMax = 6;

// The same against the M rows of x (decode batches below
// PREFILL_DOTS_FROM_ROWS), into Y[m * ldy + n]: each panel meets the rows of
// x in passes of up to kPackedRowsMax (its bytes stay in L1 or L2 between
// them), each row's values rowsK1_512's, so rowsK_512's at any M.
template <int T, typename O>
void packed_rows(const uint8_t* packed, const Acts& a, int64_t M, int64_t n0, int64_t n1, O* Y, int64_t ldy,
                 Stream& pf) {
  if (M == 1) return packed_rows1<T>(packed, a, n0, n1, Y, pf);
  constexpr int64_t PB = packed_superblock_bytes<T>();
  const int64_t panel_bytes = a.nb * PB;
  alignas(64) float y[kPackedRowsMax][kPanel];
  const int64_t passes = (M + kPackedRowsMax - 1) / kPackedRowsMax;
  for (int64_t n = n0; n < n1; n += kPanel) {
    const uint8_t* panel = packed + (n / kPanel) * panel_bytes;
    const int64_t cols = std::min<int64_t>(kPanel, n1 - n);
    Spread spread(pf.take(panel_bytes), 8 * a.nb);
    for (int64_t k = 0, m = 0; k < passes; ++k) {  // passes as equal as they can be (11 rows: 6 and 5)
      const int r = int((M - m + (passes - k) - 1) / (passes - k));
      switch (r) {
        case 2: packed_panel_rows<T, 2>(panel, a, m, y[0], kPanel, spread); break;
        case 3: packed_panel_rows<T, 3>(panel, a, m, y[0], kPanel, spread); break;
        case 4: packed_panel_rows<T, 4>(panel, a, m, y[0], kPanel, spread); break;
        case 5: packed_panel_rows<T, 5>(panel, a, m, y[0], kPanel, spread); break;
        default: packed_panel_rows<T, kPackedRowsMax>(panel, a, m, y[0], kPanel, spread); break;
      }
      for (int j = 0; j < r; ++j)
        for (int64_t c = 0; c < cols; ++c) Y[(m + j) * ldy + n + c] = O(y[j][c]);
      m += r;
    }
    spread.rest();
  }
}

template <typename O>
void packed_rows_of(int64_t t, const uint8_t* packed, const Acts& a, int64_t M, int64_t n0, int64_t n1, O* Y,
                    int64_t ldy, Stream& pf) {
  if (t == 12) packed_rows<12>(packed, a, M, n0, n1, Y, ldy, pf);
  else if (t == 14) packed_rows<14>(packed, a, M, n0, n1, Y, ldy, pf);
}

// Weight row r of packed panels, dequantized into o[0..K): dequant_simd's
// values from the blocks, to the bit (per value one fused multiply-add of
// sc * d and mn * -dm, each product rounded as there). The embedding's
// row lookups of a table whose blocks were released (a tied lm_head's).
template <int T, typename O>
void dequant_packed_row(const uint8_t* packed, int64_t r, int64_t nb, O* o) {
  constexpr int U = scale_unit<T>();
  constexpr int64_t PB = packed_superblock_bytes<T>();
  const int c = int(r % kPanel);
  const uint8_t* src = packed + (r / kPanel) * nb * PB;
  KPanel<U> P;
  for (int64_t i = 0; i < nb; ++i) {
    unpack_superblock<T>(src + i * PB, P);
    const uint8_t* q = reinterpret_cast<const uint8_t*>(P.q);   // q[j]'s lane c: bytes 64 j + 4 c ..
    const int32_t* sc = reinterpret_cast<const int32_t*>(P.sc); // sc[s]'s lane c: 16 s + c
    // The mins as int16 halves of a dword (KPanel::mn): per 16 values (Q6_K)
    // sub-blocks 2j and 2j + 1 in mn[j]; per 32 (Q4_K) groups 2j and 2j + 1.
    const int32_t* mn = reinterpret_cast<const int32_t*>(P.mn);
    const float d = reinterpret_cast<const float*>(&P.vd)[c], dm = reinterpret_cast<const float*>(&P.vdm)[c];
    for (int s = 0; s < 16; ++s) {  // per 16 values: khead's sc[s] and mn[s]
      const float fs = float(sc[(16 * s / U) * 16 + c]) * d;
      const int unit = 16 * s / U;  // the min's index in its own unit (16 or 32 values)
      const int32_t pair = mn[(unit / 2) * 16 + c];
      const float fm = float(int16_t(unit % 2 ? uint32_t(pair) >> 16 : uint32_t(pair) & 0xFFFF)) * -dm;
      for (int v = 16 * s; v < 16 * s + 16; ++v)
        o[i * 256 + v] = O(std::fma(fs, float(q[(v / 4) * 64 + 4 * c + v % 4]), fm));
    }
  }
}

template <typename O>
void prefill_rows_packed_of(int64_t t, const uint8_t* packed, const Acts& a, int64_t M, int64_t n0, int64_t n1, O* Y,
                            int64_t ldy) {
  if (t == 12) prefill_rows_packed<12>(packed, a, M, n0, n1, Y, ldy);
  else if (t == 14) prefill_rows_packed<14>(packed, a, M, n0, n1, Y, ldy);
}

// The 32-value-block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) the same way: a
// block of a panel of 16 weight rows, decoded. Per row of x and block: 8
// vpdpbusd into an integer sum per output (Q8_0's q + 128 from -128 times x's
// block sum, so the sum is sum(q x) exactly, as rows32's lanes), then one
// convert and multiply-add by d * d_x, and one multiply-add of the offset
// (-8 d, -16 d, or Q4_1 / Q5_1's m) by x's d_x * sum(x), per 16 outputs.
struct alignas(64) BPanel {
  __m512i q[8];  // q[j]: values 4j..4j+3 of each row, unsigned bytes (Q8_0: q + 128)
  __m512 vd, vo; // d and the offset per value
};

template <int T>
void bdecode_panel(const uint8_t* w, int64_t row_bytes, int rows, int64_t nb, BPanel* out) {
  const int64_t bytes = info(T).bytes;
  PanelPrefetch pf(w, row_bytes, nb);
  for (int64_t i = 0; i < nb; ++i) {
    pf.next();
    // Row c: its 32 values (8 x 4 bytes), then d and the offset, in one register; transposed below.
    __m512i r[16];
    KVQ_UNROLL for (int c = 0; c < kPanel; ++c) {
      const uint8_t* b = w + std::min(c, rows - 1) * row_bytes + i * bytes;
      __m256i q = block32<T>(b);
      if constexpr (T == 8) q = _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80)));
      const float d = h2f(b), o = T == 2 ? -8 * d : T == 6 ? -16 * d : T == 8 ? 0.f : h2f(b + 2);
      r[c] = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_castps_si256(_mm256_setr_ps(d, o, 0, 0, 0, 0, 0, 0)), 1);
    }
    transpose16(r);
    BPanel& P = out[i];
    KVQ_UNROLL for (int j = 0; j < 8; ++j) P.q[j] = r[j];
    P.vd = _mm512_castsi512_ps(r[8]);
    P.vo = _mm512_castsi512_ps(r[9]);
  }
}

// R rows of x against one decoded panel of 32-blocks, the whole K: y[r * 16 + c].
// start: per row and block, where a Q8_0 sum starts (-128 sum(x)); null for the others.
template <int T, int R>
inline void bpanel_rows(const BPanel* P, const Acts& a, const int32_t* start, int64_t m0, float* y) {
  __m512 acc[R], oacc[R];
  KVQ_UNROLL for (int r = 0; r < R; ++r) acc[r] = oacc[r] = _mm512_setzero_ps();
  const int64_t nb = a.nb;
  auto x4 = [](const void* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); };
  for (int64_t i = 0; i < nb; ++i) {
    const BPanel& p = P[i];
    __m512i t[R];
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      const int64_t ai = (m0 + r) * nb + i;
      t[r] = T == 8 ? _mm512_set1_epi32(start[ai]) : _mm512_setzero_si512();
    }
    KVQ_UNROLL for (int j = 0; j < 8; ++j) {
      const __m512i w = p.q[j];
      KVQ_UNROLL for (int r = 0; r < R; ++r) t[r] = _mm512_dpbusd_epi32(t[r], w, x4(a.q + ((m0 + r) * nb + i) * 32 + 4 * j));
    }
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      const int64_t ai = (m0 + r) * nb + i;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r]), _mm512_mul_ps(p.vd, _mm512_set1_ps(a.d[ai])), acc[r]);
      if constexpr (T != 8) oacc[r] = _mm512_fmadd_ps(p.vo, _mm512_set1_ps(a.s[ai]), oacc[r]);
    }
  }
  KVQ_UNROLL for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * kPanel, _mm512_add_ps(acc[r], oacc[r]));
}

template <int T, typename O>
void prefill_rows32(const uint8_t* W, int64_t bytes, const Acts& a, int64_t M, int64_t n0, int64_t n1, O* Y,
                    int64_t ldy) {
  thread_local std::vector<BPanel> decoded;
  thread_local std::vector<int32_t> start;
  const int64_t nb = a.nb;
  if constexpr (T == 8) {  // -128 sum(x) per row and block, from quantize_rows' -128 x 4-value sums
    if (int64_t(start.size()) < M * nb) start.resize(M * nb);
    for (int64_t ai = 0; ai < M * nb; ++ai) {
      int32_t v = 0;
      for (int k = 0; k < 8; ++k) v += a.x4[ai * 8 + k];
      start[ai] = v;
    }
  }
  panel_loop(decoded, nb, M, n0, n1, Y, ldy,
             [&](int64_t n, int rows, BPanel* out) { bdecode_panel<T>(W + n * bytes, bytes, rows, nb, out); },
             [&](auto R, const BPanel* P, int64_t m, float* y) { bpanel_rows<T, decltype(R)::value>(P, a, start.data(), m, y); },
             [](int64_t, int64_t, int64_t, int64_t) {});
}

// From how many rows of x dots() takes the prefill kernels, by block size (32
// or 256; configure sets them from quant/kernels.py's PREFILL_DOTS_FROM_ROWS;
// below, the decode kernels: rows32, rowsK_512).
inline int64_t& prefill_dots_min_rows(int64_t block) {
  static int64_t rows[2] = {int64_t(1) << 62, int64_t(1) << 62};
  return rows[block == 256];
}

// Whether type t has a prefill kernel (every type).
inline bool has_prefill_rows(int64_t t) { return (t >= 10 && t <= 14) || t == 2 || t == 3 || t == 6 || t == 7 || t == 8; }

template <typename O>
void prefill_rows_of(int64_t t, const uint8_t* W, int64_t bytes, const Acts& a, int64_t M, int64_t n0, int64_t n1,
                     O* Y, int64_t ldy) {
  switch (t) {
    case 10: return prefill_rows<10>(W, bytes, a, M, n0, n1, Y, ldy);
    case 11: return prefill_rows<11>(W, bytes, a, M, n0, n1, Y, ldy);
    case 12: return prefill_rows<12>(W, bytes, a, M, n0, n1, Y, ldy);
    case 13: return prefill_rows<13>(W, bytes, a, M, n0, n1, Y, ldy);
    case 14: return prefill_rows<14>(W, bytes, a, M, n0, n1, Y, ldy);
    case 2: return prefill_rows32<2>(W, bytes, a, M, n0, n1, Y, ldy);
    case 3: return prefill_rows32<3>(W, bytes, a, M, n0, n1, Y, ldy);
    case 6: return prefill_rows32<6>(W, bytes, a, M, n0, n1, Y, ldy);
    case 7: return prefill_rows32<7>(W, bytes, a, M, n0, n1, Y, ldy);
    case 8: return prefill_rows32<8>(W, bytes, a, M, n0, n1, Y, ldy);
  }
}
#endif
