// bf16 GEMM for small row counts (decode batches): y = x @ W^T.
//
// pack(w) -> packed
//   w:      [N, K] bf16 (any strides; copied). Any N >= 0, K >= 0.
//   packed: [NB, K2, NV * 32] bf16, NV = 3, BN = 16 * NV = 48 columns per block,
//           NB = ceil(N / BN), K2 = ceil(K / 2):
//   packed[b][i][v * 32 + 2 * l + e] = w[b * BN + v * 16 + l][2 * i + e],
//   zero where the row or the column is past w's end (N and K tails).
//
// linear(x, packed, n) -> y
//   x: [M, K] bf16, unit column stride (rows may be strided, else it is
//      copied), any M >= 0 (built for M <= 64; larger M works, unoptimized)
//   n: w's N, with (NB - 1) * BN < n <= NB * BN
//   y: [M, n] bf16 contiguous; float32 accumulation (vdpbf16ps), rounded to
//      bf16 round-to-nearest-even (vcvtneps2bf16, torch's rounding for
//      finite values). N % 48 tails use masked stores; odd K reads the last
//      x value alone (never past the row) against zero-padded weights.
//   Needs AVX512_BF16 at build time (-march=native on such a CPU); otherwise
//   both ops are still registered and linear throws.
//
// Why this layout: one 64-byte load of packed[b][i][v] holds 16 output
// columns x one k pair, the operand vdpbf16ps takes against x's pair
// broadcast as 32 bits (vpbroadcastd). A block of 48 columns is one
// contiguous stream over all of K (3 lines per k pair), so each thread reads
// one sequential stream, and the block (48 x K x 2 bytes: 54 KB at K = 576)
// stays in L1/L2 while every row block of x (up to 8 rows, sizes within one
// of each other) passes over it: 8 x 3 = 24 zmm accumulators, 3 weight
// loads + 8 broadcasts per 24 vdpbf16ps. The next block is
// software-prefetched (prefetcht0 by inline asm: GCC 12 -O3 dropped
// __builtin_prefetch in this project's other kernel), its lines spread over
// all the row blocks' k loops (pps lines per k step), so DRAM streaming
// overlaps the multiply; without it cold weights ran 10-25% slower. A
// thread's first block is prefetched by its own first row block, LEAD lines
// ahead (+3-5% on the 30-layer cold set at M = 32). Threads split the blocks of N
// (at::parallel_for; 960/576/3072/49152 columns are whole blocks, so two
// threads get equal halves). Measured on Zen5 (one core): ~490 GFLOP/s with
// warm weights at M >= 32 (the vdpbf16ps peak); M = 8 streams cold weights at
// ~41 GB/s, the core's DRAM limit. Tried, no better: 4 x 6 and 2 x 12
// register blocks, prefetcht1/t2/nta, prefetching 2 blocks ahead, a
// prefetch cursor running ahead through the thread's whole range.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <utility>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int NV = 3;            // zmm column vectors per block
constexpr int BN = 16 * NV;      // output columns per block
constexpr int MR_MAX = 8;        // rows per register block (MR_MAX x NV = 24 accumulators)
constexpr int LINE = 64;
constexpr int PF_BLOCKS = 1;     // software prefetch runs this many blocks ahead
constexpr int LEAD = 64;         // lines a thread's first block is prefetched ahead of its loads

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "kvferry_gemm.pack: w must be 2-D [N, K], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "kvferry_gemm.pack: w must be bfloat16, got ", w.scalar_type());
  TORCH_CHECK(w.device().is_cpu(), "kvferry_gemm.pack: w must be on the CPU");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  const int64_t K2 = (K + 1) / 2, NB = (N + BN - 1) / BN;
  at::Tensor out = at::empty({NB, K2, NV * 32}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint16_t* d = dst + b * K2 * NV * 32;
      for (int64_t i = 0; i < K2; ++i)
        for (int v = 0; v < NV; ++v)
          for (int l = 0; l < 16; ++l) {
            const int64_t n = b * BN + v * 16 + l;
            for (int e = 0; e < 2; ++e) {
              const int64_t k = 2 * i + e;
              *d++ = (n < N && k < K) ? src[n * K + k] : uint16_t(0);
            }
          }
    }
  });
  return out;
}

#if defined(__AVX512BF16__)

inline void prefetch_line(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }

inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// One register block: rows [0, MR) of x against one packed block, all of K.
// kodd: K is odd, the last pair's second value is read as zero (not past x's row).
// pf, pf_lines, pps: prefetch pf_lines lines from pf, pps per k step.
template <int MR>
void micro(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict w, int64_t K2, bool kodd,
           uint16_t* __restrict y, int64_t ldy, const __mmask16* masks, const char* pf, int64_t pf_lines,
           int pps) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t kfull = kodd ? K2 - 1 : K2;
  int64_t i = 0;
  // Prefetching part of the loop.
  for (; i < kfull && pf_lines > 0; ++i) {
    for (int j = 0; j < pps; ++j) prefetch_line(pf + j * LINE);
    pf += pps * LINE;
    pf_lines -= pps;
    const uint16_t* wi = w + i * (NV * 32);
    __m512bh b[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(wi + v * 32);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = bcast_pair(x + r * ldx + 2 * i);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (; i < kfull; ++i) {
    const uint16_t* wi = w + i * (NV * 32);
    __m512bh b[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(wi + v * 32);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = bcast_pair(x + r * ldx + 2 * i);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  if (kodd) {
    const uint16_t* wi = w + i * (NV * 32);
    __m512bh b[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(wi + v * 32);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(x[r * ldx + 2 * i]));
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[r][v]);
      _mm256_mask_storeu_epi16(y + r * ldy + v * 16, masks[v], h);
    }
}

using MicroFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, bool, uint16_t*, int64_t,
                         const __mmask16*, const char*, int64_t, int);

template <int... I>
constexpr auto make_table(std::integer_sequence<int, I...>) {
  return std::array<MicroFn, sizeof...(I)>{&micro<I + 1>...};
}
const auto kMicro = make_table(std::make_integer_sequence<int, MR_MAX>{});

#endif  // __AVX512BF16__

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n) {
#if !defined(__AVX512BF16__)
  (void)x_in;
  (void)packed;
  (void)n;
  TORCH_CHECK(false, "kvferry_gemm.linear: built without AVX512_BF16 (needs a CPU with avx512_bf16 and -march=native)");
#else
  TORCH_CHECK(x_in.dim() == 2, "kvferry_gemm.linear: x must be 2-D [M, K], got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "kvferry_gemm.linear: x and packed must be bfloat16");
  TORCH_CHECK(x_in.device().is_cpu() && packed.device().is_cpu(), "kvferry_gemm.linear: CPU tensors only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NV * 32 && packed.is_contiguous(),
              "kvferry_gemm.linear: packed is not from kvferry_gemm.pack (this build)");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t NB = packed.size(0), K2 = packed.size(1);
  TORCH_CHECK(K2 == (K + 1) / 2, "kvferry_gemm.linear: x has K = ", K, ", packed has ", K2, " k pairs");
  TORCH_CHECK(n > (NB - 1) * BN && n <= NB * BN, "kvferry_gemm.linear: n = ", n, " does not fit ", NB,
              " packed blocks");
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  if (K == 0) return y.zero_();
  const int64_t ldx = x.stride(0);  // 0 (an expanded row) works too
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const bool kodd = (K & 1) != 0;
  const int64_t block_elems = K2 * NV * 32;
  const int64_t block_lines = block_elems * 2 / LINE;
  // Row blocks: as few as MR_MAX allows, sizes within one of each other.
  const int64_t R = (M + MR_MAX - 1) / MR_MAX;
  const int64_t base = M / R, extra = M % R;
  const int64_t ksteps = std::max<int64_t>(1, K2 - (kodd ? 1 : 0));  // k steps that prefetch
  // Blocks per task: at least ~256K flops each, else one thread does it all.
  const int64_t block_flops = 2 * M * K * BN;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, block_flops));
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c0 = b * BN;
      const int64_t cols = std::min<int64_t>(BN, n - c0);
      __mmask16 masks[NV];
      for (int v = 0; v < NV; ++v) {
        const int64_t c = std::clamp<int64_t>(cols - v * 16, 0, 16);
        masks[v] = __mmask16((uint32_t(1) << c) - 1);
      }
      const uint16_t* wb = wp + b * block_elems;
      // The block PF_BLOCKS ahead, if this thread has it.
      const bool pf_on = b + PF_BLOCKS < b1;
      const char* pfb = reinterpret_cast<const char*>(pf_on ? wb + PF_BLOCKS * block_elems : wb);
      const int64_t pf_total = pf_on ? block_lines : 0;
      // The thread's first block has nobody to prefetch it: with R >= 2 its
      // first row block prefetches it LEAD lines ahead of its own loads and
      // the other row blocks share the next block's lines.
      const bool first = b == b0 && R >= 2;
      const int64_t R_next = first ? R - 1 : R;
      const int64_t per = (block_lines + R_next - 1) / R_next;
      const int pps_next = int(std::max<int64_t>(1, (per + ksteps - 1) / ksteps));
      int64_t row = 0;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t mr = base + (r < extra ? 1 : 0);
        if (first && r == 0) {
          const bool lead_on = block_lines > LEAD;
          kMicro[mr - 1](xp, ldx, wb, K2, kodd, yp + c0, n, masks,
                         reinterpret_cast<const char*>(wb) + (lead_on ? LEAD * LINE : 0),
                         lead_on ? block_lines - LEAD : 0, NV);
        } else {
          const int64_t rr = first ? r - 1 : r;
          const int64_t l0 = std::min(pf_total, rr * per), l1 = std::min(pf_total, (rr + 1) * per);
          kMicro[mr - 1](xp + row * ldx, ldx, wb, K2, kodd, yp + row * n + c0, n, masks, pfb + l0 * LINE, l1 - l0,
                         pps_next);
        }
        row += mr;
      }
    }
  });
  return y;
#endif
}

}  // namespace

TORCH_LIBRARY(kvferry_gemm, m) {
  m.def("pack(Tensor w) -> Tensor");
  m.impl("pack", c10::DispatchKey::CPU, TORCH_FN(pack));
  m.def("linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
