"""Peak multiply throughput of one core, per instruction the kernels build on: the ceilings that
bound the quantized GEMMs' speed-ups on the machine at hand.

    python benchmarks/isa_peaks.py

Compiles a small C program (cc, -O2, -march=native) whose loops issue one instruction
back to back into 12 independent accumulators (no loads: the ceiling of the execution ports),
and prints, for those this CPU has:

  vfmadd231ps      float32 FMA (the float32 linears: MKL / oneDNN), 8 or 16 lanes
  vdpbf16ps        bf16 pairs into float32 (AVX512-BF16: oneDNN's bf16 linears, dense_linear)
  vpdpbusd         u8 x s8 quads into int32 (AVX512-VNNI: w8a8's GEMM, kernels/cpu/int8_gemm.cpp)
  avx2 int8 step   one step of w8a8's AVX2 tile (4 rows x 16 channels x 4 inputs: vpbroadcastd,
                   vpabsb, vpsignb, vpmaddubsw, vpmaddwd, vpaddd), what AVX2-only CPUs multiply with

as instructions per cycle (at the clock a chain of dependent adds measures) and multiply-adds per
cycle. E.g. w8a8 over bf16 cannot beat the ratio of their MACs per cycle in its GEMMs (Zen 4:
vpdpbusd 64 against vdpbf16ps 32: 2x), whatever the kernel.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

PROGRAM = r"""
#include <stdio.h>
#include <time.h>
#include <stdint.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int32_t xs[64] __attribute__((aligned(64)));
static int8_t ws[64] __attribute__((aligned(64)));
#define N 50000000L
#define TWELVE(op, r) op(2, r) op(3, r) op(4, r) op(5, r) op(6, r) op(7, r) op(8, r) op(9, r) op(10, r) op(11, r) op(12, r) op(13, r)
#define CLOBBER "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13"
static void report(const char* name, double seconds, double per_iter, double macs, double ghz) {
  printf("%-16s %5.2f per cycle  %6.1f MACs per cycle\n", name, N * per_iter / (seconds * ghz * 1e9), N * per_iter * macs / (seconds * ghz * 1e9));
}
int main(void) {
  long x = 0; double t = now();
  for (long i = 0; i < N * 4; i++) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  const double ghz = N * 16.0 / (now() - t) / 1e9;
  printf("clock            %5.2f GHz (dependent adds)\n", ghz);
#ifdef __FMA__
#if defined(__AVX512F__)
#define FMA(i, r) "vfmadd231ps %%zmm0, %%zmm1, %%zmm" #i "\n\t"
  t = now(); for (long i = 0; i < N; i++) asm volatile(TWELVE(FMA, 0) ::: CLOBBER); report("vfmadd231ps zmm", now() - t, 12, 16, ghz);
#else
#define FMA(i, r) "vfmadd231ps %%ymm0, %%ymm1, %%ymm" #i "\n\t"
  t = now(); for (long i = 0; i < N; i++) asm volatile(TWELVE(FMA, 0) ::: CLOBBER); report("vfmadd231ps ymm", now() - t, 12, 8, ghz);
#endif
#endif
#ifdef __AVX512BF16__
#define BF(i, r) "vdpbf16ps %%zmm0, %%zmm1, %%zmm" #i "\n\t"
  t = now(); for (long i = 0; i < N; i++) asm volatile(TWELVE(BF, 0) ::: CLOBBER); report("vdpbf16ps zmm", now() - t, 12, 32, ghz);
#endif
#ifdef __AVX512VNNI__
#define VN(i, r) "vpdpbusd %%zmm0, %%zmm1, %%zmm" #i "\n\t"
  t = now(); for (long i = 0; i < N; i++) asm volatile(TWELVE(VN, 0) ::: CLOBBER); report("vpdpbusd zmm", now() - t, 12, 64, ghz);
#endif
#ifdef __AVX2__
#define ROW(xo, a0, a1) "vpbroadcastd " #xo "(%1), %%ymm4\n\t" "vpabsb %%ymm4, %%ymm2\n\t" "vpsignb %%ymm4, %%ymm1, %%ymm3\n\t" \
  "vpmaddubsw %%ymm3, %%ymm2, %%ymm3\n\t" "vpmaddwd %%ymm0, %%ymm3, %%ymm3\n\t" "vpaddd %%ymm3, %%ymm" #a0 ", %%ymm" #a0 "\n\t" \
  "vpsignb %%ymm4, %%ymm14, %%ymm4\n\t" "vpmaddubsw %%ymm4, %%ymm2, %%ymm2\n\t" "vpmaddwd %%ymm0, %%ymm2, %%ymm2\n\t" \
  "vpaddd %%ymm2, %%ymm" #a1 ", %%ymm" #a1 "\n\t"
  t = now();
  for (long i = 0; i < N; i++)
    asm volatile("vmovdqu (%0), %%ymm1\n\tvmovdqu 32(%0), %%ymm14\n\t" ROW(0, 5, 6) ROW(4, 7, 8) ROW(8, 9, 10) ROW(12, 11, 12)
                 :: "r"(ws), "r"(xs) : "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm14");
  report("avx2 int8 step", now() - t, 1, 256, ghz);
#endif
  return (int)(x & 1);
}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        source, binary = os.path.join(work, "peaks.c"), os.path.join(work, "peaks")
        with open(source, "w") as f:
            f.write(PROGRAM)
        subprocess.run(["cc", "-O2", "-march=native", source, "-o", binary], check=True)
        flags = sorted({word for line in open("/proc/cpuinfo") if line.startswith("flags") for word in line.split()
                        if word.startswith(("avx", "fma", "amx"))})
        print("# one core;", " ".join(flags))
        subprocess.run([binary], check=True)


if __name__ == "__main__":
    main()
