"""int8 x int8 GEMM candidates for `w8a8` against the float linears, on SmolLM2-135M's shapes.

    python benchmarks/int8_gemm.py [--rows 1,8,16,128,512,2048] [--threads N] [--only torch|kernel]

For each layer shape and number of rows M, microseconds per call (median of timed loops):

  f32          F.linear in float32 (MKL)
  bf16         F.linear in bf16
  bf16 packed  oneDNN-prepacked bf16 (tokenmill's unquantized default on CPUs with native bf16)
  quant        the per-token activation quantize alone, in PyTorch ops (absmax / 127, round)
  int_mm       torch._int_mm (int8 x int8 -> int32), quantize and rescale included
  int_mm only  torch._int_mm alone (activations already int8)
  onednn       torch.ops.onednn.qlinear_pointwise on u8 activations (q + 128, zero point 128; with
               s8 activations it takes oneDNN's reference path, seconds per call), per-channel
               weight scales, float32 out; quantize and the per-token rescale included (its
               x_scale is per tensor)
  dyn          torch.ops.quantized.linear_dynamic (fbgemm, per-tensor dynamic activation scale,
               so not what w8a8 computes; for scale)
  w8a16        tokenmill's `int8` decode kernel (decode_linear.cpp, float activations), up to 16 rows
  w8a8         tokenmill's kernel (kernels/cpu/int8_gemm.cpp), quantize and rescale included,
               where it is built (bf16 activations in, bf16 out), activation scales per token
               and group of 128 inputs (the default)
  w8a8 token   the same with one activation scale per token (activation_group_size 0)

torch._int_mm calls oneDNN only on CPUs with AVX512-VNNI (ATen's _int_mm_out_cpu); elsewhere it
runs a scalar triple loop, which ONEDNN_MAX_CPU_ISA does not change.

ONEDNN_MAX_CPU_ISA=AVX2 (and MKL_ENABLE_INSTRUCTIONS=AVX2) make torch's libraries run their
AVX2 code, to see what an AVX2-only CPU would get; TOKENMILL_CPU_MARCH=x86-64-v3 builds
tokenmill's kernel for AVX2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from tokenmill.layers.quantization.w8a8 import ACTIVATION_GROUP_SIZE

# (name, N, K): SmolLM2-135M (hidden 576, intermediate 1536, 9 query and 3 KV heads of 64).
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]


def median_us(fn, budget_s: float = 0.4) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    loops = max(1, int(0.05 / max(once, 1e-7)))
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < 15):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter() - start) / loops)
    return statistics.median(times) * 1e6


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 in PyTorch ops: (q [M, K] int8, scale [M] float32)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    return torch.round(xf / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def candidates(x: torch.Tensor, w: torch.Tensor, only: str | None):
    """(column, thunk) pairs for one shape and M."""
    from tokenmill.kernels import cpu
    from tokenmill.layers.quantization import quant_utils as Q
    from tokenmill.layers.quantization.unquantized import PackedCPUWeight, cpu_packed_weights_supported

    qw, ws = Q.quantize_int8(w)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    if only != "kernel":
        yield "f32", lambda: F.linear(x, w)
        yield "bf16", lambda: F.linear(xb, wb)
        if cpu_packed_weights_supported(torch.device("cpu"), torch.bfloat16):
            packed = PackedCPUWeight(wb)
            yield "bf16 packed", lambda: packed(xb)
        yield "quant", lambda: quantize_rows(xb)
        qwt = qw.t()  # _int_mm takes [K, N]: here a column-major view of [N, K] (measured no slower than a row-major copy)
        qx, xs = quantize_rows(xb)
        yield "int_mm only", lambda: torch._int_mm(qx, qwt)

        def int_mm():
            q, s = quantize_rows(xb)
            return (torch._int_mm(q, qwt).float() * s[:, None] * ws[None, :]).to(torch.bfloat16)

        yield "int_mm", int_mm
        try:
            packed_q = torch.ops.onednn.qlinear_prepack(qw, [x.shape[0], x.shape[1]])
            zp = torch.zeros(ws.shape[0], dtype=torch.int64)

            def onednn():
                q, s = quantize_rows(xb)
                u = (q.to(torch.int16) + 128).to(torch.uint8)
                y = torch.ops.onednn.qlinear_pointwise(u, 1.0, 128, packed_q, ws, zp, None, 1.0, 0, torch.float32, "none", [], "")
                return (y * s[:, None]).to(torch.bfloat16)

            onednn()
            yield "onednn", onednn
        except RuntimeError as exc:
            print(f"# onednn qlinear_pointwise unavailable: {str(exc).splitlines()[0][:200]}")
        with warnings.catch_warnings():  # torch's quantized tensors are deprecated; linear_dynamic still takes them
            warnings.simplefilter("ignore")
            dyn_w = torch.quantize_per_channel(w, ws.double(), torch.zeros(ws.shape[0], dtype=torch.int64), 0, torch.qint8)
        dyn_packed = torch.ops.quantized.linear_prepack(dyn_w, None)
        yield "dyn", lambda: torch.ops.quantized.linear_dynamic(x, dyn_packed)
    if only != "torch" and cpu.cpu_kernels_available():
        if x.shape[0] <= 16:
            qw_tiles = cpu.int8_pack(qw)
            yield "w8a16", lambda: cpu.int8_linear(xb, qw_tiles, ws, qw.shape[0], None)
        for group, label in ((ACTIVATION_GROUP_SIZE, "w8a8"), (0, "w8a8 token")):
            packed_w, colsum = cpu.w8a8_pack(qw, group)
            yield label, lambda p=packed_w, c=colsum, g=group: cpu.w8a8_linear(xb, p, c, ws, None, g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,128,512,2048")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", choices=["torch", "kernel"], default=None)
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmill.kernels import cpu

    isa = cpu.w8a8_isa() if cpu.cpu_kernels_available() else "not built"
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, torch cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}, "
          f"tokenmill kernels: {isa}")
    header = None
    for name, n, k in SHAPES:
        if name not in args.shapes.split(","):
            continue
        gen = torch.Generator().manual_seed(n + k)
        w = torch.randn(n, k, generator=gen) * 0.05
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen)
            results = {col: median_us(fn) for col, fn in candidates(x, w, args.only)}
            if header is None or len(results) > len(header):
                header = list(results)
                print(f"{'layer':<8}{'N x K':>11}{'M':>6}" + "".join(f"{c:>13}" for c in header))
            print(f"{name:<8}{f'{n}x{k}':>11}{m:>6}" + "".join(f"{results.get(c, float('nan')):>13.1f}" for c in header), flush=True)


if __name__ == "__main__":
    main()
