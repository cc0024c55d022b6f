// bf16 GEMM, y = x @ W^T, built for decode batches and serving every row
// count where it applies (linear.py keeps no other copy of the weight).
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
//      copied), any M >= 0 (decode batches in one pass; a prefill chunk in
//      passes of rows_per_pass rows, split across threads by rows)
//   n: w's N, with (NB - 1) * BN < n <= NB * BN
//   y: [M, n] bf16 contiguous; float32 accumulation (vdpbf16ps), rounded to
//      bf16 round-to-nearest-even (vcvtneps2bf16, torch's rounding for
//      finite values). N % 48 tails use masked stores; odd K reads the last
//      x value alone (never past the row) against zero-padded weights.
//   Needs AVX512_BF16 at build time (-march=native on such a CPU); otherwise
//   both ops are still registered and linear throws.
//
// linear_prefetch(x, packed, n, prefetch) -> y
//   linear's product (the same bits) with another software prefetch of the
//   next column block: 0 prefetcht0 (linear's, below), 1 none (the hardware
//   prefetchers alone), 2 prefetcht1. On Zen 4 (one core, cold 2048 x 2048
//   weights on 2 MiB pages) prefetcht0 held the stream below the plain read
//   rate: none read 31-33 GB/s at 1-4 rows against 27-29 with prefetcht0
//   (a reduction over the bytes: 33), and prefetcht1 was fastest from 8
//   rows (24.5 against 19 GB/s; 17 against 12 at 12 rows), slowest at 1-4
//   (22). Each prefetcht0 holds one of L1's few miss buffers for a DRAM
//   round trip. 3: prefetcht1 of the weight stream itself, AHEAD_LINES
//   ahead of the loads (packed blocks lie end to end, so past a block's end
//   it runs into the next one), by the first row block of each column block
//   only (the others read the block from L2): at 7-8 rows, where the
//   multiply about keeps pace with the read, 5-10% over 2 on Zen 4.
//   moe_experts.cpp picks by rows where moe_op.py says so. Register blocks
//   of up to 8 rows (below), at every row count.
//
// linear_rows(x, packed, n, prefetch, one_pass) -> y
//   linear_prefetch's product (the same bits); one_pass = 1 runs 5-10 rows
//   as one register block (micro_wide: 10 rows x 3 column vectors = 30 zmm
//   accumulators, the x pairs read as embedded broadcasts), so each weight
//   line is loaded once and used by every row. Register blocks of up to 8
//   rows do that up to 8 rows already; at 9-10 they made two row blocks, the
//   second reading the column block again from L2. On Zen 4 (one core,
//   64 cold 2048 x 2048 + 2048 x 1024 experts on 2 MiB pages) one pass took
//   0.80x the time at 9 rows and 0.86x at 10 with linear's prefetcht0 (0.76x,
//   0.85x with mode 3 against the experts' mode 2; 0.92x warm in L3), and
//   1.00-1.07x at 5-8 rows. linear takes it at 9-10 rows; the experts at
//   9-10 (moe_op.expert_prefetch).
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
// ahead (+3-5% on the 30-layer cold set at M = 32). Below ROW_SPLIT_MIN_ROWS
// rows, threads split the blocks of N (at::parallel_for; 960/576/3072/49152
// columns are whole blocks, so two threads get equal halves); from it, the
// rows (split_work). Measured on Zen5 (one core): ~490 GFLOP/s with
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

#if defined(__AVX512BF16__) || defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int NV = 3;            // zmm column vectors per block
constexpr int BN = 16 * NV;      // output columns per block
constexpr int MR_MAX = 8;        // rows per register block (MR_MAX x NV = 24 accumulators)
constexpr int WIDE_MIN = 5;      // micro_wide's rows: WIDE_MIN .. MR_WIDE_MAX
constexpr int MR_WIDE_MAX = 10;
constexpr int LINE = 64;
constexpr int PF_BLOCKS = 1;     // software prefetch runs this many blocks ahead
constexpr int LEAD = 64;         // lines a thread's first block is prefetched ahead of its loads
constexpr int64_t AHEAD_LINES = 128;  // linear_prefetch's mode 3: its distance ahead of the loads (8 KiB)

// Rows of x per pass over a thread's column blocks. A large M (a prefill
// chunk) runs in passes of this many rows, so that one pass's rows of x stay
// in L2 while all the thread's blocks of W go by; in one pass over M = 2048
// rows of K = 1536 float32 (12 MB), every block re-read x from L3 and ran
// ~9% behind oneDNN. Decode batches are one pass.
constexpr int64_t PASS_BYTES = int64_t(384) << 10;
inline int64_t rows_per_pass(int64_t M, int64_t row_bytes) {
  const int64_t fit = PASS_BYTES / std::max<int64_t>(1, row_bytes);
  return std::min(M, std::max<int64_t>(64, fit / 8 * 8));
}

// How threads share a matmul. By column blocks for a decode batch: each
// thread reads its share of W once, and W's read is the cost there. By rows
// for a prefill-sized M: each thread then writes whole rows of y, which the
// next op (silu, the residual norm: torch's ops split rows across threads
// the same way) reads from its own core's cache. Split by columns, half of
// every row came from the other core's L2, and those ops ran ~25-40% longer.
// run(r0, r1, b0, b1) does rows [r0, r1) against column blocks [b0, b1).
constexpr int64_t ROW_SPLIT_MIN_ROWS = 256;
template <typename Run>
inline void split_work(int64_t M, int64_t NB, int64_t block_grain, const Run& run) {
  if (M >= ROW_SPLIT_MIN_ROWS) {
    at::parallel_for(0, M, ROW_SPLIT_MIN_ROWS / 4, [&](int64_t r0, int64_t r1) { run(r0, r1, int64_t(0), NB); });
  } else {
    at::parallel_for(0, NB, block_grain, [&](int64_t b0, int64_t b1) { run(int64_t(0), M, b0, b1); });
  }
}

// Both dtypes' ops: each thread's share of the work (split_work), in passes
// of rows_per_pass(M, row_bytes) rows, every column block of the share per
// pass: block(m0, R, base, extra, b, b0, b1) runs column block b of the
// thread's range [b0, b1) for the pass starting at row m0, whose R row
// blocks have sizes base + 1 (the first `extra`) and base (the rest, as few
// as mr_max allows). task_done() runs once at the end of each thread's share.
template <typename Block, typename Done>
inline void for_each_block(int64_t M, int64_t NB, int64_t block_grain, int64_t row_bytes, int64_t mr_max,
                           const Block& block, const Done& task_done) {
  const int64_t MC = rows_per_pass(M, row_bytes);
  split_work(M, NB, block_grain, [&](int64_t r0, int64_t r1, int64_t b0, int64_t b1) {
    for (int64_t m0 = r0; m0 < r1; m0 += MC) {
      const int64_t mc = std::min(MC, r1 - m0);
      const int64_t R = (mc + mr_max - 1) / mr_max;
      const int64_t base = mc / R, extra = mc % R;
      for (int64_t b = b0; b < b1; ++b) block(m0, R, base, extra, b, b0, b1);
    }
    task_done();
  });
}

// One column block b of a thread's range [b0, b1): its R row blocks (sizes
// base + 1 for the first `extra`, base for the rest) run micro(rows, row,
// pf, pf_lines, pps) in turn, sharing the prefetch of the block pf_blocks
// ahead (block_bytes apart, block_lines lines): row block r requests its
// share of those lines, pps per k step over ksteps steps. A thread's first
// block has nobody to prefetch it, so there (with R >= 2) row block 0
// prefetches the block itself, `lead` lines ahead of its own loads (pps_lead
// a step), and the other row blocks share the next block. Both dtypes' ops
// schedule their blocks through this.
template <typename Micro>
inline void run_column_block(int64_t b, int64_t b0, int64_t b1, int64_t R, int64_t base, int64_t extra,
                             const char* wb, int64_t block_bytes, int64_t block_lines, int64_t ksteps,
                             int64_t lead, int pps_lead, int pf_blocks, const Micro& micro) {
  const bool pf_on = b + pf_blocks < b1;
  const char* pfb = pf_on ? wb + pf_blocks * block_bytes : wb;
  const int64_t pf_total = pf_on ? block_lines : 0;
  const bool first = b == b0 && R >= 2;
  const int64_t R_next = first ? R - 1 : R;
  const int64_t per = (block_lines + R_next - 1) / R_next;
  const int pps_next = int(std::max<int64_t>(1, (per + ksteps - 1) / ksteps));
  int64_t row = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t mr = base + (r < extra ? 1 : 0);
    if (first && r == 0) {
      const bool lead_on = block_lines > lead;
      micro(mr, row, wb + (lead_on ? lead * LINE : 0), lead_on ? block_lines - lead : 0, pps_lead);
    } else {
      const int64_t rr = first ? r - 1 : r;
      const int64_t l0 = std::min(pf_total, rr * per), l1 = std::min(pf_total, (rr + 1) * per);
      micro(mr, row, pfb + l0 * LINE, l1 - l0, pps_next);
    }
    row += mr;
  }
}

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

// HINT 0: prefetcht0 (into L1); 1: prefetcht1 (L2). See linear_prefetch.
template <int HINT>
inline void prefetch_line(const char* p) {
  if constexpr (HINT == 0) {
    asm volatile("prefetcht0 %0" : : "m"(*p));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*p));
  }
}

inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// One register block: rows [0, MR) of x against one packed block, all of K.
// kodd: K is odd, the last pair's second value is read as zero (not past x's row).
// pf, pf_lines, pps: prefetch pf_lines lines from pf, pps per k step.
template <int MR, int HINT>
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
    for (int j = 0; j < pps; ++j) prefetch_line<HINT>(pf + j * LINE);
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

// One register block of MR = 9 or 10 rows: rows [0, MR) against one packed
// block in one pass over the weight stream (micro's product, the same bits:
// each accumulator still sums its k pairs in order). MR x NV = 27-30
// accumulators leave 2-5 of the 32 zmm registers, so the k step takes the
// block's column vectors one at a time (one weight register) and each
// vdpbf16ps reads its x pair as an embedded broadcast from memory ({1to16},
// a load, no register): inline asm, since with intrinsics GCC hoists the
// MR broadcasts out of the 3 column vectors' loops and spills.
inline void dp_bcast(__m512& acc, __m512bh w, const uint16_t* x_pair) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x_pair)));
}

template <int MR, int HINT>
void micro_wide(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict w, int64_t K2, bool kodd,
                uint16_t* __restrict y, int64_t ldy, const __mmask16* masks, const char* pf, int64_t pf_lines,
                int pps) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t kfull = kodd ? K2 - 1 : K2;
  int64_t i = 0;
  // The k step, written out in both loops: through a lambda, GCC kept the
  // accumulators in memory.
#define KVF_WIDE_STEP(k)                                                                     \
  do {                                                                                       \
    const uint16_t* wi = w + (k) * (NV * 32);                                                \
    _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) {                                   \
      __m512bh b = (__m512bh)_mm512_loadu_si512(wi + v * 32);                                \
      asm("" : "+v"(b)); /* one weight register at a time: not all NV loaded up front */    \
      _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) dp_bcast(acc[r][v], b, x + r * ldx + 2 * (k)); \
    }                                                                                        \
  } while (0)
  for (; i < kfull && pf_lines > 0; ++i) {
    for (int j = 0; j < pps; ++j) prefetch_line<HINT>(pf + j * LINE);
    pf += pps * LINE;
    pf_lines -= pps;
    KVF_WIDE_STEP(i);
  }
  for (; i < kfull; ++i) KVF_WIDE_STEP(i);
#undef KVF_WIDE_STEP
  if (kodd) {  // the last pair's second value read as zero, not past x's row
    const uint16_t* wi = w + i * (NV * 32);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m512bh b = (__m512bh)_mm512_loadu_si512(wi + v * 32);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(x[r * ldx + 2 * i]));
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b);
      }
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

template <int HINT, int... I>
constexpr auto make_table(std::integer_sequence<int, I...>) {
  return std::array<MicroFn, sizeof...(I)>{&micro<I + 1, HINT>...};
}
template <int HINT, int... I>
constexpr auto make_wide_table(std::integer_sequence<int, I...>) {
  return std::array<MicroFn, sizeof...(I)>{&micro_wide<I + WIDE_MIN, HINT>...};
}
// [hint][rows - 1]
const std::array<std::array<MicroFn, MR_MAX>, 2> kMicro = {
    make_table<0>(std::make_integer_sequence<int, MR_MAX>{}),
    make_table<1>(std::make_integer_sequence<int, MR_MAX>{})};
// [hint][rows - WIDE_MIN]
constexpr int WIDE_N = MR_WIDE_MAX - WIDE_MIN + 1;
const std::array<std::array<MicroFn, WIDE_N>, 2> kMicroWide = {
    make_wide_table<0>(std::make_integer_sequence<int, WIDE_N>{}),
    make_wide_table<1>(std::make_integer_sequence<int, WIDE_N>{})};

#endif  // __AVX512BF16__

// The software prefetch of linear_prefetch's `prefetch` argument.
enum Prefetch : int64_t { kPrefetchL1 = 0, kPrefetchNone = 1, kPrefetchL2 = 2, kPrefetchAhead = 3 };

at::Tensor linear_rows(const at::Tensor& x_in, const at::Tensor& packed, int64_t n, int64_t prefetch,
                       int64_t one_pass) {
#if !defined(__AVX512BF16__)
  (void)x_in;
  (void)packed;
  (void)n;
  (void)prefetch;
  (void)one_pass;
  TORCH_CHECK(false, "kvferry_gemm.linear: built without AVX512_BF16 (needs a CPU with avx512_bf16 and -march=native)");
#else
  TORCH_CHECK(prefetch >= kPrefetchL1 && prefetch <= kPrefetchAhead,
              "kvferry_gemm.linear_prefetch: prefetch must be 0 (L1), 1 (none), 2 (L2) or 3 (L2, in-stream), got ",
              prefetch);
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
  const int64_t ksteps = std::max<int64_t>(1, K2 - (kodd ? 1 : 0));  // k steps that prefetch
  // Blocks per task: at least ~256K flops each, else one thread does it all.
  const int64_t block_flops = 2 * M * K * BN;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, block_flops));
  const int hint = prefetch == kPrefetchL2 || prefetch == kPrefetchAhead ? 1 : 0;
  const int64_t total_lines = NB * block_lines;
  // one_pass: WIDE_MIN to MR_WIDE_MAX rows are one register block (micro_wide);
  // else, and at other row counts, blocks of at most MR_MAX rows (micro).
  const bool use_wide = one_pass != 0 && M >= WIDE_MIN && M <= MR_WIDE_MAX;
  const int64_t mr_max = use_wide ? M : MR_MAX;
  for_each_block(M, NB, grain, K * 2, mr_max,
                 [&](int64_t m0, int64_t R, int64_t base, int64_t extra, int64_t b, int64_t b0, int64_t b1) {
    const int64_t c0 = b * BN;
    const int64_t cols = std::min<int64_t>(BN, n - c0);
    __mmask16 masks[NV];
    for (int v = 0; v < NV; ++v) {
      const int64_t c = std::clamp<int64_t>(cols - v * 16, 0, 16);
      masks[v] = __mmask16((uint32_t(1) << c) - 1);
    }
    const uint16_t* wb = wp + b * block_elems;
    const uint16_t* xm = xp + m0 * ldx;
    uint16_t* ym = yp + m0 * n;
    run_column_block(b, b0, b1, R, base, extra, reinterpret_cast<const char*>(wb), block_elems * 2, block_lines,
                     ksteps, LEAD, NV, PF_BLOCKS,
                     [&](int64_t mr, int64_t row, const char* pf, int64_t pf_lines, int pps) {
                       if (prefetch == kPrefetchAhead) {  // the stream ahead, to about the copy's end
                         const int64_t from = b * block_lines + AHEAD_LINES;
                         pf = reinterpret_cast<const char*>(wp) + from * LINE;
                         pf_lines = row == 0 ? std::clamp<int64_t>(total_lines - from, 0, block_lines) : 0;
                         pps = NV;
                       }
                       (use_wide ? kMicroWide[hint][mr - WIDE_MIN] : kMicro[hint][mr - 1])(xm + row * ldx, ldx, wb, K2, kodd, ym + row * n + c0, n, masks, pf,
                                            prefetch == kPrefetchNone ? 0 : pf_lines, pps);
                     });
  }, [] {});
  return y;
#endif
}

at::Tensor linear_prefetch(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t prefetch) {
  return linear_rows(x, packed, n, prefetch, 0);
}

// linear takes the one-pass kernel at MR_MAX + 1 to MR_WIDE_MAX rows only:
// below, micro_wide measured no faster than micro (Zen 4: 1.00-1.07x the
// time at 5-8 rows), and there micro is one pass already.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return linear_rows(x, packed, n, kPrefetchL1, x.dim() == 2 && x.size(0) > MR_MAX ? 1 : 0);
}


// ---------------------------------------------------------------------------
// float32 ops, for CPUs without native bf16: the same plan in float32 FMA.
//
// pack_f32(w) -> packed
//   w:      [N, K] float32 (any strides; copied). Any N >= 0, K >= 0.
//   packed: [NB, K, BN] float32, BN = F_NV * F_VL columns per block (48 in
//           the AVX-512F build, 24 in the AVX2 build), NB = ceil(N / BN):
//   packed[b][k][c] = w[b * BN + c][k], zero past w's last row.
//   The layout depends on the build: linear_f32 checks BN.
//
// linear_f32(x, packed, n) -> y
//   x: [M, K] float32, unit column stride (else copied), rows may be strided;
//      any M >= 0 (passes and thread split as the bf16 op's). n: w's N,
//      (NB - 1) * BN < n <= NB * BN.
//   y: [M, n] float32 contiguous, float32 FMA sums over k in order.
//   AVX-512F build: 8 rows x 3 zmm (48 columns) = 24 accumulators, 3 weight
//   loads + 8 broadcasts per 24 FMAs. AVX2+FMA build (no AVX-512F, e.g.
//   -mno-avx512f): 4 rows x 3 ymm (24 columns) = 12 accumulators + 3 weight
//   vectors + 1 broadcast = 16 ymm. The weight vectors are pinned in
//   registers (an empty asm): GCC otherwise folds the loads into every FMA,
//   one load per FMA, which made the AVX2 build load-bound (-25%). A block is
//   one contiguous stream over all of K (BN * 4 bytes per k step), the next
//   block is prefetched (prefetcht0) across the row blocks' k loops and a
//   thread's first block by its first row block, as in the bf16 op; threads
//   split the blocks of N. Whole blocks store unmasked: masked stores cost
//   10% at M >= 32 where y's row stride is a multiple of 4 KiB (N = 3072,
//   49152); a y of >= 1 MiB and >= 16384 columns (the lm_head's) is stored
//   non-temporally (+10% on lm_head).
//   Built without AVX2/FMA: linear_f32 throws.
//   Measured on Zen5 (one core, 30 layers of cold weights): AVX-512 ~235
//   GFLOP/s at M >= 16 (about the 2-FMA-pipe peak), M = 8 streams ~35 GB/s;
//   AVX2 ~122 GFLOP/s at M >= 8 (its peak: half of AVX-512's), so against
//   oneDNN's AVX-512 kernels the AVX2 build wins only at M <= 8. Tried, no
//   better: 6 x 2 and 3 x 4 AVX2 blocks, prefetching 2 blocks ahead, other
//   first-block leads (16, 192 lines).
#if defined(__AVX512F__)
#define KVF_F32 1
constexpr int F_VL = 16;
constexpr int F_NV = 3;
constexpr int F_MR = 8;
#elif defined(__AVX2__) && defined(__FMA__)
#define KVF_F32 1
constexpr int F_VL = 8;
constexpr int F_NV = 3;
constexpr int F_MR = 4;
#else
constexpr int F_VL = 8;
constexpr int F_NV = 3;
constexpr int F_MR = 4;
#endif
constexpr int F_BN = F_VL * F_NV;
constexpr int F_LEAD = 64;  // lines a thread's first block is prefetched ahead of its loads
constexpr int F_PF = 1;     // blocks the software prefetch runs ahead
constexpr int64_t STREAM_MIN_COLS = 16384;  // outputs at least this wide may be stored non-temporally

at::Tensor pack_f32(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "kvferry_gemm.pack_f32: w must be 2-D [N, K], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kFloat, "kvferry_gemm.pack_f32: w must be float32, got ", w.scalar_type());
  TORCH_CHECK(w.device().is_cpu(), "kvferry_gemm.pack_f32: w must be on the CPU");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  const int64_t NB = (N + F_BN - 1) / F_BN;
  at::Tensor out = at::empty({NB, K, F_BN}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* d = dst + b * K * F_BN;
      for (int c = 0; c < F_BN; ++c) {
        const int64_t n = b * F_BN + c;
        if (n < N) {
          const float* s = src + n * K;
          for (int64_t k = 0; k < K; ++k) d[k * F_BN + c] = s[k];
        } else {
          for (int64_t k = 0; k < K; ++k) d[k * F_BN + c] = 0.f;
        }
      }
    }
  });
  return out;
}

#if defined(KVF_F32)

inline void prefetch_line_f32(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }

#if defined(__AVX512F__)
using FV = __m512;
using FMask = __mmask16;
inline FV fv_zero() { return _mm512_setzero_ps(); }
inline FV fv_load(const float* p) { return _mm512_loadu_ps(p); }
inline FV fv_bcast(const float* p) { return _mm512_set1_ps(*p); }
inline FV fv_fma(FV a, FV b, FV c) { return _mm512_fmadd_ps(a, b, c); }
inline FMask fv_mask(int64_t c) { return FMask((uint32_t(1) << c) - 1); }
inline void fv_store(float* p, FV v, FMask m) { _mm512_mask_storeu_ps(p, m, v); }
inline void fv_store_full(float* p, FV v) { _mm512_storeu_ps(p, v); }
inline void fv_stream(float* p, FV v) { _mm512_stream_ps(p, v); }
#else
using FV = __m256;
using FMask = __m256i;
inline FV fv_zero() { return _mm256_setzero_ps(); }
inline FV fv_load(const float* p) { return _mm256_loadu_ps(p); }
inline FV fv_bcast(const float* p) { return _mm256_broadcast_ss(p); }
inline FV fv_fma(FV a, FV b, FV c) { return _mm256_fmadd_ps(a, b, c); }
inline FMask fv_mask(int64_t c) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(c)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline void fv_store(float* p, FV v, FMask m) { _mm256_maskstore_ps(p, m, v); }
inline void fv_store_full(float* p, FV v) { _mm256_storeu_ps(p, v); }
inline void fv_stream(float* p, FV v) { _mm256_stream_ps(p, v); }
#endif

// One register block: rows [0, MR) of x against one packed block, all of K.
// pf, pf_lines, pps: prefetch pf_lines lines from pf, pps per k step.
template <int MR>
void micro_f32(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K,
               float* __restrict y, int64_t ldy, const FMask* masks, const char* pf, int64_t pf_lines, int pps,
               int store) {
  FV acc[MR][F_NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < F_NV; ++v) acc[r][v] = fv_zero();
  int64_t k = 0;
  for (; k < K && pf_lines > 0; ++k) {
    for (int j = 0; j < pps; ++j) prefetch_line_f32(pf + j * LINE);
    pf += pps * LINE;
    pf_lines -= pps;
    const float* wk = w + k * F_BN;
    FV b[F_NV];
#pragma GCC unroll 8
    for (int v = 0; v < F_NV; ++v) {
      b[v] = fv_load(wk + v * F_VL);
      asm("" : "+v"(b[v]));  // keep it in a register: else GCC folds it into every FMA (1 load per FMA)
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const FV a = fv_bcast(x + r * ldx + k);
#pragma GCC unroll 8
      for (int v = 0; v < F_NV; ++v) acc[r][v] = fv_fma(a, b[v], acc[r][v]);
    }
  }
  for (; k < K; ++k) {
    const float* wk = w + k * F_BN;
    FV b[F_NV];
#pragma GCC unroll 8
    for (int v = 0; v < F_NV; ++v) {
      b[v] = fv_load(wk + v * F_VL);
      asm("" : "+v"(b[v]));  // keep it in a register: else GCC folds it into every FMA (1 load per FMA)
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const FV a = fv_bcast(x + r * ldx + k);
#pragma GCC unroll 8
      for (int v = 0; v < F_NV; ++v) acc[r][v] = fv_fma(a, b[v], acc[r][v]);
    }
  }
  if (store == 2) {  // non-temporal
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < F_NV; ++v) fv_stream(y + r * ldy + v * F_VL, acc[r][v]);
    return;
  }
  if (store == 1) {  // whole block, unmasked
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < F_NV; ++v) fv_store_full(y + r * ldy + v * F_VL, acc[r][v]);
    return;
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < F_NV; ++v) fv_store(y + r * ldy + v * F_VL, acc[r][v], masks[v]);
}

using MicroF32Fn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const FMask*,
                            const char*, int64_t, int, int);

template <int... I>
constexpr auto make_table_f32(std::integer_sequence<int, I...>) {
  return std::array<MicroF32Fn, sizeof...(I)>{&micro_f32<I + 1>...};
}
const auto kMicroF32 = make_table_f32(std::make_integer_sequence<int, F_MR>{});

#endif  // KVF_F32

at::Tensor linear_f32(const at::Tensor& x_in, const at::Tensor& packed, int64_t n) {
#if !defined(KVF_F32)
  (void)x_in;
  (void)packed;
  (void)n;
  TORCH_CHECK(false, "kvferry_gemm.linear_f32: built without AVX2+FMA or AVX-512F (needs -march=native on such a CPU)");
#else
  TORCH_CHECK(x_in.dim() == 2, "kvferry_gemm.linear_f32: x must be 2-D [M, K], got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "kvferry_gemm.linear_f32: x and packed must be float32");
  TORCH_CHECK(x_in.device().is_cpu() && packed.device().is_cpu(), "kvferry_gemm.linear_f32: CPU tensors only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == F_BN && packed.is_contiguous(),
              "kvferry_gemm.linear_f32: packed is not from kvferry_gemm.pack_f32 (this build)");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t NB = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "kvferry_gemm.linear_f32: x has K = ", K, ", packed has ", packed.size(1));
  TORCH_CHECK(n > (NB - 1) * F_BN && n <= NB * F_BN, "kvferry_gemm.linear_f32: n = ", n, " does not fit ", NB,
              " packed blocks");
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  if (K == 0) return y.zero_();
  const int64_t ldx = x.stride(0);  // 0 (an expanded row) works too
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t block_elems = K * F_BN;
  const int64_t block_lines = (block_elems * 4 + LINE - 1) / LINE;
  const int64_t block_flops = 2 * M * K * F_BN;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, block_flops));
  // A wide output of 1 MiB or more (the lm_head's logits) is written
  // non-temporally where aligned: it would leave L2 anyway, and regular
  // stores of a y whose row stride is a multiple of 4 KiB cost up to 10% (L1
  // set conflicts). A prefill chunk's layer outputs are stored normally:
  // the next op (silu, the residual norm) then reads them from cache, not
  // DRAM (streamed, those ops took ~25% longer).
  const bool stream = n >= STREAM_MIN_COLS && M * n * int64_t(sizeof(float)) >= (int64_t(1) << 20) &&
                      ((reinterpret_cast<uintptr_t>(yp) | uintptr_t(n * sizeof(float))) % sizeof(FV)) == 0;
  const int pps_lead = int(std::max<int64_t>(1, (F_BN * 4 + LINE - 1) / LINE));
  for_each_block(M, NB, grain, K * 4, F_MR,
                 [&](int64_t m0, int64_t R, int64_t base, int64_t extra, int64_t b, int64_t b0, int64_t b1) {
    const int64_t c0 = b * F_BN;
    const int64_t cols = std::min<int64_t>(F_BN, n - c0);
    FMask masks[F_NV];
    for (int v = 0; v < F_NV; ++v) masks[v] = fv_mask(std::clamp<int64_t>(cols - v * F_VL, 0, F_VL));
    const float* wb = wp + b * block_elems;
    const float* xm = xp + m0 * ldx;
    float* ym = yp + m0 * n;
    const int store = cols < F_BN ? 0 : stream ? 2 : 1;
    run_column_block(b, b0, b1, R, base, extra, reinterpret_cast<const char*>(wb), block_elems * 4, block_lines,
                     K, F_LEAD, pps_lead, F_PF,
                     [&](int64_t mr, int64_t row, const char* pf, int64_t pf_lines, int pps) {
                       kMicroF32[mr - 1](xm + row * ldx, ldx, wb, K, ym + row * n + c0, n, masks, pf, pf_lines,
                                         pps, store);
                     });
  }, [&] {
    if (stream) _mm_sfence();  // order the non-temporal stores before the task ends
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
  m.def("linear_prefetch(Tensor x, Tensor packed, int n, int prefetch) -> Tensor");
  m.impl("linear_prefetch", c10::DispatchKey::CPU, TORCH_FN(linear_prefetch));
  m.def("linear_rows(Tensor x, Tensor packed, int n, int prefetch, int one_pass) -> Tensor");
  m.impl("linear_rows", c10::DispatchKey::CPU, TORCH_FN(linear_rows));
  m.def("pack_f32(Tensor w) -> Tensor");
  m.impl("pack_f32", c10::DispatchKey::CPU, TORCH_FN(pack_f32));
  m.def("linear_f32(Tensor x, Tensor packed, int n) -> Tensor");
  m.impl("linear_f32", c10::DispatchKey::CPU, TORCH_FN(linear_f32));
}
