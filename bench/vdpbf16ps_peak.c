/* One core's vdpbf16ps peak: 12 independent zmm accumulators, no loads, so
 * the loop is bound by the instruction's throughput alone (its latency is
 * hidden). Reports GFLOP/s per CPU-second (2 x 32 flops per instruction).
 * Built and run by bench/prefill_matmul.py:
 *   gcc -O3 -funroll-loops -march=native vdpbf16ps_peak.c -o peak && ./peak */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

int main(void) {
  __m512 acc[12];
  for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3c003c00);
  const long iters = 100000000;
  struct timespec t0, t1;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t0);
  for (long it = 0; it < iters; it++) {
    for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t1);
  const double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
  float sum = 0;
  for (int i = 0; i < 12; i++) sum += _mm512_reduce_add_ps(acc[i]);
  printf("{\"gflops_per_cpu_s\": %.1f, \"instr_per_ns\": %.3f, \"check\": %g}\n", 2.0 * 32 * 12 * iters / s / 1e9,
         12.0 * iters / s / 1e9, sum);
  return 0;
}
