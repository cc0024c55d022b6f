// The machine's read bandwidth for the decode attention's access pattern:
// scattered KV blocks, each read line by line with a software prefetch a
// fixed distance ahead, on 1 or 2 threads. The paged attention kernel reads
// a layer's K/V this way, so this is its ceiling on this machine, measured
// without it; a contiguous read of the same bytes is the reference.
//
//   gcc -O2 -march=native -fopenmp -o /tmp/scattered_read bench/scattered_read.c
//   /tmp/scattered_read [BLOCK_BYTES] [ROW_BYTES] [READ_BYTES] [PREFETCH_LINES]
//
//   BLOCK_BYTES     contiguous bytes per block, blocks in random order (6144:
//                   SmolLM2-135M's one layer's K of a 16-token block in bf16,
//                   16 x 3 heads x 64 x 2 bytes; 0: one contiguous region)
//   ROW_BYTES       row stride inside a block (384: one token's 3 heads)
//   READ_BYTES      bytes read of each row (128: one head, as one work item
//                   of the kernel reads; = ROW_BYTES: whole rows)
//   PREFETCH_LINES  prefetcht0 this many lines ahead (0: none)
//
// Needs AVX-512F or AVX2 (-march=native picks the path).
//
// Prints GB/s of lines read for 1 thread and for OMP_NUM_THREADS (default:
// every core), best of 5 passes over 400 MB.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// One pass over lines [0, n), each thread a contiguous share; returns seconds.
static double pass(const char** lines, size_t n, int dist, int threads) {
  double t0 = now();
  long sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const size_t i0 = n * t / nt, i1 = n * (t + 1) / nt;
#if defined(__AVX512F__)
    __m512i acc = _mm512_setzero_si512();
    for (size_t i = i0; i < i1; ++i) {
      if (dist && i + dist < i1) _mm_prefetch(lines[i + dist], _MM_HINT_T0);
      acc = _mm512_add_epi8(acc, _mm512_load_si512(lines[i]));
    }
    sink += _mm512_reduce_add_epi64(acc);
#else  // AVX2: a line is two 32-byte loads
    __m256i acc = _mm256_setzero_si256();
    for (size_t i = i0; i < i1; ++i) {
      if (dist && i + dist < i1) _mm_prefetch(lines[i + dist], _MM_HINT_T0);
      acc = _mm256_add_epi8(acc, _mm256_load_si256((const __m256i*)lines[i]));
      acc = _mm256_add_epi8(acc, _mm256_load_si256((const __m256i*)(lines[i] + 32)));
    }
    sink += _mm256_extract_epi64(acc, 0) + _mm256_extract_epi64(acc, 3);
#endif
  }
  volatile long keep = sink;
  (void)keep;
  return now() - t0;
}

int main(int argc, char** argv) {
  const size_t block = argc > 1 ? strtoul(argv[1], 0, 10) : 6144;
  const size_t row = argc > 2 ? strtoul(argv[2], 0, 10) : 384;
  const size_t read = argc > 3 ? strtoul(argv[3], 0, 10) : 128;
  const int dist = argc > 4 ? atoi(argv[4]) : 64;
  const size_t total = (size_t)400 << 20;
  const size_t blk = block ? block : (row ? total / row * row : total);
  if (row == 0 || blk % row || row % 64 || read % 64 || read > row) {
    fprintf(stderr, "BLOCK_BYTES must be a multiple of ROW_BYTES, ROW_BYTES and READ_BYTES of 64, READ <= ROW\n");
    return 2;
  }
  const size_t nblk = total / blk;
  char* buf = aligned_alloc(4096, nblk * blk);
  memset(buf, 1, nblk * blk);
  uint32_t* order = malloc(nblk * sizeof *order);
  for (size_t i = 0; i < nblk; ++i) order[i] = (uint32_t)i;
  srand(1);
  for (size_t i = nblk - 1; block && i > 0; --i) {
    const size_t j = (size_t)rand() % (i + 1);
    const uint32_t t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  const size_t per_block = blk / row * (read / 64);
  const size_t n = nblk * per_block;
  const char** lines = malloc(n * sizeof *lines);
  size_t k = 0;
  for (size_t b = 0; b < nblk; ++b)
    for (size_t r = 0; r < blk; r += row)
      for (size_t off = 0; off < read; off += 64) lines[k++] = buf + (size_t)order[b] * blk + r + off;
  const int all = omp_get_max_threads();
  const int counts[2] = {1, all};
  for (int c = 0; c < (all > 1 ? 2 : 1); ++c) {
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const double dt = pass(lines, n, dist, counts[c]);
      if (dt < best) best = dt;
    }
    printf("{\"block_bytes\": %zu, \"row_bytes\": %zu, \"read_bytes\": %zu, \"prefetch_lines\": %d, "
           "\"threads\": %d, \"gb_s\": %.1f}\n",
           block, row, read, dist, counts[c], n * 64.0 / best / 1e9);
  }
  return 0;
}
