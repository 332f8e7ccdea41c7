"""How fast can one core issue the expert kernel's dot-product instruction, alone and with every core busy?

The native expert kernel at 6-8 tokens is bound by its arithmetic (RESULTS.md, phases AW-BY): on the
H200's host one thread issued about 1.15 G VDPBF16PS a second from cache, and per thread the kernel
ran 2-2.6x slower at 12-15 threads than alone, in cache too. Phase CP's sibling probe found no CPU pair
sharing a core; phase DC found each thread's vector rate halved from 8 threads at nearly the same clock
(RESULTS.md). This probe measures the instruction's own ceiling: a loop of independent
VDPBF16PS (and, for comparison, fp32 FMAs) on registers only, no memory, on 1 thread and on n threads
at once (OpenMP), in G instructions a second per thread. If the all-core rate per thread falls like
the kernel's, the core's clock under this load bounds it, not the kernel; if it does not, the kernel
loses elsewhere (its loads, its barriers). The kernel's own rate alone, divided by this ceiling, is
how much of the instruction's issue rate it uses. A third loop, one dependent chain of integer adds
(one a cycle, no vector unit busy), reads the core's clock in GHz on as many threads; a fourth
mixes 8 VDPBF16PS with 16 FMAs (multiply-adds a second: do the two run side by side?).

Builds a small C program with the system compiler (gcc, -mavx512bf16, OpenMP) in a temporary folder.

    python3 benchmarks/h200/probe_dot_peak.py OUT.json [THREADS, e.g. 1,4,8,12,15]

Threads are bound one per core, spread (OMP_PROC_BIND=spread, OMP_PLACES=cores); DOT_PEAK_UNBOUND=1 leaves
their placement to the OS.
"""
import json
import os
import subprocess
import sys
import tempfile

UNBOUND = os.environ.get("DOT_PEAK_UNBOUND") == "1"

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

/* 16 independent accumulators in registers (more than latency x ports); the empty asm keeps the
   compiler from folding the loop. */
#define ACCS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define DECL(c) __m512 a##c = _mm512_set1_ps((float)(c) * 1e-7f);
#define DP(c) a##c = _mm512_dpbf16_ps(a##c, x, y);
#define FMA(c) a##c = _mm512_fmadd_ps(a##c, m, b);
#define KEEP(c) __asm__ volatile("" : "+v"(a##c));
#define SUM(c) s += _mm512_reduce_add_ps(a##c);

static float dp_loop(long iters) {
  ACCS(DECL)
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3000);
  for (long i = 0; i < iters; ++i) { ACCS(DP) ACCS(KEEP) }
  float s = 0; ACCS(SUM) return s;
}

static float fma_loop(long iters) {
  ACCS(DECL)
  const __m512 m = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(1e-9f);
  for (long i = 0; i < iters; ++i) { ACCS(FMA) ACCS(KEEP) }
  float s = 0; ACCS(SUM) return s;
}

/* 8 VDPBF16PS and 16 FMAs an iteration, independent: whether the core runs both at once (VDPBF16PS
   and the FMAs on different ports) for more multiply-adds than either alone. */
#define DP8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define DECLF(c) __m512 f##c = _mm512_set1_ps((float)(c) * 1e-7f);
#define FMAF(c) f##c = _mm512_fmadd_ps(f##c, m, b);
#define KEEPF(c) __asm__ volatile("" : "+v"(f##c));
#define SUMF(c) s += _mm512_reduce_add_ps(f##c);
static float mixed_loop(long iters) {
  DP8(DECL) ACCS(DECLF)
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3000);
  const __m512 m = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(1e-9f);
  for (long i = 0; i < iters; ++i) { DP8(DP) ACCS(FMAF) DP8(KEEP) ACCS(KEEPF) }
  float s = 0; DP8(SUM) ACCS(SUMF) return s;
}

/* One dependent chain of integer adds (1 cycle each): its rate per thread is the core's clock in GHz,
   with no vector unit busy. */
#define ADD(c) __asm__ volatile("add %1, %0" : "+r"(v) : "r"(k));
static float add_chain(long iters) {
  long v = 0, k = 3;
  for (long i = 0; i < iters; ++i) { ACCS(ADD) }
  return (float)v;
}

static double run(int kind, long iters, int threads) {
  double t0 = 0, t1 = 0;
  float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
#pragma omp barrier
#pragma omp master
    t0 = omp_get_wtime();
    sink += kind == 0 ? dp_loop(iters) : kind == 1 ? fma_loop(iters) : kind == 2 ? add_chain(iters) : mixed_loop(iters);
#pragma omp barrier
#pragma omp master
    t1 = omp_get_wtime();
  }
  if (sink == 12345.0f) printf("#");
  return t1 - t0;
}

int main(int argc, char** argv) {
  const int threads = atoi(argv[1]);
  const long iters = atol(argv[2]);
  static const char* names[] = {"vdpbf16ps", "vfmadd231ps", "add-chain", "vdpbf16ps+vfmadd231ps"};
  static const double instrs[] = {16, 16, 16, 24}, macs[] = {16 * 32, 16 * 16, 0, 8 * 32 + 16 * 16};  /* an iteration */
  for (int kind = 0; kind < 4; ++kind) {
    run(kind, iters / 10, threads);  /* warm: clocks settle */
    const double s = run(kind, iters, threads);
    printf("%s %d %.6f %.4f %.2f\n", names[kind], threads, s, iters * instrs[kind] / s / 1e9, iters * macs[kind] / s / 1e9);
  }
  return 0;
}
"""


def main(path: str, threads: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "dot.c"), os.path.join(tmp, "dot")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run(["gcc", "-O2", "-mavx512f", "-mavx512bf16", "-fopenmp", src, "-o", exe], check=True)
        rows = []
        iters = 20_000_000
        for n in threads:
            env = dict(os.environ) if UNBOUND else dict(os.environ, OMP_PROC_BIND="spread", OMP_PLACES="cores")
            out = subprocess.run([exe, str(n), str(iters)], check=True, capture_output=True, text=True, env=env).stdout
            for line in out.strip().splitlines():
                name, n_threads, seconds, g_per_thread, gmac_per_thread = line.split()
                row = {"instruction": name, "threads": int(n_threads), "seconds": float(seconds),
                       "g_instr_per_s_per_thread": float(g_per_thread), "gmac_per_s_per_thread": float(gmac_per_thread)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(path, "w") as f:
        json.dump({"iterations": iters, "chains": 16, "bound": not UNBOUND, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    counts = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 4, 8, 12, 15, 16]
    main(sys.argv[1], [n for n in counts if n <= os.cpu_count()])
