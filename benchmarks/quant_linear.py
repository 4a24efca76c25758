"""The weight-only quantized linear kernels against the float paths, per number of rows.

    python benchmarks/quant_linear.py [--rows 1,2,4,8,16,32] [--dtype bfloat16] [--threads N] [--shapes llama1b]

For SmolLM2-135M's shapes (gate-up 3072 x 576, down 576 x 1536, LM head 49152 x 576; --shapes
llama1b: a 1B Llama's gate-up 8192 x 2048 and down 2048 x 8192): the float linear (oneDNN-prepacked
on CPUs with native bf16, F.linear otherwise), the int8 and int4 kernels (decode_linear.cpp; "a8
g32": int4_linear_a8, x quantized to int8 per block of 32, GGUF Q4_0's way), and the prompt path
(dequantize, then the float GEMM). Medians of 7 timed
loops, microseconds; where the kernels stop beating the dequantize path is KERNEL_MAX_ROWS in
tokenmill/layers/quantization/weight_only.py. TOKENMILL_CPU_MARCH=x86-64-v3 times the AVX2 build.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu
from tokenmill.layers.quantization import quant_utils as Q
from tokenmill.layers.quantization.unquantized import PackedCPUWeight, cpu_packed_weights_supported

SHAPES = {"smollm2": {"gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)},
          "llama1b": {"gate_up": (8192, 2048), "down": (2048, 8192)}}


def median_us(fn, loops: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter() - start) / loops)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shapes", default="smollm2", choices=list(SHAPES))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert cpu.cpu_kernels_available(), "tokenmill's CPU kernels are not built"
    dtype = getattr(torch, args.dtype)
    packed = cpu_packed_weights_supported(torch.device("cpu"), dtype)
    print(f"kernels: {cpu.vector_isa()}, dtype {args.dtype}, float path: {'oneDNN prepacked' if packed else 'F.linear'}")
    print(f"{'layer':<8}{'rows':>5}{'float':>10}{'int8':>10}{'int4 g32':>10}{'int4 g128':>10}{'a8 g32':>10}{'deq int8':>10}{'deq int4':>10}")
    for name, (n, k) in SHAPES[args.shapes].items():
        w = torch.randn(n, k)
        q8, s8 = Q.quantize_int8(w)
        q8_tiles = cpu.int8_pack(q8)
        q32 = Q.quantize_int4(w, 32, False)
        q128 = Q.quantize_int4(w, 128, False)
        q32_tiles, q128_tiles = cpu.int4_pack(*q32), cpu.int4_pack(*q128)
        wd = w.to(dtype)
        dense = PackedCPUWeight(wd) if packed else (lambda x: F.linear(x, wd))
        loops = 5 if name == "lm_head" else 50
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k).to(dtype)
            times = [
                median_us(lambda: dense(x), loops),
                median_us(lambda: cpu.int8_linear(x, q8_tiles, s8, n, None), loops),
                median_us(lambda: cpu.int4_linear(x, *q32_tiles, 32, n, None), loops),
                median_us(lambda: cpu.int4_linear(x, *q128_tiles, 128, n, None), loops),
                median_us(lambda: cpu.int4_linear_a8(x, *q32_tiles, 32, n, None), loops),
                median_us(lambda: F.linear(x, cpu.int8_dequantize(q8_tiles, s8, n, dtype)), loops),
                median_us(lambda: F.linear(x, cpu.int4_dequantize(*q128_tiles, 128, n, dtype)), loops),
            ]
            print(f"{name:<8}{rows:>5}" + "".join(f"{t:>10.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
